"""The memory rule of ``Statistics(kind='auto')``: what each kind of statistics costs, a kernel's options best first,
and which option each kernel takes within its own floats or the model's (:func:`allot`)."""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

__all__ = ["Option", "allot", "options", "state_floats"]


def state_floats(kind: str, n: int, k: Optional[int], width: int) -> int:
  """Floats of one kernel's statistics + factor (a test checks it against real states)."""
  if kind in ("diagonal", "embedding"):
    return 2 * n + 1
  factor = n * n + 1 if k is None else n * k + k * k + 1  # a full conditioner is kept as the dense A^{-1}
  stats = n * n + 1 if kind == "dense" else 2 * n * width + 2
  return stats + factor


class Option(NamedTuple):
  kind: str
  rank: Optional[int]
  floats: int


def options(n: int, rank: int, oversample: int, full: bool) -> list[Option]:
  """A kernel's options under ``Statistics(kind='auto')``, best first."""
  out = [("dense", None if full else rank)] if full or rank < n else []
  out += [("streaming", k) for k in range(min(rank, n - 1), 0, -1)] + [("diagonal", 0)]
  return [Option(kind, k, state_floats(kind, n, k, min((k or 0) + oversample, n))) for kind, k in out]


def allot(shapes: dict[str, tuple[int, int]], opts: dict[str, list[Option]], floats: int,
          budget: str, memory_share: float = 1.0, unplanned_keeps: bool = False) -> dict[str, int]:
  """Each kernel's option (an index into its list; ``len`` = none fits) under the memory rule.

  Every kernel takes its best option that fits in its own ``n * p`` floats (``memory_share * n * p`` when two
  transformations split the budget); with ``budget='model'`` the ``floats`` the model has left over then
  go to the kernels of smallest ``n`` first (cheapest to upgrade), each taking its best option that the
  leftover pays for. The same layer of each block (one shape, one path but for its numbers: the blocks'
  indices) is upgraded in every block or in none, so identical blocks are planned alike and their kernels
  form one bank (one program whatever the depth). ``unplanned_keeps``: a kernel that gets no option still
  keeps its own ``memory_share * n * p`` floats (a transformation that gives it Adam's second moment instead), so
  they pay for no other kernel.
  """
  own = {path: math.floor(memory_share * n * p) for path, (n, p) in shapes.items()}
  chosen = {}
  for path, kernel_opts in opts.items():
    # 'model': 3 = this kernel's clipped-row counter and, were it alone, the count and key beyond Adam's.
    bound = own[path] - (3 if budget == "model" else 0)
    chosen[path] = next((i for i, o in enumerate(kernel_opts) if o.floats <= bound), len(kernel_opts))
  if budget == "kernel":
    return chosen

  def cost(path):
    if chosen[path] < len(opts[path]):
      return opts[path][chosen[path]].floats
    return own[path] if unplanned_keeps else 0

  left = floats - sum(cost(path) for path in opts)
  alike: dict[tuple, list[str]] = {}
  for path in sorted(opts, key=lambda q: shapes[q][0]):  # smallest n first; equal n in the given order
    layer = re.sub(r"\d+", "#", path)  # the same layer of each block: its path but for its numbers
    alike.setdefault((shapes[path], tuple(opts[path]), layer), []).append(path)
  for paths in alike.values():
    first, members = paths[0], len(paths)
    mine = cost(first)
    best = next((i for i, o in enumerate(opts[first]) if members * (o.floats - mine) <= left), chosen[first])
    if best < chosen[first]:
      chosen.update(dict.fromkeys(paths, best))
      left -= members * (cost(first) - mine)
  return chosen
