"""The library's defaults, each in one place (the constructors' signatures and the option objects read them from
here; an option left ``None`` is resolved from them by its ``resolved()``)."""

# The optimizer (scale_by_sketched_conditioning, scsgd)
RANK = 32  # sketch rank k
UPDATE_EVERY = 50  # refresh period N (the paper's)
OVERSAMPLE = 10  # sketch columns beyond the rank
POWER_ITERATIONS = 1  # range-finder power iterations of the dense sketch
STATISTICS_EVERY = 2  # fold the statistics every other step (half the fold cost)
FULL_MAX_DIM_PER_RANK = 4  # Statistics(kind='auto') uses the full C^{1/2} up to n = 4 * rank
EMA_RATE = 0.05  # nu, the EMA weight of a new batch
OUTLIER_THRESHOLD = 100.0  # rows above 100x the running tr C (squared norm) are clipped
BUDGET = "model"  # Statistics(kind='auto'): the model-wide memory rule
NORMALIZE = "embeddings"  # embeddings conditioned by C / (tr C / n); every other kernel by C itself (the paper's)
MOMENTUM = 0.9  # scsgd's Nesterov momentum (the paper's)
# scsgd's step bound: each layer's step at most 2% of its weight's norm (clip_by_relative_norm; the zoo's
# measurements behind the value are in docs/how_it_works.md)
MAX_RELATIVE_STEP = 0.02
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8  # the eigenbasis Adam's (optax.adam's)
GRAFT_DECAY = 0.999  # normalized RMSprop of the grafting (distributed Shampoo's default)
GRAFT_EPS = 1e-8
# The optimizer's eigenvalue floor, relative to tr(C) / n: a damping (no direction amplified more than
# 10x the average scale). The reasons for the value are in docs/how_it_works.md.
EIGENVALUE_FLOOR = 1e-2

# The pure sketching functions: a numerical guard only
SKETCH_EIGENVALUE_FLOOR = 1e-5
SKETCH_OVERSAMPLE = 10

# Flax capture
MAX_ROWS = 256  # input rows sampled per layer and step for the statistics (None: all)
