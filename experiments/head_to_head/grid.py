"""The head to head's records, points and grids: a committed run's record, a run's point (rate and jointly tuned settings), each optimizer's rate grid
around its authors' rate, the grid's growth past a winning end, and the point chosen."""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Callable, NamedTuple, Optional

import numpy as np

from experiments.head_to_head import benchmark_report
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.run import errors

RUNS = "runs"  # <results_dir>/runs/<optimizer>/<point>_seed<seed>.json: one record per run
RECORD_KEYS = ("config", "rows", "diverged", "commit", "optimizer", "learning_rate", "joint", "seed")


class Point(NamedTuple):
  """One setting of an optimizer's tuned hyperparameters: the peak rate and the joint ones (sorted)."""

  learning_rate: float
  joint: tuple[tuple[str, float], ...] = ()

  def tag(self) -> str:
    return f"lr{self.learning_rate:g}" + "".join(f"_{k}{v:g}" for k, v in self.joint)


def record_point(rec: dict) -> Point:
  """The point a run's record ran at."""
  return Point(rec["learning_rate"], tuple(sorted(rec["joint"].items())))


def key(name: str, point: Point, seed: int) -> str:
  return f"{name}/{point.tag()}_seed{seed}"


def names(config) -> list[str]:
  """``config.benchmark.optimizers`` (a tuple, or "a,b" from the command line), each checked."""
  value = config.benchmark.optimizers
  listed = [n.strip() for item in ([value] if isinstance(value, str) else value) for n in item.split(",")]
  for n in listed:
    if n not in optimizers.OPTIMIZERS:
      raise errors.ConfigError(f"config.benchmark.optimizers: unknown optimizer {n!r}; choose from "
                               f"{sorted(optimizers.OPTIMIZERS)}.")
  return listed


def best_point(tried: dict[Point, float]) -> Point:
  """The point of a seed-0 grid that tuning chooses: the lowest final loss (ties: the smaller rate)."""
  return min(tried, key=lambda p: (tried[p], p.learning_rate, p.joint))


def given(config, field: str, name: str) -> Optional[Point]:
  """The point ``config.benchmark.<field>`` gives ``name``, or ``None``: ``points`` (the point a row keeps, chosen
  on an earlier table of the task, its seed 0 run again here) or ``centres`` (the centre of a row's grid). Each
  is a rate, or a dict of ``learning_rate`` and the jointly tuned settings (``{"learning_rate": 0.1,
  "damping": 0.001}``)."""
  spec = config.benchmark.get(field, {}).get(name)
  if spec is None:
    return None
  if not hasattr(spec, "items"):
    return Point(_rate(spec))
  spec = dict(spec.items())
  rate = spec.pop("learning_rate")
  return Point(_rate(rate), tuple(sorted((k, _rate(v)) for k, v in spec.items())))


