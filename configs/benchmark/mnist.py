"""Head to head on LeNet/MNIST: the paper's recipe and budget (10,000 iterations, batch 64, "inv" schedule)."""

from configs.benchmark import common
from configs import mnist


def get_config():
  config = common.get_config()
  base = mnist.get_config()
  config.dataset, config.model, config.schedule = base.dataset, base.model, base.schedule
  config.eval_every = 500
  config.checkpoint_every = 1000
  return config
