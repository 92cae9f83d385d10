"""The head to head at a finer yardstick: a task of configs/head_to_head/ evaluated every ``cadence`` iterations
(about 1.7% of the character transformer's budget), five seeds per row, the rates the coarser protocol chose
standing (same budget and schedule: the tables' configs write them) and the rows that were within reach of the
first. The rows run the library's defaults: `normalize='embeddings'`, which
the coarse rows predate, changes the step of plain `scsgd` on a model with an embedding (the character
transformer: it tunes again there); the other rows that take it are invariant to a kernel's scale (grafted
onto a per-layer norm, orthogonalized, or Adam-normalized), and models without an embedding train as before."""

import ml_collections

# the rows re-run: the target (AdamW), the rows within 20% of the first, the library's own rows, the new ones
# (in the order they run: AdamW first, as Muon's AdamW part takes its rate)
OPTIMIZERS = ("adamw", "muon", "scsgd_eigen", "kfac", "scsgd_eigen_muon", "scsgd_muon", "nadamw", "scsgd_eigen_full",
              "psgd_kron", "scsgd_two_sided", "scsgd_muon_fresh", "scsgd_adamw", "scsgd_two_sided_lean", "scsgd_graft",
              "scsgd", "sgd")


def finer(config, cadence: int):
  """``config`` (a task of configs/head_to_head/, its ``task()``) under the finer yardstick."""
  config.eval_every = cadence
  config.benchmark.seeds = (0, 1, 2, 3, 4)
  config.benchmark.all_optimizers = OPTIMIZERS
  config.benchmark.optimizers = OPTIMIZERS
  # every row of these tables ran this version of the library and training code; the library's defaults moved on
  # after (the eigenbasis' memory rule): its records stand as run, a row re-run today is another version
  config.benchmark.frozen_code = "31933587bb6f6f5d"
  return config


# experiments/run/report.py's code hash of the library version that keeps the eigenbasis' whole state within Adam's
# (the memory rule that counts the rotated second moment, the tail and the rotation)
STATE_RULE_CODE = "b298a2205499b59b"


def on_state_rule_version(config, rows: tuple[str, ...], points: dict, centres: dict):
  """``config`` (a finer table's task) as the table of ``rows`` on the state-rule version, all of one code version:
  the rows of ``points`` run the point they chose on the task's earlier table; the others (the eigenbasis rows,
  which that version plans otherwise, and any whose step changed) tune again on three rates half a decade apart
  around their point of ``centres`` (their authors' rate without one), one more past an end that wins."""
  config.benchmark.points = ml_collections.ConfigDict(points)
  config.benchmark.centres = ml_collections.ConfigDict(centres)
  config.benchmark.grid = (0.316, 1.0, 3.16)
  config.benchmark.extend_edge = 1
  config.benchmark.frozen_code = STATE_RULE_CODE
  config.benchmark.all_optimizers = rows
  config.benchmark.optimizers = rows
  return config


# the step rule's tables: the eigenbasis in front of Muon with three Newton-Schulz steps at Polar Express's
# coefficients (chosen on the development task), beside its five-step row, the first peer and the target's rows
STEP_RULE_ROWS = ("scsgd_eigen_muon_polar3", "muon", "scsgd_eigen_muon", "adamw", "sgd")
# experiments/run/report.py's code hash of the version the step rule's tables run: the fold's guard on float32's sums
# of squares, the eigenbasis U = Q V formed once a step (the same updates, to rounding, as the version before)
STEP_RULE_CODE = "7404a489e98023d7"


def on_step_rule_version(config, task: str):
  """``config`` (``task``'s table on the state-rule version) as the step rule's table, all of one code version: the
  three-step row tunes on three rates half a decade apart around the rate its five-step row chose on that table
  (one more past an end that wins); the other rows take the rates that table ran (its directory's seed-0 grid)."""
  state_rule = f"experiments/results/benchmark_fine/{task}_state_rule"
  config.benchmark.points = ml_collections.ConfigDict()
  config.benchmark.centres = ml_collections.ConfigDict()
  config.benchmark.retune = ()
  config.benchmark.points_from = state_rule
  config.benchmark.centre_from = (state_rule,)
  config.benchmark.centre_as = {"scsgd_eigen_muon_polar3": "scsgd_eigen_muon"}
  config.benchmark.frozen_code = STEP_RULE_CODE
  config.benchmark.all_optimizers = STEP_RULE_ROWS
  config.benchmark.optimizers = STEP_RULE_ROWS
  return config
