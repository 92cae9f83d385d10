"""Head to head, the convex case: multinomial logistic regression on MNIST pixels, batch 64, 3,000
iterations; the last 10,000 training images held out for choosing, the test split for reporting."""

from configs.benchmark import common


def get_config():
  config = common.get_config()
  config.model = "logreg"
  config.benchmark.kind = "linear"
  config.num_steps = 3000
  config.update(common.MNIST_HOLDOUT)
  config.train_log_every = 100
  config.eval_every = 100
  config.checkpoint_every = 1000
  return config
