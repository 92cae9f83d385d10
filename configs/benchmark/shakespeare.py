"""Head to head on a character transformer LM (tiny_shakespeare, ~0.6M parameters, context 64): one epoch
(~1,000 iterations at batch 16 x 64 characters); validation split for choosing, test for reporting; loss in
nats per character."""

from configs.benchmark import common


def get_config():
  config = common.get_config()
  config.dataset = "tiny_shakespeare"
  config.model = "char_transformer"
  config.benchmark.kind = "transformer"
  config.eval_split = "validation"
  config.batch_size = 16
  config.num_steps = 1000
  config.train_log_every = 50
  config.eval_every = 50
  config.checkpoint_every = 500
  config.eval_batch_size = 128
  # Sketchy's step is ~1 s here (7x SGD's): one seed (the protocol allows it above a third of the task's time)
  config.benchmark.single_seed = ("sketchy",)
  return config
