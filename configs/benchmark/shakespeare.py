"""Head to head on a character transformer LM (tiny_shakespeare, ~0.6M parameters, context 64).

Target on the validation split; the final parameters of every seed are also evaluated on the test
split (reported); loss in nats per character.
"""

from configs.benchmark import common


def get_config():
  config = common.get_config()
  config.dataset = "tiny_shakespeare"
  config.model = "char_transformer"
  config.eval_split = "validation"  # the target's split
  config.benchmark.report_split = "test"  # reported for the final parameters
  config.batch_size = 32
  config.num_steps = 1000
  config.train_log_every = 50
  config.eval_every = 100
  config.checkpoint_every = 500
  config.eval_batch_size = 128
  return config
