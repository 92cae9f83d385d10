"""Head to head: every optimizer on one task under one protocol, each run committed as it finishes.

  python -m experiments.head_to_head.benchmark --config configs/head_to_head/<task>.py \\
      --workdir workdir/head_to_head/<task> --results_dir experiments/results/head_to_head/<task> \\
      --data_dir ../shared/tfds [--config.benchmark.optimizers=sgd,adamw]

Protocol (``config.benchmark``):

- **Tuning at the full budget, equal for all.** Each optimizer's rate from a log grid
  (``grid``: multiples of its authors' rate, half a decade apart, ``experiments/optim/registry.py`` cites
  each), one full-budget run per rate on seed 0, chosen by the final loss on ``config.eval_split``
  (a validation split; a diverged run loses). A best rate at an end of the grid grows the grid
  past that end (``extend_edge`` steps at most). An optimizer with a second hyperparameter without
  an upstream default (``joint_grid``: K-FAC's damping) tunes it jointly with the rate.
  Then ``seeds[1:]`` at the chosen point; the seed-0 run is one of the seeds. ``points`` gives a row the
  point it keeps (chosen on an earlier table: its seed 0 runs, no grid), ``centres`` the point its grid is
  centred on; ``points_from`` / ``centre_from`` (results dirs of committed runs) read those points from an
  earlier table's seed-0 grids instead (``centre_as``: the point another row chose there).
- **The schedule users train with** (the task config's ``schedule``: warmup then cosine).
- **Each optimizer as its authors run it**: ``registry.recipe(name, benchmark.kind)``.
- **Every run is its own unit**: trained in ``<workdir>/<key>``, then its record (command, commit,
  package versions, machine, load average, the fully resolved config, metrics rows, the final
  parameters' loss on ``report_split``) written to ``<results_dir>/runs/<key>.json``, to be
  committed at once. A run whose committed record holds the same settings is not run again, so
  the benchmark resumes from the repository alone; a record of other settings is re-run.
- The report (``README.md``, ``results.json``, curves) is rebuilt from the records after every
  run: optimizers ranked by iterations to the target (the best final validation loss, median of
  seeds, of ``target_from``), then final validation and test loss, state bytes, step-time ratio
  against SGD; the sanity anchors (a trivial model's loss); every grid point.
- ``--config.benchmark.rerun=<key>`` trains one recorded run again in a scratch workdir and prints
  its final losses beside the committed ones.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Optional, Sequence

import jax
import ml_collections
from absl import flags

from experiments.run import build as build_lib
from experiments.run import cli
from experiments.run import data as data_lib
from experiments.run import errors
from experiments.run import metrics
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.head_to_head import baselines
from experiments.head_to_head import benchmark_report
from experiments.head_to_head import grid
from experiments.head_to_head.checks import check_writable, exploded, missing_evaluations  # noqa: F401
from experiments.head_to_head.grid import (RUNS, Point, best_point, earlier_grid, joint_points, key,  # noqa: F401
                                           learning_rates, names, read_record, record_point, tune)
from experiments.run import report
from experiments.run import train
from experiments.run import validate as validate_lib
from experiments.run import workdir as workdir_lib

FLAGS = flags.FLAGS
HARNESS_LOCK = ".harness.lock"  # <results_dir>/.harness.lock: one live harness per task (not committed)


def run_config(config, name: str, point: Point, seed: int, extra: Optional[dict] = None):
  """The config of one run: the task's, with optimizer ``name`` at its recipe, ``point`` and ``extra``."""
  cfg = ml_collections.ConfigDict(config.to_dict())
  with cfg.unlocked():
    del cfg["benchmark"]  # the protocol is the harness's: a run's recorded config is what it trains
  cfg = optimizers.variant(cfg, {"name": name, **registry.recipe(name, config.benchmark.kind).settings,
                                 **dict(point.joint), **(extra or {})})
  cfg.schedule.base = point.learning_rate
  cfg.seed = seed
  return cfg


def state_bytes(cfg) -> int:
  """The bytes of the optimizer state run ``cfg`` builds, from shapes."""
  shapes = build_lib.abstract_state(build_lib.build(cfg, abstract=True))["opt_state"]
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


