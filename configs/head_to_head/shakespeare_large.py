"""The larger transformer's final table (configs/head_to_head/common.py): the character transformer's task
(configs/head_to_head/shakespeare.py) with ~4x the parameters (d 256, 8 heads, 3 blocks) and 2x the iterations
(2,000), for the trend with size; validation every 25, five seeds, the rows of its earlier tables plus PSGD Kron
and Muon at three Newton-Schulz steps (the peers nearest the leaders of the smaller transformer's table); its size
(experiments/results/benchmark_sizing/SIZING.md) leaves the character transformer's other rows out."""

from configs.head_to_head import common
from configs.head_to_head import shakespeare

# AdamW first (Muon's AdamW part takes its rate), then the other rows in the order of common.ROWS
ROWS = ("adamw", "sgd", "muon", "muon_polar3", "kfac", "psgd_kron", "scsgd", "scsgd_eigen_muon",
        "scsgd_eigen_muon_polar3")
# The table runs the step bound's code version (common.CODE_BOUND), every row again. The bound is SCSGD's alone, so
# every other row of the first version's table (in the history) keeps the point it chose there and runs its seeds
# there; SCSGD tunes again, centred on its choice there. The new rows tune by the table's protocol: Kron centred on
# its authors' rate (experiments/optim/registry.py), Muon at three steps on Muon's choice (the row it varies).
POINTS = {"adamw": 0.000999, "sgd": 0.0999, "muon": 0.00632, "kfac": {"learning_rate": 0.316, "damping": 0.001},
          "scsgd_eigen_muon": 0.00632, "scsgd_eigen_muon_polar3": 0.00632}
CENTRES = {"scsgd": 0.316, "psgd_kron": 0.0005, "muon_polar3": 0.00632}


def task():
  config = shakespeare.task()
  config.model = "char_transformer_large"
  config.num_steps = 2000
  return config


def get_config():
  return common.final(task(), 25, POINTS, CENTRES, ROWS, code=common.CODE_BOUND)
