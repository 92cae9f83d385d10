"""configs/benchmark/shakespeare.py at the finer yardstick (configs/benchmark_fine/common.py): validation every 10
iterations. Its first table left the tree (git history): the state-rule table (shakespeare_state_rule.py), built on
this one, is the task's current one."""

from configs.benchmark import shakespeare
from configs.benchmark_fine import common


def get_config():
  return common.finer(shakespeare.get_config(), 10)
