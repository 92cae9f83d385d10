"""The character transformer's finer table (configs/benchmark_fine/shakespeare.py) on the library version whose
eigenbasis keeps its whole state within Adam's (the finer tables ran the version before it, whose eigenbasis rows
hold more than Adam's state): the eigenbasis rows, the first peer (Muon), the target's rows (AdamW, Nesterov SGD)
and plain SCSGD, five seeds, all of one code version (configs/benchmark_fine/common.py). Plain SCSGD tunes again
too (its rate there came from a grid of the earlier version). It says whether that table's ranking holds on the
version a user installs today. Then the other rows within 20% of the first on the coarse table (K-FAC, NAdamW,
the conditioning in front of Muon), at the rates that table chose: their step is the same on both versions; and
the two peers the coarse table lacks, tuned here: PSGD Kron and Adam in the full eigenbasis (SOAP/EKFAC's input
side, what the sketch costs or saves); then the coarse table's other SCSGD rows, at the rates it chose."""

from configs.benchmark_fine import common
from configs.benchmark_fine import shakespeare

ROWS = ("scsgd_eigen_muon", "scsgd_eigen", "muon", "adamw", "sgd", "scsgd", "kfac", "nadamw", "scsgd_muon", "psgd_kron",
        "scsgd_eigen_full", "scsgd_muon_fresh", "scsgd_adamw", "scsgd_two_sided", "scsgd_two_sided_lean", "scsgd_graft")


# The points the rows that did not tune again chose on the coarse table (configs/benchmark/shakespeare.py, in the
# history), and the centres of the retuned rows' grids: their choices on the first finer table
# (configs/benchmark_fine/shakespeare.py). Kron and the full eigenbasis tune on their authors' grids.
POINTS = {"muon": 0.02, "adamw": 0.00316, "sgd": 0.316, "kfac": {"learning_rate": 1.0, "damping": 0.001},
          "nadamw": 0.00316, "scsgd_muon": 0.02, "scsgd_muon_fresh": 0.02, "scsgd_adamw": 0.00316,
          "scsgd_two_sided": 0.000316, "scsgd_two_sided_lean": 0.000316, "scsgd_graft": 0.000316}
CENTRES = {"scsgd_eigen_muon": 0.02, "scsgd_eigen": 0.01, "scsgd": 0.316}


def get_config():
  return common.on_state_rule_version(shakespeare.get_config(), ROWS, POINTS, CENTRES)
