"""The warm start against the paper's C_0 = I: experiments/warm_start.py."""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.data_dir = ""  # "" -> $TFDS_DATA_DIR or tfds' default
  config.convex_steps = 500
  config.convex_batch = 64
  config.lenet_steps = 500  # LeNet/MNIST (configs/mnist.py) test loss at 250 and 500
  return config
