"""configs/benchmark/convex.py at the finer yardstick (configs/benchmark_fine/common.py): validation every 25 iterations."""

from configs.benchmark import convex
from configs.benchmark_fine import common


def get_config():
  return common.finer(convex.get_config(), "convex", 25)
