"""The larger transformer task's table (configs/benchmark_fine/shakespeare_large.py) on the library version whose
eigenbasis keeps its whole state within Adam's (configs/benchmark_fine/common.py): its six rows, three seeds, all
of one code version. The eigenbasis in front of Muon tunes again on three rates around the rate it chose there;
the others take the rates their grids chose there (their code did not change)."""

from configs.benchmark_fine import common
from configs.benchmark_fine import shakespeare_large

# the eigenbasis row first (the one the version changed), then the first peer and the target's rows
ROWS = ("scsgd_eigen_muon", "muon", "adamw", "sgd", "kfac", "scsgd")


# the points the rows chose on the task's first table (configs/benchmark_fine/shakespeare_large.py, in the history),
# and the centre of the eigenbasis row's grid: its choice there
POINTS = {"muon": 0.00632, "adamw": 0.000999, "sgd": 0.0999, "kfac": {"learning_rate": 0.316, "damping": 0.001},
          "scsgd": 0.316}
CENTRES = {"scsgd_eigen_muon": 0.00632}


def get_config():
  return common.on_state_rule_version(shakespeare_large.get_config(), ROWS, POINTS, CENTRES)
