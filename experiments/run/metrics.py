"""The metrics file: one JSON object per line (``{"step": ..., ...}``); its one reader and writer.

A crash or a full disk can leave the last line torn: :func:`read` drops it (and says so) rather
than refusing the file; a bad line anywhere else is an error naming the file and the line.
Rewrites are atomic (a temporary file, then ``os.replace``), so a failed write never loses rows
that were already saved.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable, Optional

from experiments.run import errors

Row = dict[str, Any]


def read(path: str, up_to_step: Optional[int] = None) -> list[Row]:
  """The rows of ``path`` (``[]`` if it does not exist), those with ``step <= up_to_step`` if given."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().split("\n")
  rows = []
  last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      if not isinstance(row, dict) or "step" not in row:
        raise ValueError("not a metrics row")
    except ValueError:
      if i == last:  # torn by a crash or a full disk: the row was never completely written
        print(f"warning: dropped the torn last line of {path} ({line[:40]!r})", file=sys.stderr)
        break
      raise errors.WorkdirError(f"{path}, line {i + 1}, is not a metrics row: {line[:60]!r}") from None
    rows.append(row)
  if up_to_step is not None:
    rows = [r for r in rows if r["step"] <= up_to_step]
  return rows


def _dumps(row: Row) -> str:
  return json.dumps(row, allow_nan=False) + "\n"


def write(path: str, rows: Iterable[Row]) -> None:
  """Writes ``rows`` to ``path`` atomically: the old file stays whole until the new one is."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    for row in rows:
      f.write(_dumps(row))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def is_clean(path: str, rows: list[Row]) -> bool:
  """Whether ``path`` holds exactly ``rows``, one complete line each (so appending can go on)."""
  if not os.path.exists(path):
    return not rows
  with open(path) as f:
    text = f.read()
  return text == "".join(_dumps(r) for r in rows)


class Appender:
  """Appends rows to ``path``, one complete line per row, flushed as written."""

  def __init__(self, path: str):
    self.path = path
    self._file = open(path, "a")

  def append(self, row: Row) -> None:
    self._file.write(_dumps(row))
    self._file.flush()

  def close(self) -> None:
    self._file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class Discard(Appender):
  """An :class:`Appender` that writes nothing: the metrics of a process that is not the run's writer."""

  def __init__(self):
    self.path = None

  def append(self, row: Row) -> None:
    del row

  def close(self) -> None:
    pass
