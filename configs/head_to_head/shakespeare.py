"""A character transformer LM (tiny_shakespeare, ~0.6M parameters, context 64): one epoch (~1,000 iterations at
batch 16 x 64 characters); validation split for choosing, test for reporting; loss in nats per character. Its
final table (configs/head_to_head/common.py) validates every 10."""

from configs.head_to_head import common

# The rates the kept rows chose on the task's earlier table (configs/benchmark_fine/shakespeare_state_rule.py, in the
# history), and the centres of the other rows' grids: each row's choice there (the three-step row's on the step rule's
# table, configs/benchmark_fine/shakespeare_step_rule.py, in the history), a new variant centred on the row it varies
# (Muon's for Muon at 3 steps, the eigenbasis in front of Muon's for its two-sided form).
POINTS = {"adamw": 0.00316, "sgd": 0.316, "nadamw": 0.00316, "muon": 0.02,
          "kfac": {"learning_rate": 1.0, "damping": 0.001}}
CENTRES = {"muon_polar3": 0.02, "psgd_kron": 0.00158, "scsgd": 0.316, "scsgd_muon": 0.02, "scsgd_eigen": 0.01,
           "scsgd_eigen_muon": 0.02, "scsgd_eigen_muon_polar3": 0.02, "scsgd_eigen_muon_soap": 0.02}


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
  return common.final(task(), 10, POINTS, CENTRES)
