"""MNIST / LeNet, the paper's Figures 1-2."""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = "mnist"
  config.model = "lenet"
  # The model's leftover memory goes to the small kernels (conv1, conv2 keep the dense C, as in the paper),
  # still within Adam's state (0.99x): with the per-kernel default SCSGD misses SGD's 10k test loss here.
  config.optimizer.scsgd.budget = "model"
  return config
