"""The step rule's table of the larger transformer task (shakespeare_large_state_rule.py's protocol, one code version):
the eigenbasis in front of Muon with three Newton-Schulz steps beside its five-step row, Muon and the target's
rows (configs/benchmark_fine/common.py)."""

from configs.benchmark_fine import common
from configs.benchmark_fine import shakespeare_large_state_rule


def get_config():
  return common.on_step_rule_version(shakespeare_large_state_rule.get_config(), "shakespeare_large")
