"""LeNet/MNIST's final table (configs/head_to_head/common.py): 1,000 iterations at batch 64
(configs/benchmark/mnist.py's task), validation every 25."""

from configs.benchmark import mnist
from configs.head_to_head import common

TABLES = "experiments/results/benchmark_fine/"


def get_config():
  return common.final(mnist.get_config(), 25, TABLES + "mnist_state_rule",
                      (TABLES + "mnist_step_rule", TABLES + "mnist"))
