"""configs/benchmark/mnist.py at the finer yardstick (configs/benchmark_fine/common.py): validation every 25 iterations."""

from configs.benchmark import mnist
from configs.benchmark_fine import common


def get_config():
  return common.finer(mnist.get_config(), "mnist", 25)
