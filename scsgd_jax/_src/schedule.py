"""When each kernel's conditioner is refreshed, and the refresh itself: one ``lax.cond`` per phase of
the refresh window, the kernels of one phase and equal shapes refreshed as one ``vmap``."""

from __future__ import annotations

import collections
from typing import Callable

import jax
import jax.numpy as jnp

from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import sketch


def kept_factor(plan: plan_lib.KernelPlan, factor: sketch.Factor) -> sketch.Factor:
  """The form the state keeps: a full conditioner (``rank=None``) as the dense ``A^{-1}``."""
  return sketch.dense_factor(factor) if plan.rank is None and factor.q is not None else factor


def refresh_due(count, phase: int, update_every: int, warm_start: bool, statistics_every: int):
  """Whether a kernel of ``phase`` refreshes at step ``count`` (and, warm, after 1, 2, 4, ... folds)."""
  due = (count >= phase) & ((count - phase) % update_every == 0)
  if warm_start:
    t = count // statistics_every + 1  # folds so far
    folded = count % statistics_every == 0
    due |= folded & (count + 1 < update_every) & ((t & (t - 1)) == 0)
  return due


def refresh(kernel_plans, stats, old_factors, key, count, refresh_due: Callable):
  """New factors of the kernels whose refresh is due: one ``lax.cond`` per phase, equal shapes ``vmap``-ed."""
  keys = jax.random.split(key, len(kernel_plans) + 1)
  key_of = dict(zip(kernel_plans, keys[1:]))
  by_phase = collections.defaultdict(list)
  for path, plan in kernel_plans.items():
    by_phase[plan.phase].append(path)
  factors = dict(old_factors)
  for phase, paths in by_phase.items():

    def do_refresh(operand, paths=paths):
      group_stats, group_factors = operand
      groups = collections.defaultdict(list)
      for p in paths:
        plan = kernel_plans[p]
        groups[(plan.kind, plan.n, plan.rank, id(plan.statistics))].append(p)
      new = {}
      for group in groups.values():
        plan = kernel_plans[group[0]]
        # each kernel's slices (one for a lone kernel), all slices of the group refreshed as one vmap
        sizes = [kernel_plans[p].slices or 1 for p in group]
        lead = lambda tree, p: tree if kernel_plans[p].slices else jax.tree.map(lambda a: a[None], tree)
        stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[lead(group_stats[p], p) for p in group])
        group_keys = jnp.concatenate([jax.random.split(key_of[p], kernel_plans[p].slices)
                                      if kernel_plans[p].slices else key_of[p][None] for p in group])
        out = jax.vmap(lambda s, kk, plan=plan: kept_factor(plan, plan.statistics.factor(s, kk, plan.rank)))(
            stacked, group_keys)
        start = 0
        for p, size in zip(group, sizes):
          mine = jax.tree.map(lambda a, start=start, size=size: a[start:start + size], out)
          start += size
          # never replace a good factor by a non-finite one (each slice its own)
          if kernel_plans[p].slices:
            new[p] = jax.vmap(fold_lib.keep_if_finite)(mine, group_factors[p])
          else:
            new[p] = fold_lib.keep_if_finite(jax.tree.map(lambda a: a[0], mine), group_factors[p])
      return new

    operand = ({p: stats[p] for p in paths}, {p: old_factors[p] for p in paths})
    factors.update(jax.lax.cond(
        refresh_due(count, phase), do_refresh, lambda o: dict(o[1]), operand))
  return factors, keys[0]
