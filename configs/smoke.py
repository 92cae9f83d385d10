"""A tiny run for tests and a first check: 40 steps on 512 examples, everything logged and checkpointed."""

from configs import default


def get_config():
  config = default.get_config()
  config.max_train_examples = 512
  config.max_test_examples = 256
  config.num_steps = 40
  config.batch_size = 16
  config.optimizer.scsgd.update_every = 5
  config.optimizer.scsgd.rank = 8
  config.train_log_every = 10
  config.eval_every = 20
  config.checkpoint_every = 20
  config.eval_batch_size = 128
  config.progress_bar = False
  return config