class Harness:
  """Runs (or finds committed) the runs of one task and rebuilds its report."""

  def __init__(self, config, workdir: str, results_dir: str, command: str):
    self.config, self.workdir, self.results_dir, self.command = config, workdir, results_dir, command

  def path(self, key_: str) -> str:
    return os.path.join(self.results_dir, RUNS, f"{key_}.json")

  def extra(self, name: str) -> dict:
    """Settings that come from another optimizer's tuning: Muon's AdamW part at AdamW's own chosen rate."""
    arg = registry.entry(name).adam_rate
    return {arg: self.choose("adamw")[0].learning_rate} if arg else {}

  def committed(self, name: str, point: Point, seed: int) -> Optional[dict]:
    """The committed record of this run if it holds today's settings (else None, saying why), or, under
    ``benchmark.frozen_code``, if it ran that code version and differs from today's settings in library
    defaults alone (the table stands as that version ran it; the report marks rows of any other)."""
    path = self.path(key(name, point, seed))
    if not os.path.exists(path):
      return None
    rec = read_record(path)
    if rec is None:
      return None
    cfg = run_config(self.config, name, point, seed, self.extra(name))
    missing = [] if rec["diverged"] else missing_evaluations(cfg, rec["rows"])
    if missing:  # a record cut short (by hand or a tool): its final loss is not the run's
      print(f"{path}: incomplete record (no evaluation at steps {missing[:3]}{' ...' if len(missing) > 3 else ''}"
            "): run again", file=sys.stderr, flush=True)
      return None
    now = train.record(cfg)
    diff = workdir_lib.config_differences(rec["config"], now)
    frozen = self.config.benchmark.get("frozen_code")
    defaults_only = all(k.endswith(workdir_lib.LIBRARY_DEFAULT) for k, _, _ in diff)
    if diff and frozen and rec.get("code_hash") == frozen and defaults_only:
      # the table's code version: the library's defaults moved on after its rows ran, the rows stand as run
      return rec
    if diff:
      said = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in diff[:6])
      print(f"{key(name, point, seed)}: the committed record has other settings ({said}): run again", flush=True)
      return None
    return rec

  def run(self, name: str, point: Point, seed: int) -> dict:
    """The record of one run: the committed one if its settings are today's, else trained now and written."""
    rec = self.committed(name, point, seed)
    if rec is not None:
      return rec
    k = key(name, point, seed)
    self.check_code_version(k)
    cfg = run_config(self.config, name, point, seed, self.extra(name))
    workdir = os.path.join(self.workdir, k)
    rec = train_one(cfg, workdir, self.config.benchmark.report_split)
    rec.update(key=k, optimizer=name, learning_rate=point.learning_rate, joint=dict(point.joint), seed=seed,
               command=f"{self.command} --config.benchmark.rerun={k}")
    path = report.write_results(os.path.dirname(self.path(k)), rec, rec["command"],
                                filename=os.path.basename(self.path(k)))
    with open(path) as f:
      rec = json.load(f)  # as committed: with its commit, versions and machine
    print(f"{k}: final {self.config.eval_split} loss {benchmark_report.final(rec):.4f}"
          + (" (diverged)" if rec["diverged"] else ""),
          flush=True)
    return rec

  def check_code_version(self, what: str) -> None:
    """Under ``benchmark.frozen_code`` a row is trained only by that version of the library and training code:
    a checkout of another would write a row of another version into the table (refused before any work)."""
    frozen = self.config.benchmark.get("frozen_code")
    running = report.provenance()["code_hash"]
    if frozen and running != frozen:
      raise errors.ConfigError(
          f"{what}: this table's rows run code version {frozen} (config.benchmark.frozen_code), this checkout's "
          f"library and training code is {running}: run the harness from a checkout of that version (a `git "
          "worktree` of a commit whose code hashes to it), or give the table today's version and run every row.")

  def choose(self, name: str) -> tuple[Point, dict[Point, float]]:
    """The tuned point of ``name`` (running its seed-0 grid as needed) and every grid point's loss; with
    ``benchmark.points_from``, the point that task's committed seed-0 grid chose, where it has one (unless
    ``benchmark.retune`` names ``name``: a setting that moves its step changed since that grid ran); with
    ``benchmark.points``, the point given there (its seed 0 run here is its one grid point)."""
    b = self.config.benchmark
    kept = grid.given(self.config, "points", name)
    if kept is not None:
      return kept, {kept: benchmark_report.final(self.run(name, kept, 0))}
    tried = earlier_grid(b.get("points_from", ""), name) if name not in b.get("retune", ()) else {}
    for joint in joint_points(self.config, name) if not tried else ():
      losses = tune(lambda lr, j=joint: benchmark_report.final(self.run(name, Point(lr, j), 0)),
                    learning_rates(self.config, name),
                    b.extend_edge)
      tried.update({Point(lr, joint): v for lr, v in losses.items()})
    return best_point(tried), tried

  def optimizer(self, name: str) -> dict:
    best, tried = self.choose(name)
    seeds = list(self.config.benchmark.seeds)
    if name in self.config.benchmark.single_seed:
      seeds = seeds[:1]
    records = {seed: self.run(name, best, seed) for seed in seeds}
    return {"point": best, "tried": tried, "seeds": records}


