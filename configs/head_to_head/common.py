"""What every head-to-head task shares (experiments/head_to_head/benchmark.py): the schedule, the tuning, the
target (``task``), and the final protocol its tables run (``final``).

Each optimizer's settings and the centre of its rate grid are its authors' (``experiments/optim/registry.py``,
``recipe(name, kind)``, with the sources); a task names its model ``kind``.

The final protocol: each task's table run once on one code version of the library, every row five seeds,
validation every ``cadence`` iterations, rows refused across code versions. Rates: a row whose updates did not
change since the task's current table keeps the rate it chose there (its seed 0 run again: it reproduces that
curve); a row whose code changed (the SCSGD family: the eigenbasis' step bound and significance weight, the banked
engine's rounding) or that is new here tunes on three rates half a decade apart centred on the rate it (or the row
it varies) chose on the task's earlier tables, one more past an end that wins. Every row runs the library's
defaults.
"""

import ml_collections

from configs import default

# Every contending row, in the order they run (AdamW first: Muon's AdamW part takes its rate).
ROWS = ("adamw", "sgd", "nadamw", "muon", "muon_polar3", "kfac", "psgd_kron", "scsgd", "scsgd_muon", "scsgd_eigen",
        "scsgd_eigen_muon", "scsgd_eigen_muon_polar3", "scsgd_eigen_muon_soap")
# experiments/run/report.py's code hash of the library and training code every row of a final table runs: the step
# bound's version (scsgd's default max_relative_step); the tables' first version (a876122862c78096) is in the history
CODE_BOUND = "2a73dc0333b3bedf"
# MNIST's tasks (LeNet, convex) choose on the last 10,000 training images and report on the test split
MNIST_HOLDOUT = dict(train_split="train[:50000]", eval_split="train[50000:]")


def task():
  """The protocol every task starts from: each row's authors' rate x 4 points half a decade apart, at the full
  budget, the schedule below, three seeds at the chosen rate."""
  config = default.get_config()
  config.progress_bar = False
  # linear warmup over 5% of the budget, then cosine decay to 0 (peak: the tuned rate)
  config.schedule = ml_collections.ConfigDict(dict(name="warmup_cosine", base=0.01, warmup_fraction=0.05))
  config.benchmark = ml_collections.ConfigDict()
  config.benchmark.kind = "cnn"  # which of the authors' recipes (registry.KINDS): "cnn", "transformer", "linear"
  config.benchmark.all_optimizers = ROWS
  config.benchmark.optimizers = ROWS  # the ones this invocation runs ("sgd,adamw" on the command line)
  config.benchmark.grid = (0.316, 1.0, 3.16, 10.0)  # x the authors' rate: 4 rates half a decade apart
  config.benchmark.extend_edge = 2  # a best rate at an end of the grid: grow it past that end, at most 2 steps
  config.benchmark.joint_grid = ml_collections.ConfigDict({"kfac": {"damping": (1e-3, 1e-2, 1e-1)}})
  config.benchmark.seeds = (0, 1, 2)  # seed 0 tunes; the chosen point runs every seed
  config.benchmark.single_seed = ()  # optimizers too costly for every seed on the task (said in the report)
  config.benchmark.target_from = ("sgd", "adamw")  # target: the best of their final validation losses
  config.benchmark.report_split = "test"  # the final parameters of every run are evaluated on it
  config.benchmark.rerun = ""  # a run's key: train it again from scratch and compare its final losses
  # the results dir of this task under an earlier protocol whose tuning stands (the same budget and schedule):
  # an optimizer with a committed seed-0 grid there takes the point it chose; the others tune here
  config.benchmark.points_from = ""
  # results dirs of another task (the first with a row's seed-0 grid counts): each row's grid is centred on
  # the point it chose there (its joint settings fixed to it) rather than on its authors' rate
  config.benchmark.centre_from = ()
  # rows that keep a point chosen on an earlier table ({row: rate, or {"learning_rate": .., <joint setting>: ..}}):
  # its seed 0 runs here, no grid; and the points the other rows' grids centre on, in the same form
  config.benchmark.points = ml_collections.ConfigDict()
  config.benchmark.centres = ml_collections.ConfigDict()
  config.benchmark.retune = ()  # rows that tune here although points_from has their grid (their step changed)
  return config


def final(config, cadence: int, points: dict, centres: dict, rows: tuple[str, ...] = ROWS, *, code: str):
  """``config`` (a task's budget, data and schedule) under the final protocol: ``points`` the rates (and joint
  settings) the kept rows chose on the task's earlier tables, ``centres`` the rate the other rows' grids centre on
  (the one each, or the row it varies, chose there); ``code`` the code version every row runs."""
  config.eval_every = cadence
  config.benchmark.seeds = (0, 1, 2, 3, 4)
  config.benchmark.all_optimizers = rows
  config.benchmark.optimizers = rows
  config.benchmark.points = ml_collections.ConfigDict(points)
  config.benchmark.centres = ml_collections.ConfigDict(centres)
  config.benchmark.grid = (0.316, 1.0, 3.16)
  config.benchmark.extend_edge = 1
  config.benchmark.frozen_code = code
  return config
