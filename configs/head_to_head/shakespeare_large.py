"""The larger transformer's final table (configs/head_to_head/common.py): the character transformer's task
(configs/head_to_head/shakespeare.py) with ~4x the parameters (d 256, 8 heads, 3 blocks) and 2x the iterations
(2,000), for the trend with size; validation every 25, three seeds, and the rows of its earlier tables: its size
bounds the table to about 6 hours of a 2-core CPU (experiments/results/benchmark_sizing/SIZING.md), which leaves
the character transformer's other rows out."""

from configs.head_to_head import common
from configs.head_to_head import shakespeare

# AdamW first (Muon's AdamW part takes its rate), then the other kept rows, then the SCSGD rows that tune
ROWS = ("adamw", "sgd", "muon", "kfac", "scsgd", "scsgd_eigen_muon", "scsgd_eigen_muon_polar3")
# The rates the kept rows chose on the task's earlier table (configs/benchmark_fine/shakespeare_large_state_rule.py,
# in the history), and the centres of the other rows' grids: each row's choice there (the three-step row's on the
# step rule's table, configs/benchmark_fine/shakespeare_large_step_rule.py, in the history).
POINTS = {"adamw": 0.000999, "sgd": 0.0999, "muon": 0.00632, "kfac": {"learning_rate": 0.316, "damping": 0.001}}
CENTRES = {"scsgd": 0.316, "scsgd_eigen_muon": 0.00632, "scsgd_eigen_muon_polar3": 0.00632}


def task():
  config = shakespeare.task()
  config.model = "char_transformer_large"
  config.num_steps = 2000
  return config


def get_config():
  config = common.final(task(), 25, POINTS, CENTRES, ROWS)
  config.benchmark.seeds = (0, 1, 2)
  return config
