"""What every benchmark task shares: the protocol (experiments/head_to_head/benchmark.py) and the schedule.

Each optimizer's settings and the centre of its rate grid are its authors' (``experiments/optim/registry.py``,
``recipe(name, kind)``, with the sources); a task names its model ``kind``.
"""

import ml_collections

from configs import default

# The rows of every task, in the report's default order (AdamW before Muon and SCSGD+Muon: Muon's AdamW
# part takes AdamW's tuned rate).
OPTIMIZERS = ("sgd", "scsgd", "scsgd_adamw", "scsgd_graft", "scsgd_two_sided", "scsgd_two_sided_lean", "adamw",
              "nadamw", "muon", "scsgd_muon", "scsgd_muon_fresh", "shampoo", "shampoo_input", "sketchy", "kfac")
# MNIST's tasks (LeNet, convex) choose on the last 10,000 training images and report on the test split
MNIST_HOLDOUT = dict(train_split="train[:50000]", eval_split="train[50000:]")


def get_config():
  config = default.get_config()
  config.progress_bar = False
  # linear warmup over 5% of the budget, then cosine decay to 0 (peak: the tuned rate)
  config.schedule = ml_collections.ConfigDict(dict(name="warmup_cosine", base=0.01, warmup_fraction=0.05))
  config.benchmark = ml_collections.ConfigDict()
  config.benchmark.kind = "cnn"  # which of the authors' recipes (registry.KINDS): "cnn", "transformer", "linear"
  config.benchmark.all_optimizers = OPTIMIZERS
  config.benchmark.optimizers = OPTIMIZERS  # the ones this invocation runs ("sgd,adamw" on the command line)
  config.benchmark.grid = (0.316, 1.0, 3.16, 10.0)  # x the authors' rate: 4 rates half a decade apart
  config.benchmark.extend_edge = 2  # a best rate at an end of the grid: grow it past that end, at most 2 steps
  config.benchmark.joint_grid = ml_collections.ConfigDict({"kfac": {"damping": (1e-3, 1e-2, 1e-1)}})
  config.benchmark.seeds = (0, 1, 2)  # seed 0 tunes; the chosen point runs every seed
  config.benchmark.single_seed = ()  # optimizers too costly for 3 seeds on the task (said in the report)
  config.benchmark.target_from = ("sgd", "adamw")  # target: the best of their final validation losses
  config.benchmark.report_split = "test"  # the final parameters of every run are evaluated on it
  config.benchmark.rerun = ""  # a run's key: train it again from scratch and compare its final losses
  # the results dir of this task under an earlier protocol whose tuning stands (the same budget and schedule):
  # an optimizer with a committed seed-0 grid there takes the point it chose; the others tune here
  config.benchmark.points_from = ""
  # results dirs of another task (the first with a row's seed-0 grid counts): each row's grid is centred on
  # the point it chose there (its joint settings fixed to it) rather than on its authors' rate
  config.benchmark.centre_from = ()
  # rows that keep a point chosen on an earlier table ({row: rate, or {"learning_rate": .., <joint setting>: ..}}):
  # its seed 0 runs here, no grid; and the points the other rows' grids centre on, in the same form
  config.benchmark.points = ml_collections.ConfigDict()
  config.benchmark.centres = ml_collections.ConfigDict()
  config.benchmark.retune = ()  # rows that tune here although points_from has their grid (their step changed)
  # this protocol's rows ran before scsgd_jax's `normalize` default moved from the paper's 'none' to
  # 'embeddings': every row that takes the argument runs with the value its committed records ran with
  config.benchmark.ran_with = ml_collections.ConfigDict(dict(normalize="none"))
  return config
