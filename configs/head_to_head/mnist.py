"""LeNet/MNIST at batch 64: 1,000 iterations (about 1.3 epochs of the 50,000 training images), the last 10,000
training images held out for choosing, the test split for reporting; its final table (configs/head_to_head/common.py)
validates every 25."""

from configs.head_to_head import common

# The table runs the step bound's code version (common.CODE_BOUND), every row again. The bound is SCSGD's alone (no
# other row runs it), so every other row keeps the point it chose on this task's table of the first version (in the
# history) and runs its seeds there; SCSGD tunes again, centred on its choice there.
POINTS = {"adamw": 0.00316, "sgd": 0.0316, "nadamw": 0.00316, "muon": 0.00632, "muon_polar3": 0.00632,
          "kfac": {"learning_rate": 0.1, "damping": 0.001}, "psgd_kron": 0.0005, "scsgd_muon": 0.00632,
          "scsgd_eigen": 0.00316, "scsgd_eigen_muon": 0.00632, "scsgd_eigen_muon_polar3": 0.00632,
          "scsgd_eigen_muon_soap": 0.00632}
CENTRES = {"scsgd": 0.0316}

def task():
  config = common.task()
  config.num_steps = 1000
  config.update(common.MNIST_HOLDOUT)
  config.train_log_every = 50
  config.eval_every = 50
  config.checkpoint_every = 500
  return config


def get_config():
  return common.final(task(), 25, POINTS, CENTRES, code=common.CODE_BOUND)
