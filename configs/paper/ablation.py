"""SCSGD ablation on MNIST / LeNet: the paper's recipe, 2,000 iterations per variant."""

from configs import mnist


def get_config():
  config = mnist.get_config()
  config.num_steps = 2000
  config.checkpoint_every = 2000
  config.progress_bar = False
  return config
