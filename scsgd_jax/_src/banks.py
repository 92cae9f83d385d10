"""Banks: kernels alike (one kind of statistics, ``n`` and rank) whose fold and refresh run as one computation over
their slices stacked, so a model's programs grow with its kinds of kernels, not with its depth."""

from __future__ import annotations

from typing import Callable, Hashable

import jax
import jax.numpy as jnp


def key(plan) -> tuple:
  """What kernels of one bank share: the kind of statistics and their object, ``n`` and the rank."""
  return (plan.kind, plan.n, plan.rank, id(plan.statistics))


def grouped(kernel_plans, extra: Callable[[str], Hashable] = lambda path: ()) -> list[list[str]]:
  """The kernels' paths by bank, in the plans' order (``extra(path)``: what else members must share, e.g. the shape
  of the rows they fold)."""
  out: dict[tuple, list[str]] = {}
  for path, plan in kernel_plans.items():
    out.setdefault(key(plan) + (extra(path),), []).append(path)
  return list(out.values())


def stacked(trees, lone):
  """``trees`` (one per kernel) as one tree of stacked slices: ``lone[i]`` marks a kernel of one slice kept without
  a leading axis (it gets one); the others already lead with their slices."""
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *[jax.tree.map(lambda a: a[None], t) if l else t
                                                         for t, l in zip(trees, lone)])


def unstacked(tree, sizes, lone):
  """The inverse of :func:`stacked`: one tree per kernel of ``sizes`` slices."""
  out, start = [], 0
  for size, l in zip(sizes, lone):
    part = jax.tree.map(lambda a, start=start, size=size: a[start:start + size], tree)
    out.append(jax.tree.map(lambda a: a[0], part) if l else part)
    start += size
  return out


def layout(kernel_plans, paths):
  """``(lone, sizes)`` of the bank ``paths``: which members are one slice kept without a leading axis, and each
  member's number of slices."""
  return ([kernel_plans[p].slices is None for p in paths], [kernel_plans[p].slices or 1 for p in paths])
