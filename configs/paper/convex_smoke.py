"""A tiny convex run for the tests: 2000 examples, few steps."""

from configs.paper import convex


def get_config():
  config = convex.get_config()
  config.max_train_examples = 2000
  config.ranks = (5, 10)
  config.step_sizes = (0.01, 0.1, 1.0)
  config.settings = ((1, 400), (16, 100))
  config.num_evals = 5
  config.lbfgs_steps = 100
  config.lemma_seeds = 3
  config.timing_dims = (64, 128)
  config.timing_examples = 500
  config.timing_rank = 5
  return config
