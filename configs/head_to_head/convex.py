"""The convex case: multinomial logistic regression on MNIST pixels, batch 64, 3,000 iterations; the last 10,000
training images held out for choosing, the test split for reporting; its final table
(configs/head_to_head/common.py) validates every 25."""

from configs.head_to_head import common

# The rates the kept rows chose on the task's earlier table (configs/benchmark_fine/convex_state_rule.py, in the
# history), and the centres of the other rows' grids, as LeNet's (configs/head_to_head/mnist.py).
POINTS = {"adamw": 0.01, "sgd": 0.1, "nadamw": 0.01, "muon": 0.02, "kfac": {"learning_rate": 0.316, "damping": 0.1}}
CENTRES = {"muon_polar3": 0.02, "psgd_kron": 0.00158, "scsgd": 0.0316, "scsgd_muon": 0.02, "scsgd_eigen": 0.01,
           "scsgd_eigen_muon": 0.02, "scsgd_eigen_muon_polar3": 0.02, "scsgd_eigen_muon_soap": 0.02}


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
  return common.final(task(), 25, POINTS, CENTRES)