def train_one(cfg, workdir: str, report_split: str) -> dict:
  """Trains one run (resuming its workdir, or starting it over if it holds another config: the committed
  records are the benchmark's state, a workdir only a cache) and returns its record (without its key).

  A finished run whose metrics miss an evaluation (a curve with a hole, whatever made it) is trained once
  more from scratch; missing again, it stops the harness naming the steps: no record with a hole is written."""
  try:
    workdir_lib.check_config(workdir, train.record(cfg))
  except errors.WorkdirError as e:
    print(f"starting over: {e}", file=sys.stderr, flush=True)
    shutil.rmtree(workdir)
  load_before = os.getloadavg()
  for attempt in range(2):
    diverged = False
    try:
      train.train_and_evaluate(cfg, workdir)
    except errors.DivergedError as e:
      print(f"warning: {e}", file=sys.stderr, flush=True)
      diverged = True
    rows = metrics.read(os.path.join(workdir, train.METRICS_FILE))
    missing = [] if diverged else missing_evaluations(cfg, rows)
    if not missing:
      break
    message = f"{workdir}: its metrics miss the evaluations of steps {missing[:5]}{' ...' if len(missing) > 5 else ''}"
    if attempt:
      raise errors.WorkdirError(f"{message}, again after training it from scratch")
    print(f"starting over: {message}", file=sys.stderr, flush=True)
    shutil.rmtree(workdir)
  start = train.evaluate_start(cfg, cfg.eval_split)["loss"]
  final = None if diverged else exploded(rows, start)
  if final is not None:
    print(f"warning: {workdir}: its final loss {final:.4g} is above its loss before the first step ({start:.4g}): "
          "marked diverged", file=sys.stderr, flush=True)
    diverged = True
  out = {"config": train.record(cfg), "diverged": diverged, "rows": rows, "start_loss": start,
         "state_bytes": state_bytes(cfg),
         "load_average_1min": [load_before[0], os.getloadavg()[0]]}
  if report_split and not diverged:
    out["report"] = train.evaluate_checkpoint(cfg, workdir, report_split)
  return out


def validate(config) -> None:
  """Every seed-0 grid run's config, before any run (a bad override is one line, nothing trained)."""
  if config.benchmark.kind not in registry.KINDS:
    raise errors.ConfigError(f"config.benchmark.kind: {config.benchmark.kind!r}; choose one of {registry.KINDS}.")
  if not len(config.benchmark.grid) and not config.benchmark.get("points"):
    raise errors.ConfigError("config.benchmark.grid is empty: each row's rate is chosen on it; give multiples of "
                             "its authors' rate, e.g. (0.316, 1.0, 3.16).")
  if not len(config.benchmark.seeds):
    raise errors.ConfigError("config.benchmark.seeds is empty: a table needs at least one seed, e.g. (0, 1, 2).")
  if config.eval_every > config.num_steps:
    raise errors.ConfigError(f"config.eval_every={config.eval_every} is beyond the budget num_steps="
                             f"{config.num_steps}: iterations to the target would read the budget itself; "
                             "evaluate at least once before the end.")
  grid.check_given(config)
  for name in names(config):
    kept = grid.given(config, "points", name)
    if kept is not None:
      validate_lib.validate_config(run_config(config, name, kept, 0))
      continue
    for joint in joint_points(config, name):
      for lr in learning_rates(config, name):
        validate_lib.validate_config(run_config(config, name, Point(lr, joint), 0))


def task_names(config_file: str) -> list[str]:
  """The benchmark's tasks: the configs beside ``config_file`` (``configs/head_to_head/<task>.py``)."""
  folder = os.path.dirname(os.path.abspath(config_file))
  return sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f not in ("common.py", "__init__.py"))


