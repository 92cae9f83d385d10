"""The larger transformer task: the character transformer's (configs/head_to_head/shakespeare.py) with ~4x the
parameters (d 256, 8 heads, 3 blocks) and 2x the iterations (2,000), for the trend with size, sized to about 6
hours of a 2-core CPU for all its rows (experiments/results/benchmark_sizing/SIZING.md): validation every 25
iterations (1.25% of the budget), each row's grid three points half a decade apart centred on the point it chose
on the character transformer (K-FAC's damping fixed to its choice there), 3 seeds, and the rows the comparison
needs. Its first table left the tree (git history): the state-rule table (shakespeare_large_state_rule.py) is the
task's current one."""

import ml_collections

from configs.benchmark_fine import common
from configs.head_to_head import shakespeare_large

# the target (AdamW, Nesterov SGD), the first of the character transformer (Muon, the eigenbasis in front of
# Muon), the paper's method against SGD, and K-FAC; NAdamW and scsgd_eigen do not fit the bound (they run
# when named on the command line)
ROWS = ("adamw", "sgd", "muon", "scsgd_eigen_muon", "scsgd", "kfac")
# the points its rows chose on the character transformer's earlier tables, in the history (the finer one,
# configs/benchmark_fine/shakespeare.py; K-FAC's on the coarse one, configs/benchmark/shakespeare.py)
CENTRES = {"adamw": 0.00316, "sgd": 0.316, "muon": 0.02, "scsgd_eigen_muon": 0.02, "scsgd": 0.316,
           "kfac": {"learning_rate": 1.0, "damping": 0.001}}


def get_config():
  config = common.finer(shakespeare_large.task(), 25)
  config.benchmark.centres = ml_collections.ConfigDict(CENTRES)
  config.benchmark.grid = (0.316, 1.0, 3.16)
  config.benchmark.extend_edge = 1
  config.benchmark.seeds = (0, 1, 2)
  config.benchmark.all_optimizers = ROWS
  config.benchmark.optimizers = ROWS
  return config
