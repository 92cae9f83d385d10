"""Head to head on LeNet/MNIST at batch 64: 1,000 iterations (about 1.3 epochs of the 50,000 training images),
the last 10,000 training images held out for choosing, the test split for reporting."""

from configs.benchmark import common


def get_config():
  config = common.get_config()
  config.num_steps = 1000
  config.update(common.MNIST_HOLDOUT)
  config.train_log_every = 50
  config.eval_every = 50
  config.checkpoint_every = 500
  return config
