"""Shared defaults: the paper's Section 3 recipe (batch 64, Caffe "inv" lr, Nesterov 0.9, 10k steps)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = "mnist"
  config.model = "lenet"
  config.data_dir = ""  # "" -> $TFDS_DATA_DIR or tfds' default
  config.download = True  # let tfds download and prepare if the data is missing (needs TensorFlow)
  config.max_train_examples = -1
  config.max_test_examples = -1
  config.train_split = "train"  # a tfds split string: "train[:50000]" holds out the rest for validation
  config.eval_split = "test"  # the split evaluated every eval_every steps (the paper reports test)
  config.seed = 0
  config.batch_size = 64
  config.num_steps = 10_000

  # eta_t = 0.01 (1 + 1e-4 t)^(-3/4): Caffe's "inv" policy, as in the paper.
  config.schedule = ml_collections.ConfigDict(dict(name="inv", base=0.01, gamma=1e-4, power=0.75))

  # One sub-config per optimizer: its keyword arguments beyond the learning rate, only those that differ
  # from the library's defaults (the command line reaches every argument: --config.optimizer.scsgd.rank=8).
  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = "scsgd"  # any name in experiments/optim/registry.py
  # scsgd_jax.scsgd at its defaults; e.g. dict(statistics="dense", warm_start=False, normalize="none") is the
  # paper's recipe.
  config.optimizer.scsgd = ml_collections.ConfigDict()
  config.optimizer.sgd = ml_collections.ConfigDict(dict(momentum=0.9, nesterov=True))  # the paper's baseline
  # The paper's untuned constant-rate Adam: its own learning rate instead of config.schedule.
  config.optimizer.adam = ml_collections.ConfigDict(dict(learning_rate=1e-3))
  # Not stated in the paper (default 0). Caffe's LeNet solver, whose recipe the paper takes, uses 5e-4.
  config.optimizer.weight_decay = 0.0
  config.max_rows = 256  # input rows sampled per conv layer and step for the statistics (0: all)

  # Paper's plots: train metrics averaged over each 100 iterations, test metrics every 1000.
  config.train_log_every = 100
  config.eval_every = 1000
  config.eval_batch_size = 1000
  config.checkpoint_every = 1000
  config.stop_after_steps = 0  # > 0: stop early (to test resumption)
  config.progress_bar = True
  return config
