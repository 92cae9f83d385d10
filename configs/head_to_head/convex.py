"""The convex case: multinomial logistic regression on MNIST pixels, batch 64, 3,000 iterations; the last 10,000
training images held out for choosing, the test split for reporting; its final table
(configs/head_to_head/common.py) validates every 25."""

from configs.head_to_head import common

# The table runs the step bound's code version (common.CODE_BOUND), every row again. The bound is SCSGD's alone (no
# other row runs it), so every other row keeps the point it chose on this task's table of the first version (in the
# history) and runs its seeds there; SCSGD tunes again, centred on its choice there.
POINTS = {"adamw": 0.01, "sgd": 0.1, "nadamw": 0.01, "muon": 0.02, "muon_polar3": 0.02,
          "kfac": {"learning_rate": 0.316, "damping": 0.1}, "psgd_kron": 0.00158, "scsgd_muon": 0.02,
          "scsgd_eigen": 0.01, "scsgd_eigen_muon": 0.02, "scsgd_eigen_muon_polar3": 0.02, "scsgd_eigen_muon_soap": 0.02}
CENTRES = {"scsgd": 0.0316}

def task():
  config = common.task()
  config.model = "logreg"
  config.benchmark.kind = "linear"
  config.num_steps = 3000
  config.update(common.MNIST_HOLDOUT)
  config.train_log_every = 100
  config.eval_every = 100
  config.checkpoint_every = 1000
  return config


def get_config():
  return common.final(task(), 25, POINTS, CENTRES, code=common.CODE_BOUND)
