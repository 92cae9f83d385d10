"""Wide layers and many kernels: experiments/benchmark_scaling.py."""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.dims = (256, 1024, 4096, 16384)  # input dimensions n of the Dense layer (n, 1024)
  config.transformer_steps = 200  # timed steps of the transformer after its warm-up
  return config
