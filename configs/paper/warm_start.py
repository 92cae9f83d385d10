"""The warm start against the paper's C_0 = I: experiments/paper/warm_start.py."""

import ml_collections

from configs.paper import convex
from configs import mnist


def get_config():
  config = ml_collections.ConfigDict()
  config.data_dir = ""  # "" -> $TFDS_DATA_DIR or tfds' default
  config.convex = convex.get_config()  # its features (logistic regression on MNIST pixels, n = 785)
  config.convex_steps = 500
  config.convex_batch = 64
  config.lenet = mnist.get_config()  # LeNet/MNIST at the paper's recipe: test loss at 250 and 500
  config.lenet_steps = 500
  return config
