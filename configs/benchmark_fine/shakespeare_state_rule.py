"""The character transformer's finer table (configs/benchmark_fine/shakespeare.py) on the library version whose
eigenbasis keeps its whole state within Adam's (the memory rule that counts the rotated second moment, the tail
and the rotation; the finer tables ran the version before it, whose eigenbasis rows hold more than Adam's state): the
eigenbasis rows, the first peer (Muon) and the target's rows (AdamW, Nesterov SGD), each at the rate the finer
table chose (the memory rule's re-plan chose the same rates on the development task), five seeds, all of one
code version. It says whether the finer table's ranking holds on the version a user installs today."""

from configs.benchmark_fine import shakespeare

ROWS = ("scsgd_eigen_muon", "scsgd_eigen", "muon", "adamw", "sgd", "scsgd")
CODE = "b298a2205499b59b"  # experiments/report.py's code hash of the version these rows run


def get_config():
  config = shakespeare.get_config()
  config.benchmark.points_from = "experiments/results/benchmark_fine/shakespeare"
  config.benchmark.retune = ()
  config.benchmark.frozen_code = CODE
  config.benchmark.all_optimizers = ROWS
  config.benchmark.optimizers = ROWS
  return config
