"""Head to head on a character transformer LM (tiny_shakespeare, ~0.6M parameters, context 64).

Target on the validation split (the benchmark evaluates ``eval_split``); loss in nats per character.
"""

from configs.benchmark import common


def get_config():
  config = common.get_config()
  config.dataset = "tiny_shakespeare"
  config.model = "char_transformer"
  config.eval_split = "validation"
  config.batch_size = 32
  config.num_steps = 1000
  config.train_log_every = 50
  config.eval_every = 100
  config.checkpoint_every = 500
  config.eval_batch_size = 128
  return config
