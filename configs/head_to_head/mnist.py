"""LeNet/MNIST's final table (configs/head_to_head/common.py): 1,000 iterations at batch 64
(configs/benchmark/mnist.py's task), validation every 25."""

from configs.benchmark import mnist
from configs.head_to_head import common

# The rates the kept rows chose on the task's earlier table (configs/benchmark_fine/mnist_state_rule.py, in the
# history), and the centres of the other rows' grids: each row's choice on the earlier tables (the state rule's, the
# step rule's, the first finer one's), a new variant centred on the row it varies (Muon's for Muon at 3 steps, the
# eigenbasis in front of Muon's for its two-sided form).
POINTS = {"adamw": 0.00316, "sgd": 0.0316, "nadamw": 0.00316, "muon": 0.00632,
          "kfac": {"learning_rate": 0.1, "damping": 0.001}}
CENTRES = {"muon_polar3": 0.00632, "psgd_kron": 0.0005, "scsgd": 0.0316, "scsgd_muon": 0.00632, "scsgd_eigen": 0.00316,
           "scsgd_eigen_muon": 0.00632, "scsgd_eigen_muon_polar3": 0.00632, "scsgd_eigen_muon_soap": 0.00632}


def get_config():
  return common.final(mnist.get_config(), 25, POINTS, CENTRES)
