"""The larger transformer task: configs/benchmark/shakespeare.py with ~4x the parameters (d 256, 8 heads, 3
blocks) and 2x the iterations (2,000), under the finer yardstick (validation every 10 iterations), with the rows
that matter for the trend with size. No earlier protocol ran it: every row tunes its rate here."""

from configs.benchmark import shakespeare
from configs.benchmark_fine import common

ROWS = ("adamw", "nadamw", "muon", "kfac", "scsgd_eigen", "scsgd_eigen_muon", "scsgd_muon", "scsgd_two_sided")


def get_config():
  config = common.finer(shakespeare.get_config(), "shakespeare_large", 10)
  config.model = "char_transformer_large"
  config.num_steps = 2000
  config.checkpoint_every = 500
  config.benchmark.points_from = ""
  config.benchmark.seeds = (0, 1, 2)  # 3 seeds until a sizing run (not made yet) says 5 fit the CPU
  config.benchmark.all_optimizers = ROWS
  config.benchmark.optimizers = ROWS
  return config
