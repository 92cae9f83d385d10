"""The character transformer's task (configs/head_to_head/shakespeare.py) at the finer yardstick
(configs/benchmark_fine/common.py): validation every 10 iterations. Its first table left the tree (git history): the
state-rule table (shakespeare_state_rule.py), built on this one, is the task's current one."""

from configs.benchmark_fine import common
from configs.head_to_head import shakespeare


def get_config():
  return common.finer(shakespeare.task(), 10)
