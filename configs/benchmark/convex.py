"""Head to head, the convex case: multinomial logistic regression on MNIST pixels, batch 64."""

from configs.benchmark import common


def get_config():
  config = common.get_config()
  config.dataset = "mnist"
  config.model = "logreg"
  config.batch_size = 64
  config.num_steps = 3000
  config.train_log_every = 100
  config.eval_every = 100
  config.checkpoint_every = 1000
  # A one-layer model: Sketchy needs compression_rank below its input side (785 here: fine), Shampoo one block.
  return config
