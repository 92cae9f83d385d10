"""Step cost of LeNet (batch 64): experiments/benchmark_step.py."""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.steps = 1000  # timed steps per optimizer
  config.block = 50  # steps per timed block (one refresh period)
  return config