def _rate(value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{value!r} is not a number")
  return float(value)


def _check_point(config, field: str, name: str) -> None:
  """``benchmark.<field>.<name>`` is a point of a row of the table whose joint settings are the row's."""
  b = config.benchmark
  if name not in b.all_optimizers:
    raise errors.ConfigError(f"config.benchmark.{field}: {name!r} is not a row of this table "
                             f"(config.benchmark.all_optimizers: {sorted(b.all_optimizers)}).")
  try:
    point = given(config, field, name)
  except (KeyError, TypeError, ValueError) as e:
    spec = b[field][name]
    shown = spec.to_dict() if hasattr(spec, "to_dict") else spec
    raise errors.ConfigError(f"config.benchmark.{field}.{name}: {shown!r} is not a rate or a dict of "
                             f"learning_rate and joint settings ({e}).") from None
  joint, tuned = [k for k, _ in point.joint], sorted(b.joint_grid.get(name, {}))  # point.joint: sorted by key
  if joint != tuned:
    raise errors.ConfigError(f"config.benchmark.{field}.{name}: its joint settings are {joint}, the row tunes "
                             f"{tuned} (config.benchmark.joint_grid).")


def check_given(config) -> None:
  """``benchmark.points`` and ``benchmark.centres`` give points of rows of the table (none both), ``points_from``
  and ``centre_from`` name dirs of committed runs, and ``retune`` acts (with ``points_from``) on no row that keeps a
  point: refused before any run, naming the culprit."""
  b = config.benchmark
  for field in ("points", "centres"):
    for name in b.get(field, {}):
      _check_point(config, field, name)
  both = sorted(set(b.get("points", {})) & set(b.get("centres", {})))
  if both:
    raise errors.ConfigError(f"config.benchmark.points and .centres both give {both}: a kept row has no grid.")
  for field, dirs in (("points_from", [b.get("points_from", "")]), ("centre_from", list(b.get("centre_from", ())))):
    for d in dirs:
      if d and not os.path.isdir(os.path.join(d, RUNS)):
        raise errors.ConfigError(f"config.benchmark.{field}: {d!r} holds no runs ({os.path.join(d, RUNS)} is not a "
                                 "directory): name a results dir of committed runs, or write the points "
                                 "(config.benchmark.points / centres).")
  if b.get("retune", ()) and not b.get("points_from", ""):
    raise errors.ConfigError(f"config.benchmark.retune {tuple(b.retune)} acts only with config.benchmark.points_from "
                             "(rows it names tune although that table holds their grid): set both or neither.")
  both = sorted(set(b.get("points", {})) & set(b.get("retune", ())))
  if both:
    raise errors.ConfigError(f"config.benchmark.points gives {both} a point that config.benchmark.retune tunes "
                             "again: keep one.")


def centre(config, name: str) -> Optional[Point]:
  """The point that centres ``name``'s grid here: ``benchmark.centres``' (a point chosen on an earlier table), else
  the one it chose on another task: ``benchmark.centre_from`` names results dirs, the first with a committed seed-0
  grid of ``name`` gives it; ``None`` without one (the grid is centred on its authors' rate).
  ``benchmark.centre_as`` maps a row to the row whose choice centres it (a variant of a row that ran there: three
  Newton-Schulz steps where that row ran five)."""
  literal = given(config, "centres", name)
  if literal is not None:
    return literal
  chosen_by = config.benchmark.get("centre_as", {}).get(name, name)
  for results_dir in config.benchmark.get("centre_from", ()):
    tried = earlier_grid(results_dir, chosen_by)
    if tried:
      return best_point(tried)
  return None


def learning_rates(config, name: str) -> list[float]:
  """The rate grid of ``name``: its authors' rate (or the rate it chose on ``benchmark.centre_from``'s task)
  times ``config.benchmark.grid``."""
  chosen = centre(config, name)
  middle = chosen.learning_rate if chosen else registry.recipe(name, config.benchmark.kind).learning_rate
  return [float(f"{middle * m:.3g}") for m in config.benchmark.grid]


def joint_points(config, name: str) -> list[tuple[tuple[str, float], ...]]:
  """Every combination of ``config.benchmark.joint_grid[name]`` (``[()]`` for an optimizer without one), or
  only the one ``name`` chose on ``benchmark.centre_from``'s task."""
  chosen = centre(config, name)
  if chosen is not None:
    return [chosen.joint]
  grid = config.benchmark.joint_grid.get(name)
  if not grid:
    return [()]
  keys = sorted(grid)
  return [tuple(zip(keys, map(float, values))) for values in itertools.product(*(grid[k] for k in keys))]


def tune(loss: Callable[[float], float], lrs: list[float], extend_edge: int) -> dict[float, float]:
  """``{lr: loss(lr)}`` over ``lrs``; while the best is at an end of the grid, the grid grows one more
  step (its own ratio) past that end, at most ``extend_edge`` times per end, so the rate a peer gets
  is bracketed rather than cut off by where its grid happened to be centred."""
  tried = {lr: loss(lr) for lr in lrs}
  ratio = lrs[-1] / lrs[-2] if len(lrs) > 1 else 1.0
  grown = {+1: 0, -1: 0}
  while ratio > 1.0:
    best = min(tried, key=lambda lr: (tried[lr], lr))
    if not np.isfinite(tried[best]):
      side = -1  # every rate diverged: smaller ones
    else:
      side = +1 if best == max(tried) else -1 if best == min(tried) else 0
    if side == 0 or grown[side] == extend_edge:
      break
    grown[side] += 1
    lr = float(f"{best * ratio ** side:.3g}")
    tried[lr] = loss(lr)
  return dict(sorted(tried.items()))


def read_record(path: str) -> Optional[dict]:
  """The run record at ``path``, or ``None`` (saying so) if it is damaged: not JSON (a torn or hand-edited
  file) or without a key every record has. A damaged record is run again, never read as a result."""
  try:
    with open(path) as f:
      rec = json.load(f)
    missing = [k for k in RECORD_KEYS if k not in rec] if isinstance(rec, dict) else ["(not an object)"]
    if missing:
      raise ValueError(f"no {', '.join(missing)}")
  except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
    print(f"{path}: damaged record ({str(e).splitlines()[0]}): run again", file=sys.stderr, flush=True)
    return None
  return rec


def earlier_grid(results_dir: str, name: str) -> dict[Point, float]:
  """``{point: final validation loss}`` of the seed-0 grid of ``name`` committed under ``results_dir`` (a task
  of an earlier protocol whose tuning stands: the same task, budget and schedule, a coarser evaluation
  cadence), or ``{}`` without one. A diverged run counts as ``inf``, as in :func:`tune`."""
  folder = os.path.join(results_dir, RUNS, name) if results_dir else ""
  if not folder or not os.path.isdir(folder):
    return {}
  out = {}
  for file in sorted(os.listdir(folder)):
    rec = read_record(os.path.join(folder, file)) if file.endswith("_seed0.json") else None
    if rec is not None:
      out[record_point(rec)] = benchmark_report.final(rec)
  return out
