"""MNIST / LeNet, the paper's Figures 1-2."""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = "mnist"
  config.model = "lenet"
  return config
