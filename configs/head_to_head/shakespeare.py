"""The character transformer's final table (configs/head_to_head/common.py): tiny_shakespeare, 1,000 iterations at
batch 16 x 64 characters (configs/benchmark/shakespeare.py's task), validation every 10."""

from configs.benchmark import shakespeare
from configs.head_to_head import common

# The rates the kept rows chose on the task's current table (configs/benchmark_fine/shakespeare_state_rule.py), and
# the centres of the other rows' grids: each row's choice there (the three-step row's on the step rule's table,
# configs/benchmark_fine/shakespeare_step_rule.py), a new variant centred on the row it varies (Muon's for Muon at 3
# steps, the eigenbasis in front of Muon's for its two-sided form).
POINTS = {"adamw": 0.00316, "sgd": 0.316, "nadamw": 0.00316, "muon": 0.02,
          "kfac": {"learning_rate": 1.0, "damping": 0.001}}
CENTRES = {"muon_polar3": 0.02, "psgd_kron": 0.00158, "scsgd": 0.316, "scsgd_muon": 0.02, "scsgd_eigen": 0.01,
           "scsgd_eigen_muon": 0.02, "scsgd_eigen_muon_polar3": 0.02, "scsgd_eigen_muon_soap": 0.02}


def get_config():
  return common.final(shakespeare.get_config(), 10, POINTS, CENTRES)
