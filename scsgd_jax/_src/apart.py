"""The refresh as a program apart from the training step (``Refresh(apart=True)``): the step folds the statistics
and conditions, :func:`refresh_conditioners` rebuilds the factors due, on the step's own schedule."""

from __future__ import annotations

import functools
import sys
from typing import Hashable, NamedTuple

import jax

from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import schedule
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = ["refresh_conditioners"]


class Refresher(NamedTuple):
  """What folds one conditioning's rows and rebuilds its factors, in its update or apart from it: its plans, each
  kernel's slices' phases, the schedule and the fold's guard (hashable and compared by value, so it can sit in the
  state's static summary)."""

  kernel_plans: tuple  # ((path, KernelPlan), ...)
  phases: tuple  # ((path, (phase of each slice, ...)), ...)
  every: int
  warm_start: bool
  fold_every: int
  normalize: str
  outlier_threshold: float = float("inf")
  axis_name: Hashable = None

  def fold(self, statistics, clipped, count, rows, planned=None):
    """``(statistics, clipped rows)`` with ``rows`` (:func:`fold.checked_rows`) folded in at update ``count``, if
    the fold period says so; ``planned``: the kernels folded (default: all)."""
    kernel_plans = {p: plan for p, plan in self.kernel_plans if planned is None or p in planned}
    fold = lambda operand: fold_lib.fold(kernel_plans, rows, *operand, self.outlier_threshold, self.axis_name)
    if self.fold_every == 1:
      return fold((statistics, clipped))
    return jax.lax.cond(count % self.fold_every == 0, fold, lambda o: o, (statistics, clipped))

  def rebuild(self, statistics, factors, key, count, planned=None):
    """``(factors, key, rebuilt)``: the factors due at update ``count`` rebuilt, and which
    (:func:`schedule.refresh`); ``planned``: the kernels conditioned in that update (default: all), the others keep
    theirs."""
    kernel_plans = {p: plan for p, plan in self.kernel_plans if planned is None or p in planned}
    phases = {p: list(ph) for p, ph in self.phases}
    due = lambda count, phase: schedule.refresh_due(count, phase, self.every, self.warm_start, self.fold_every)
    return schedule.refresh(kernel_plans, phases, statistics, factors, key, count, due, self.normalize)

  def refreshed(self, state: ScaleBySketchedConditioningState) -> ScaleBySketchedConditioningState:
    """``state`` after its last update (number ``state.count - 1``) with the factors due then rebuilt, as the
    update would have rebuilt them in the step."""
    return _compiled(self, "_refresh")(state)

  def _refresh(self, state):
    factors, key, _ = self.rebuild(state.statistics, state.factors, state.key, state.count - 1)
    return state._replace(factors=factors, key=key)

  def primed(self, state: ScaleBySketchedConditioningState, layer_inputs) -> ScaleBySketchedConditioningState:
    """``state`` with the factors its next update would rebuild in the step (``Refresh(apart=False)``): from its
    statistics with ``layer_inputs``' rows folded in as that update folds them. The statistics are left as they are
    (the update folds the rows itself), so the update conditions as the step's own refresh would have."""
    return _compiled(self, "_prime")(state, layer_inputs)

  def _prime(self, state, layer_inputs):
    plans = {p: plan for p, plan in self.kernel_plans if p not in getattr(layer_inputs, "unconditioned", {})}
    statistics, _ = self.fold(state.statistics, state.clipped_rows, state.count,
                              fold_lib.checked_rows(plans, layer_inputs), planned=plans)
    factors, key, _ = self.rebuild(statistics, state.factors, state.key, state.count, planned=plans)
    return state._replace(factors=factors, key=key)


def refresher(kernel_plans, refresh, fold_every: int, normalize: str, outlier_threshold: float = float("inf"),
              axis_name: Hashable = None) -> Refresher:
  """The :class:`Refresher` of plans ``kernel_plans`` refreshed on ``refresh``'s schedule, folded every
  ``fold_every`` steps (rows above ``outlier_threshold`` times the running trace clipped, averaged over
  ``axis_name``), normalized as ``normalize`` says."""
  phases = plan_lib.slice_phases(kernel_plans, refresh.every, refresh.stagger)
  return Refresher(tuple(kernel_plans.items()), tuple((p, tuple(int(x) for x in ph)) for p, ph in phases.items()),
                   refresh.every, refresh.warm_start, fold_every, normalize, outlier_threshold, axis_name)


@functools.lru_cache(maxsize=64)
def _compiled(refresher: Refresher, method: str):
  return jax.jit(getattr(refresher, method))


def _is_conditioning(x) -> bool:
  return isinstance(x, ScaleBySketchedConditioningState)


def refresh_conditioners(opt_state, layer_inputs=None):
  """``opt_state`` with the conditioners due rebuilt: the refresh of every conditioning built with
  ``Refresh(apart=True)``, as a program apart from the training step. Call it after every update (the refresh
  schedule, staggered or warm, decides which factors it rebuilds; the others cost nothing), eagerly (it compiles
  its own program) or inside a jitted function of yours.

  Given ``layer_inputs`` (the next update's captured inputs), it primes instead: it rebuilds the factors that
  update's own refresh would (``Refresh(apart=False)``), from the statistics with those rows folded in as the update
  folds them, and leaves the statistics to the update. Called once before the first update, it conditions that
  update as the step's refresh does (without it the first update, before any factor exists, is plain SGD).

  ``opt_state`` is any optimizer state holding such a conditioning's state (``optax.chain``,
  ``optax.inject_hyperparams``...), or an ``nnx.Optimizer``'s ``opt_state``, whose variables are updated in place
  (and returned); a state with none is refused.

  Example::

    tx = scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(apart=True)))
    ...
    updates, opt_state = tx.update(grads, opt_state, params, layer_inputs=inputs)  # folds and conditions
    opt_state = scsgd_jax.refresh_conditioners(opt_state)  # rebuilds the factors due

  and, to condition the first update too, ``opt_state = scsgd_jax.refresh_conditioners(opt_state,
  layer_inputs=first_inputs)`` before it.
  """
  found = []

  def rebuilt(r, state):
    return r.refreshed(state) if layer_inputs is None else r.primed(state, layer_inputs)

  def refreshed(x):
    if not _is_conditioning(x) or x.plan.refresher is None:
      return x
    found.append(x)
    variables = jax.tree.leaves(x, is_leaf=_is_variable)
    if not any(_is_variable(v) for v in variables):
      return rebuilt(x.plan.refresher, x)
    # an nnx.Optimizer's state: its variables' values refreshed, each variable set in place
    values = jax.tree.map(lambda v: v.get_value() if _is_variable(v) else v, x, is_leaf=_is_variable)
    for v, new in zip(variables, jax.tree.leaves(rebuilt(x.plan.refresher, values)), strict=True):
      v.set_value(new)
    return x

  out = jax.tree.map(refreshed, opt_state, is_leaf=_is_conditioning)
  if not found:
    raise ValueError(
        "refresh_conditioners: opt_state holds no conditioning whose refreshes run apart: build it with "
        "scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(apart=True)) (scsgd or scale_by_sketched_conditioning), "
        "and pass the state its init returned; with Refresh(apart=False) the update refreshes by itself.")
  return out


def _is_variable(x) -> bool:
  """Whether ``x`` is a Flax NNX variable (an ``nnx.Optimizer``'s state holds its leaves in them)."""
  nnx = sys.modules.get("flax.nnx")  # never imported here: a variable exists only where Flax NNX was loaded
  return nnx is not None and isinstance(x, nnx.Variable)
