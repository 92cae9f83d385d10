"""What makes a run's record count and a folder usable, checked by the head to head before it trusts either: a
finished run's evaluations all there, a finite explosion seen as divergence, a folder written to once."""

from __future__ import annotations

import os
from typing import Optional

from experiments.run import errors


def missing_evaluations(cfg, rows: list[dict]) -> list[int]:
  """The steps at which a finished run of ``cfg`` evaluates (every ``eval_every`` and the last) that ``rows`` lack."""
  due = set(range(cfg.eval_every, cfg.num_steps + 1, cfg.eval_every)) | {cfg.num_steps}
  return sorted(due - {r["step"] for r in rows if "test_loss" in r})


def exploded(rows: list[dict], start: float) -> Optional[float]:
  """The last evaluation's loss if it lies above ``start``, the loss before the first step (the init's evaluation):
  a run whose loss grew without leaving the floats (finite, yet diverged); else ``None``. The first logged loss is
  no reference: a run that explodes within its first steps logs the exploded loss there."""
  evals = [r["test_loss"] for r in rows if "test_loss" in r]
  return evals[-1] if evals and evals[-1] > start else None


def check_writable(folder: str) -> None:
  """``folder`` made if missing and written to once (a file created and removed), before any run trains: a folder
  the harness cannot write is one line, not a run's work lost at its end."""
  try:
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, f".write_check.{os.getpid()}")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise errors.ConfigError(f"cannot write to {folder} ({e.strerror}): the harness writes its records and "
                             "reports there; make it writable or give another --results_dir.") from None
