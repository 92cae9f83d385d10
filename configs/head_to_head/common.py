"""The head to head's final protocol: each task's table run once on one code version of the library, every row five
seeds, validation every ``cadence`` iterations (the finer yardstick's), rows refused across code versions.

Rates. A row whose updates did not change since the task's current table keeps the rate it chose there (its seed 0
run again: it reproduces that curve); a row whose code changed (the SCSGD family: the eigenbasis' step bound and
significance weight, the banked engine's rounding) or that is new here tunes on three rates half a decade apart
centred on the rate it (or the row it varies) chose on the task's earlier tables, one more past an end that wins.
Every row runs the library's defaults.
"""

import ml_collections

# Every contending row, in the order they run (AdamW first: Muon's AdamW part takes its rate).
ROWS = ("adamw", "sgd", "nadamw", "muon", "muon_polar3", "kfac", "psgd_kron", "scsgd", "scsgd_muon", "scsgd_eigen",
        "scsgd_eigen_muon", "scsgd_eigen_muon_polar3", "scsgd_eigen_muon_soap")
# experiments/run/report.py's code hash of the library and training code every row of these tables runs
CODE = "a876122862c78096"


def final(config, cadence: int, points: dict, centres: dict, rows: tuple[str, ...] = ROWS):
  """``config`` (a task's budget, data and schedule) under the final protocol: ``points`` the rates (and joint
  settings) the kept rows chose on the task's earlier tables, ``centres`` the rate the other rows' grids centre on
  (the one each, or the row it varies, chose there)."""
  config.eval_every = cadence
  config.benchmark.seeds = (0, 1, 2, 3, 4)
  config.benchmark.all_optimizers = rows
  config.benchmark.optimizers = rows
  config.benchmark.ran_with = ml_collections.ConfigDict()  # the library's defaults
  config.benchmark.points = ml_collections.ConfigDict(points)
  config.benchmark.centres = ml_collections.ConfigDict(centres)
  config.benchmark.grid = (0.316, 1.0, 3.16)
  config.benchmark.extend_edge = 1
  config.benchmark.frozen_code = CODE
  return config
