"""Logistic regression's finer table (configs/benchmark_fine/convex.py) on the library version whose eigenbasis
keeps its whole state within Adam's (configs/benchmark_fine/common.py): the same rows as LeNet/MNIST's
(configs/benchmark_fine/mnist_state_rule.py), NAdamW and SCSGD in front of Muon the first peers there, five
seeds, all of one code version; only the eigenbasis rows tune again."""

from configs.benchmark_fine import common
from configs.benchmark_fine import convex
from configs.benchmark_fine import mnist_state_rule


def get_config():
  return common.on_state_rule_version(convex.get_config(), "convex", mnist_state_rule.ROWS,
                                      retune=("scsgd_eigen", "scsgd_eigen_muon"))
