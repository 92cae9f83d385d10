"""When each kernel's conditioner is refreshed, and the refresh itself: kernels alike refreshed by one compiled
computation (a bank), whichever of them is due."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import defaults
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import sketch


def kept_factor(plan: plan_lib.KernelPlan, factor: sketch.Factor) -> sketch.Factor:
  """The form the state keeps: a full conditioner (``rank=None``) as the dense ``A^{-1}``."""
  return sketch.dense_factor(factor) if plan.rank is None and factor.q is not None else factor


def normalized(factor: sketch.Factor, trace: jax.Array, n: int) -> sketch.Factor:
  """``factor`` of ``C`` as the factor of ``C / (tr C / n)``: ``A^{-1}`` times ``sqrt(tr C / n)`` (unchanged while
  ``tr C`` is 0 or not finite, i.e. before any data without a prior, when the factor is the identity's)."""
  ok = jnp.isfinite(trace) & (trace > 0)
  scale = jnp.where(ok, jnp.sqrt(jnp.where(ok, trace, 1.0) / n), 1.0)
  return factor._replace(b_inv=None if factor.b_inv is None else factor.b_inv * scale, a_inv=factor.a_inv * scale)


def refresh_due(count, phase: int, update_every: int, warm_start: bool, statistics_every: int):
  """Whether a kernel of ``phase`` refreshes at step ``count`` (and, warm, after 1, 2, 4, ... folds)."""
  due = (count >= phase) & ((count - phase) % update_every == 0)
  if warm_start:
    t = count // statistics_every + 1  # folds so far
    folded = count % statistics_every == 0
    due |= folded & (count + 1 < update_every) & ((t & (t - 1)) == 0)
  return due


def normalizes(normalize: str, plan: plan_lib.KernelPlan) -> bool:
  """Whether ``normalize`` (``'none'``, ``'embeddings'`` or ``'all'``) conditions ``plan``'s kernel by ``C / (tr C / n)``."""
  return normalize == "all" or (normalize == "embeddings" and plan.statistics.takes_ids)


def refresh(kernel_plans, phases, stats: banks_lib.Banked, old_factors: banks_lib.Banked, key, count,
            refresh_due: Callable, normalize: str = defaults.NORMALIZE):
  """``(factors, key, rebuilt)``: new factors of the kernels whose refresh is due (``phases``: :func:`plan.slice_phases`), of ``C / (tr C / n)``
  for the kernels ``normalize`` names (:func:`normalizes`, :func:`normalized`). Kernels without a plan here (left
  unconditioned in this update) keep theirs.

  A bank (:mod:`banks`: the kernels and stacked slices of one kind of statistics, ``n`` and rank) is refreshed by
  one compiled computation however many layers it holds: a loop over the members due at this step (one or a few
  with ``stagger``; all of them at the warm start's early refreshes or with ``stagger=False``), each rebuilt in
  place in the stored bank. ``rebuilt``, banked as the factors, says per slice whether its factor was rebuilt into
  another here (due, finite, as a non-finite refresh keeps the old factor, and not the old one bit for bit): what a
  transformation reading the factors' bases (the eigenbasis) needs to know.
  """
  rebuilt = [jnp.zeros(sum(bank.sizes), bool) for bank in old_factors.index.banks]
  if key is None:  # the state keeps no key only when init conditioned no kernel: nothing to refresh
    return old_factors, key, banks_lib.Banked(old_factors.index, rebuilt)
  keyed = any(plan.statistics.keyed(plan.rank) for plan in kernel_plans.values())
  keys = jax.random.split(key, len(kernel_plans) + 1) if keyed else None  # factors that draw nothing: no keys
  key_of = dict(zip(kernel_plans, keys[1:])) if keyed else {}
  factors = list(old_factors.banks)
  for i, bank in enumerate(stats.index.banks):
    planned = [p for p in bank.paths if p in kernel_plans]
    if not planned:
      continue
    plan = kernel_plans[planned[0]]

    def make(s, kk, plan=plan):
      factor = plan.statistics.factor(s, kk, plan.rank)
      return kept_factor(plan, normalized(factor, plan.statistics.trace(s), plan.n) if normalizes(normalize, plan)
                         else factor)

    # each slice's phase, key and whether it may refresh here (a member without a plan here never does)
    planned_slices = np.concatenate([np.full(size, p in kernel_plans) for p, size in zip(bank.paths, bank.sizes)])
    member_phases = np.concatenate([phases[p] if p in kernel_plans else np.zeros(size, np.int64)
                                    for p, size in zip(bank.paths, bank.sizes)])
    member_keys = jnp.concatenate([
        (key_of[p][None] if lone else jax.random.split(key_of[p], size)) if p in key_of
        else jnp.zeros((size,) + key.shape, key.dtype)
        for p, size, lone in zip(bank.paths, bank.sizes, bank.lone)])
    due = refresh_due(count, jnp.asarray(member_phases)) & jnp.asarray(planned_slices)
    renew = lambda operand, s=stats.banks[i], due=due, member_keys=member_keys, make=make: _refresh_due_members(
        s, *operand, due, member_keys, make)
    factors[i], rebuilt[i] = jax.lax.cond(jnp.any(due), renew, lambda o: o, (factors[i], rebuilt[i]))
  return (banks_lib.Banked(old_factors.index, factors), keys[0] if keyed else key,
          banks_lib.Banked(old_factors.index, rebuilt))


def _refresh_due_members(s, f, rebuilt, due, member_keys, make):
  """A bank's factors ``f`` with each member due rebuilt from its statistics in ``s``, and ``rebuilt`` marking the
  members whose factor the rebuild changed: one compiled loop over the members."""

  def body(j, operand):
    # member j of a bank's stacked leaves (j is in range: no index wrapping or clamping to compile)
    pick = lambda tree: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), tree)

    def renew(operand):
      f, rebuilt = operand
      made, old = make(pick(s), pick(member_keys)), pick(f)
      new = fold_lib.keep_if_finite(made, old)  # never a non-finite factor
      f = jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, j, 0), f, new)
      # rebuilt into another factor: finite and not the old one (statistics unchanged since the last refresh, as on a
      # step without a fold, rebuild a dense factor bit for bit)
      moved = jnp.any(jnp.stack([jnp.any(a != b) for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(old))]))
      return f, rebuilt.at[j].set(fold_lib.all_finite(made) & moved)

    return jax.lax.cond(due[j], renew, lambda o: o, operand)

  return jax.lax.fori_loop(0, len(due), body, (f, rebuilt))
