"""The character transformer's finer table (configs/benchmark_fine/shakespeare.py) on the library version whose
eigenbasis keeps its whole state within Adam's (the memory rule that counts the rotated second moment, the tail
and the rotation; the finer tables ran the version before it, whose eigenbasis rows hold more than Adam's state): the
eigenbasis rows, the first peer (Muon), the target's rows (AdamW, Nesterov SGD) and plain SCSGD, five seeds, all
of one code version. The eigenbasis rows plan otherwise than there, so they tune again on three rates half a
decade apart around the rate each chose in the finer table (one more past an end that wins), plain SCSGD too (its
rate there came from a grid of the earlier version); the others take the coarse protocol's rates, as the finer
table did. It says whether that table's ranking holds on the version a user installs today."""

from configs.benchmark_fine import shakespeare

ROWS = ("scsgd_eigen_muon", "scsgd_eigen", "muon", "adamw", "sgd", "scsgd")
CODE = "b298a2205499b59b"  # experiments/report.py's code hash of the version these rows run


def get_config():
  config = shakespeare.get_config()
  config.benchmark.retune = ("scsgd_eigen", "scsgd_eigen_muon", "scsgd")  # the memory rule re-planned the first two
  config.benchmark.centre_from = ("experiments/results/benchmark_fine/shakespeare",)
  config.benchmark.grid = (0.316, 1.0, 3.16)
  config.benchmark.extend_edge = 1
  config.benchmark.frozen_code = CODE
  config.benchmark.all_optimizers = ROWS
  config.benchmark.optimizers = ROWS
  return config
