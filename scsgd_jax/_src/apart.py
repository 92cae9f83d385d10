"""The refresh as a program apart from the training step (``Refresh(apart=True)``): the step folds the statistics
and conditions, :func:`refresh_conditioners` rebuilds the factors due, on the step's own schedule."""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import jax

from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import schedule
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = ["refresh_conditioners"]


class Refresher(NamedTuple):
  """What rebuilds one conditioning's factors, in its update or apart from it: its plans, each kernel's slices'
  phases and the schedule (hashable and compared by value, so it can sit in the state's static summary)."""

  kernel_plans: tuple  # ((path, KernelPlan), ...)
  phases: tuple  # ((path, (phase of each slice, ...)), ...)
  every: int
  warm_start: bool
  fold_every: int
  normalize: str

  def rebuild(self, statistics, factors, key, count, planned=None):
    """``(factors, key)`` with the factors due at update ``count`` rebuilt (:func:`schedule.refresh`); ``planned``:
    the kernels conditioned in that update (default: all), the others keep theirs."""
    kernel_plans = {p: plan for p, plan in self.kernel_plans if planned is None or p in planned}
    phases = {p: list(ph) for p, ph in self.phases}
    due = lambda count, phase: schedule.refresh_due(count, phase, self.every, self.warm_start, self.fold_every)
    return schedule.refresh(kernel_plans, phases, statistics, factors, key, count, due, self.normalize)

  def refreshed(self, state: ScaleBySketchedConditioningState) -> ScaleBySketchedConditioningState:
    """``state`` after its last update (number ``state.count - 1``) with the factors due then rebuilt, as the
    update would have rebuilt them in the step."""
    return _compiled(self)(state)

  def _refresh(self, state):
    factors, key = self.rebuild(state.statistics, state.factors, state.key, state.count - 1)
    return state._replace(factors=factors, key=key)


def refresher(kernel_plans, refresh, fold_every: int, normalize: str) -> Refresher:
  """The :class:`Refresher` of plans ``kernel_plans`` refreshed on ``refresh``'s schedule, folded every
  ``fold_every`` steps, normalized as ``normalize`` says."""
  phases = plan_lib.slice_phases(kernel_plans, refresh.every, refresh.stagger)
  return Refresher(tuple(kernel_plans.items()), tuple((p, tuple(int(x) for x in ph)) for p, ph in phases.items()),
                   refresh.every, refresh.warm_start, fold_every, normalize)


@functools.lru_cache(maxsize=64)
def _compiled(refresher: Refresher):
  return jax.jit(refresher._refresh)


def _is_conditioning(x) -> bool:
  return isinstance(x, ScaleBySketchedConditioningState)


def refresh_conditioners(opt_state):
  """``opt_state`` with the conditioners due rebuilt: the refresh of every conditioning built with
  ``Refresh(apart=True)``, as a program apart from the training step. Call it after every update (the refresh
  schedule, staggered or warm, decides which factors it rebuilds; the others cost nothing), eagerly (it compiles
  its own program) or inside a jitted function of yours.

  ``opt_state`` is any optimizer state holding such a conditioning's state (``optax.chain``,
  ``optax.inject_hyperparams``...), or an ``nnx.Optimizer``'s ``opt_state``, whose variables are updated in place
  (and returned); a state with none is refused.

  Example::

    tx = scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(apart=True)))
    ...
    updates, opt_state = tx.update(grads, opt_state, params, layer_inputs=inputs)  # folds and conditions
    opt_state = scsgd_jax.refresh_conditioners(opt_state)  # rebuilds the factors due
  """
  found = []

  def refreshed(x):
    if not _is_conditioning(x) or x.plan.refresher is None:
      return x
    found.append(x)
    variables = jax.tree.leaves(x, is_leaf=_is_variable)
    if not any(_is_variable(v) for v in variables):
      return x.plan.refresher.refreshed(x)
    # an nnx.Optimizer's state: its variables' values refreshed, each variable set in place
    values = jax.tree.map(lambda v: v.get_value() if _is_variable(v) else v, x, is_leaf=_is_variable)
    for v, new in zip(variables, jax.tree.leaves(x.plan.refresher.refreshed(values)), strict=True):
      v.set_value(new)
    return x

  out = jax.tree.map(refreshed, opt_state, is_leaf=_is_conditioning)
  if not found:
    raise ValueError(
        "refresh_conditioners: opt_state holds no conditioning whose refreshes run apart: build it with "
        "scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(apart=True)) (scsgd or scale_by_sketched_conditioning), and pass the state "
        "its init returned; with Refresh(apart=False) the update refreshes by itself.")
  return out


def _is_variable(x) -> bool:
  """Whether ``x`` is a Flax NNX variable (an ``nnx.Optimizer``'s state holds its leaves in them)."""
  nnx = sys.modules.get("flax.nnx")  # never imported here: a variable exists only where Flax NNX was loaded
  return nnx is not None and isinstance(x, nnx.Variable)
