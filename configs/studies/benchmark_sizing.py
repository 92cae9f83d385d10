"""The runs that sized the larger transformer's final table (experiments/results/benchmark_sizing/SIZING.md),
through the head-to-head harness (``python -m experiments.head_to_head.benchmark``): the task's model and data
(configs/head_to_head/shakespeare_large.py), 60 iterations a row at its authors' rate, one seed, one validation
at the end; each row's step time, compile time and state bytes then bound the table's cost."""

from configs.head_to_head import shakespeare_large

# the rows the final table could hold (SGD runs at AdamW's step, plain SCSGD at the eigenbasis' on the character
# transformer, so neither is sized)
ROWS = ("adamw", "nadamw", "muon", "kfac", "scsgd_eigen", "scsgd_eigen_muon", "scsgd_muon", "scsgd_two_sided")


def get_config():
  config = shakespeare_large.task()
  config.num_steps = 60
  config.eval_every = 60
  config.train_log_every = 20
  config.benchmark.all_optimizers = ROWS
  config.benchmark.optimizers = ROWS
  config.benchmark.grid = (1.0,)  # the authors' rate alone
  config.benchmark.extend_edge = 0
  config.benchmark.seeds = (0,)
  config.benchmark.joint_grid.kfac.damping = (0.001,)
  return config
