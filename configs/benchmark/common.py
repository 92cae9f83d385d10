"""What every benchmark task shares: the optimizers, their grid centres, the protocol."""

import ml_collections

from configs import default

# Each optimizer's documented default learning rate: the centre of its grid.
#   sgd, scsgd: the paper's 0.01 (Caffe's LeNet solver); adamw, nadamw, scsgd_adamw: optax's/Adam's 1e-3;
#   muon: 0.02 (Muon's reference setting); shampoo, sketchy: 1e-3 (distributed_shampoo grafts onto Adam);
#   kfac: no documented default for its optax interface (kfac-jax's own optimizer adapts it): SGD's 0.01,
#   as it is chained with the same Nesterov SGD.
DEFAULT_LR = dict(sgd=0.01, scsgd=0.01, adamw=1e-3, nadamw=1e-3, muon=0.02, shampoo=1e-3, sketchy=1e-3,
                  scsgd_adamw=1e-3, kfac=0.01)


def get_config():
  config = default.get_config()
  config.progress_bar = False
  config.schedule = ml_collections.ConfigDict(dict(name="constant", base=0.01))  # optax's default: constant
  for name in DEFAULT_LR:
    if name not in config.optimizer:
      config.optimizer[name] = ml_collections.ConfigDict()
  config.benchmark = ml_collections.ConfigDict()
  config.benchmark.optimizers = tuple(DEFAULT_LR)
  config.benchmark.default_lr = ml_collections.ConfigDict(DEFAULT_LR)
  config.benchmark.grid = (0.1, 0.316, 1.0, 3.16, 10.0)  # x the default: 5 log-spaced values, one decade each way
  config.benchmark.extend_edge = 2  # a best rate at an end of the grid: grow it past that end, at most 2 steps
  config.benchmark.tune_fraction = 0.2  # the grid runs a fifth of the budget, seed 0
  config.benchmark.seeds = (0, 1, 2)  # then these seeds at the full budget and the chosen rate
  config.benchmark.target_from = ("sgd", "adamw")  # target: the best of their final losses
  config.benchmark.report_split = ""  # a split the final parameters are also evaluated on ("": none)
  return config