def rerun(config, workdir: str, results_dir: str, key_: str) -> dict[str, Any]:
  """Trains the committed run ``key_`` again from scratch in ``<workdir>/rerun/<key_>``; its final losses
  beside the committed ones."""
  path = os.path.join(results_dir, RUNS, f"{key_}.json")
  if not os.path.exists(path):
    raise errors.ConfigError(f"config.benchmark.rerun: no committed run {key_!r} ({path} does not exist)")
  rec = read_record(path)
  if rec is None:
    raise errors.ConfigError(f"config.benchmark.rerun: the committed run {key_!r} ({path}) is damaged")
  point = record_point(rec)
  harness = Harness(config, workdir, results_dir, "")
  cfg = run_config(config, rec["optimizer"], point, rec["seed"], harness.extra(rec["optimizer"]))
  scratch = os.path.join(workdir, "rerun", key_)
  shutil.rmtree(scratch, ignore_errors=True)
  again = train_one(cfg, scratch, config.benchmark.report_split)
  out = {"committed": benchmark_report.final(rec), "rerun": benchmark_report.final(again),
         "committed_report": rec.get("report", {}).get("loss"), "rerun_report": again.get("report", {}).get("loss")}
  print(f"{key_}: final {config.eval_split} loss committed {out['committed']:.6f}, re-run {out['rerun']:.6f}; "
        f"{config.benchmark.report_split} loss committed {report.fmt(out['committed_report'], '.6f')}, "
        f"re-run {report.fmt(out['rerun_report'], '.6f')}", flush=True)
  return out


def benchmark(config, workdir: str, results_dir: str, command: str, tasks: Sequence[str] = ()) -> dict[str, dict]:
  """Runs what is missing for ``config.benchmark.optimizers`` and rebuilds the report after each optimizer
  from every optimizer of the task's protocol whose runs are committed (``tasks``: the summary's list)."""
  validate(config)
  for folder in (results_dir, os.path.join(results_dir, RUNS), os.path.dirname(os.path.abspath(results_dir))):
    check_writable(folder)
  with workdir_lib.lock(results_dir, HARNESS_LOCK, "harness",
                        "give this one another --results_dir (the records of one task have one writer)"):
    harness = Harness(config, workdir, results_dir, command)
    listed = names(config)
    everyone = list(config.benchmark.all_optimizers)
    found = {}
    marks = baselines.anchors(config)
    for name in listed:
      found[name] = harness.optimizer(name)
      _report(config, harness, found, everyone, marks, results_dir, command, tasks)
    return found


def _report(config, harness, found, everyone, marks, results_dir, command, tasks):
  """The report from ``found`` plus every other optimizer whose runs are all committed (none is run here)."""
  complete = dict(found)
  for name in everyone:
    found_committed = None if name in complete else committed_results(harness, name)
    if found_committed is not None:
      complete[name] = found_committed
  ordered = {n: complete[n] for n in everyone if n in complete}
  ordered.update({n: complete[n] for n in complete if n not in ordered})
  benchmark_report.write_report(config, ordered, marks, results_dir, command, [n for n in everyone if n not in complete])
  benchmark_report.write_summary(os.path.dirname(os.path.abspath(results_dir)), tasks)


def committed_results(harness: Harness, name: str) -> Optional[dict]:
  """``harness.optimizer(name)`` if every run it needs is committed with today's settings, else None
  (runs nothing)."""
  run = harness.run

  def probe(n, point, seed):
    rec = harness.committed(n, point, seed)
    if rec is None:
      raise LookupError(key(n, point, seed))
    return rec

  harness.run = probe
  try:
    return harness.optimizer(name)
  except LookupError:
    return None
  finally:
    harness.run = run


def main(argv):
  del argv
  config = cli.config()
  command = cli.command_line()
  report.provenance()  # the commit of the code this process imported, read now: the checkout may move on
  with data_lib.reuse_decoded_splits():
    if config.benchmark.rerun:
      rerun(config, FLAGS.workdir, FLAGS.results_dir, config.benchmark.rerun)
      return
    benchmark(config, FLAGS.workdir, FLAGS.results_dir, command, task_names(cli.config_path()))
  print(open(os.path.join(FLAGS.results_dir, "README.md")).read())


if __name__ == "__main__":
  cli.define_flags(workdir=True)
  cli.run(main)
