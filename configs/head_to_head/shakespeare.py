"""A character transformer LM (tiny_shakespeare, ~0.6M parameters, context 64): one epoch (~1,000 iterations at
batch 16 x 64 characters); validation split for choosing, test for reporting; loss in nats per character. Its
final table (configs/head_to_head/common.py) validates every 10."""

from configs.head_to_head import common

# The table runs the step bound's code version (common.CODE_BOUND), every row again. The bound is SCSGD's alone (no
# other row runs it), so every other row keeps the point it chose on this task's table of the first version (in the
# history) and runs its seeds there; SCSGD tunes again, centred on its choice there.
POINTS = {"adamw": 0.00316, "sgd": 0.316, "nadamw": 0.00316, "muon": 0.02, "muon_polar3": 0.02,
          "kfac": {"learning_rate": 1.0, "damping": 0.001}, "psgd_kron": 0.00158, "scsgd_muon": 0.02,
          "scsgd_eigen": 0.01, "scsgd_eigen_muon": 0.02, "scsgd_eigen_muon_polar3": 0.02,
          "scsgd_eigen_muon_soap": 0.02}
CENTRES = {"scsgd": 0.316}


def task():
  config = common.task()
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
  return config


def get_config():
  return common.final(task(), 10, POINTS, CENTRES, code=common.CODE_BOUND)
