"""LeNet/MNIST's finer table (configs/benchmark_fine/mnist.py) on the library version whose eigenbasis keeps its
whole state within Adam's (configs/benchmark_fine/common.py): the eigenbasis rows, the first there (K-FAC, SCSGD
in front of Muon), Muon, the target's rows (AdamW, Nesterov SGD), plain SCSGD and NAdamW, five seeds, all of one
code version. Only the eigenbasis rows tune again (the model has no embedding, so no other row's step changed)."""

from configs.benchmark_fine import common
from configs.benchmark_fine import mnist

ROWS = ("scsgd_eigen_muon", "scsgd_eigen", "adamw", "sgd", "kfac", "scsgd_muon", "muon", "scsgd", "nadamw")


def get_config():
  return common.on_state_rule_version(mnist.get_config(), "mnist", ROWS, retune=("scsgd_eigen", "scsgd_eigen_muon"))
