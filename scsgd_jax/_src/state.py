"""The state of :func:`~scsgd_jax.scale_by_sketched_conditioning`: its form, what it holds before any data,
and the plans it is kept for (decided by ``init`` from the shapes, fixed afterwards: the capture only confirms
them)."""

from __future__ import annotations

import logging
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import sketch
from scsgd_jax._src.inputs import HELPERS

__all__ = ["ScaleBySketchedConditioningState"]


@jax.tree_util.register_static
class PlanSummary:
  """``((kernel path, how it is conditioned), ...)``: static (no leaves), so it costs nothing in the
  state, in checkpoints or under ``jit``.

  It describes the plan, which the shapes and the captured layouts decide, and is no part of the state's
  structure: any two summaries compare equal, so the state keeps its tree structure when an update adds a
  note (a layer the capture cannot condition), as ``lax.scan`` carries, ``nnx.Optimizer`` and checkpoint
  templates need. Compare ``items`` to compare the descriptions. A state whose refreshes run apart carries what
  runs them, ``refresher`` (``None``: the update refreshes), which two summaries must share to be equal (so a
  jitted function of the state compiles again for another conditioning)."""

  def __init__(self, items, layouts=(), refresher=None):
    self.items = tuple(items)
    self.layouts = dict(layouts)  # {kernel path: Layout} of the conditioned kernels (what state_shardings reads)
    self.refresher = refresher

  def __eq__(self, other):
    return isinstance(other, PlanSummary) and self.refresher == other.refresher

  def __hash__(self):
    return hash((PlanSummary, self.refresher))

  def __repr__(self):
    return f"PlanSummary({dict(self.items)})"


# flax.serialization (msgpack checkpoints, a Linen TrainState's to_bytes) writes the summary as an empty dict
# and restores the target's: it is derived from the shapes, never data. Registered where Flax is installed: the
# optax core needs no Flax.
try:
  from flax import serialization
except ImportError:  # pragma: no cover - Flax is a dependency of the capture modules only
  serialization = None
if serialization is not None:
  serialization.register_serialization_state(PlanSummary, lambda summary: {}, lambda target, state: target)


class ScaleBySketchedConditioningState(NamedTuple):
  """State of :func:`scale_by_sketched_conditioning`.

  Attributes:
    count: number of updates applied so far (``int32``).
    key: PRNG key, split at every refresh for the sketches' Gaussian matrices; ``None`` when no kernel is
      conditioned (nothing to sketch: the state then holds no more than the count).
    statistics: ``{kernel path: statistics}`` (e.g. an :class:`~scsgd_jax.sketch.EmaState` of the
      dense ``C``, or the streaming sketch), one per conditioned kernel, stored in banks: the kernels of one kind
      of statistics, ``n`` and rank stacked (a mapping read per kernel; its leaves are the banks').
    factors: ``{kernel path: Factor}``, the conditioner currently applied, stored in the same banks.
    clipped_rows: ``{kernel path: int32}``, input rows clipped by the outlier guard so far, per kernel of its own
      statistics, stored in the statistics' banks (one place per kernel).
    plan: how each kernel is conditioned (static; see :meth:`summary`).
  """

  count: jax.Array
  key: Optional[jax.Array]
  statistics: Mapping[str, Any]
  factors: Mapping[str, sketch.Factor]
  clipped_rows: Mapping[str, jax.Array]
  plan: PlanSummary = PlanSummary(())

  def summary(self) -> dict[str, str]:
    """How each kernel is conditioned, or why it is not (works on ``jax.eval_shape`` of ``init``).

    E.g. ``{'conv1/kernel': 'dense C, full C^(1/2), n=25', 'dense1/kernel': 'streaming C Omega, rank 32,
    n=800', 'head/kernel': 'not conditioned: excluded by kernel_filter'}``. A leaf that is no Flax kernel or
    embedding (a bias, a norm's scale) is absent and gets plain updates; so is a leaf ``optax.masked`` hides.
    """
    return dict(self.plan.items)


def initial_factor(plan: plan_lib.KernelPlan) -> sketch.Factor:
  """The factor of ``A = I`` in the form ``plan`` keeps (one per slice of a stacked or grouped kernel)."""
  one = _one_initial_factor(plan)
  if plan.slices is None:
    return one
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.slices,) + a.shape), one)


def _one_initial_factor(plan: plan_lib.KernelPlan) -> sketch.Factor:
  if plan.kind in ("diagonal", "embedding"):
    return sketch.Factor(None, None, jnp.ones((plan.n,)))
  if plan.rank is None:  # the full conditioner is kept dense: one product per step
    return sketch.Factor(None, jnp.eye(plan.n, dtype=jnp.float32), jnp.zeros((), jnp.float32))
  return sketch.identity_factor(plan.n, plan.rank)


class PlanCache:
  """The plans of a parameter tree, computed once per tree of shapes (at ``init``) and reused by every update,
  which checks once per captured layout that the layers read their kernels as planned
  (:func:`plan.check_layouts`; without ``input_axes`` those they do not are kept in ``misread``)."""

  def __init__(self, spec: plan_lib.Spec):
    self._spec, self._plans, self._notes, self._misread = spec, {}, {}, {}
    self.notes: dict[str, str] = {}  # the kernels of the last tree planned left unconditioned, and why
    # the last call's kernels planned at init that its layers read by another layout (only without input_axes)
    self.misread: dict[str, str] = {}

  def __call__(self, tree, captured=None, helper: str = HELPERS) -> dict[str, plan_lib.KernelPlan]:
    flat, treedef = jax.tree_util.tree_flatten(tree)
    key = (treedef, tuple(tuple(np.shape(leaf)) for leaf in flat))
    if key not in self._plans:
      self._plans[key] = plan_lib.make_plans(tree, self._spec)
      notes = self._notes[key] = unconditioned(tree, self._spec, self._plans[key])
      if said(notes):  # once per tree of shapes
        log_unconditioned(said(notes))
      cut = {p: plan.describe(self._spec.rank) for p, plan in self._plans[key].items()
             if plan.below(self._spec.rank)}
      if cut:
        logging.getLogger("scsgd_jax").info("kernels planned below the rank asked (%d): %s", self._spec.rank,
                                            "; ".join(f"{p} ({d})" for p, d in cut.items()))
    self.notes, self.misread = self._notes[key], {}
    if not captured:
      return self._plans[key]
    key_captured = key + (tuple(sorted(captured.items())),)
    if key_captured not in self._plans:  # once per tree of shapes and layouts
      self._misread[key_captured] = plan_lib.check_layouts(self._plans[key], tree, self._spec, captured, helper)
      self._plans[key_captured] = self._plans[key]
    self.misread = self._misread[key_captured]
    return self._plans[key_captured]


# why a float leaf that is no kernel is left plain: a raw matrix (named by the route that conditions it), a vector
RAW = ("not conditioned: a raw parameter no kernel filter takes (to condition it, name its layout in input_axes and "
       "hand the capture its rows with scsgd_jax.sow_rows)")
VECTOR = "not conditioned: a bias, a norm's scale or another vector"


def unconditioned(tree, spec: plan_lib.Spec, plans: Mapping[str, plan_lib.KernelPlan]) -> dict[str, str]:
  """``{path: why}`` of every float leaf of ``tree`` that gets no conditioning: a Flax kernel or embedding
  (:func:`~scsgd_jax.default_kernel_filter`'s) excluded by ``kernel_filter``, a layer ``input_axes`` says is :class:`~scsgd_jax.Plain`, or
  left plain by the memory rule (no statistics fit its budget under ``Statistics(kind='auto')``; with ``spec.extra``,
  none of use: an embedding, or a kernel that fits only diagonal statistics); a raw matrix no filter takes
  (:data:`RAW`); a vector (:data:`VECTOR`)."""
  out = {}
  kernels = layout_lib.kernel_paths(tree)
  for path, leaf in layout_lib.kernel_paths(tree, lambda p, x: _is_float(x)).items():
    if path in plans:
      continue
    if path not in kernels and not spec.kernel_filter(path, leaf):
      raw = np.ndim(leaf) >= 2 and path.rsplit("/", 1)[-1] not in ("bias", "scale")  # Flax's names of vectors
      out[path] = RAW if raw else VECTOR
      continue
    why = layout_lib.plain_why(spec.layouts, path)
    out[path] = ("not conditioned: excluded by kernel_filter" if not spec.kernel_filter(path, leaf) else
                 f"not conditioned: {why}" if why is not None else
                 "not conditioned: its basis is the coordinate one (token frequencies)"
                 if spec.extra is not None and layout_lib.is_embedding(path) else
                 "not conditioned: no statistics fit its memory budget (Statistics(kind='auto'))"
                 + (", none of use beside its moments" if spec.extra is not None else ""))
  return out


def _is_float(leaf) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def said(notes: Mapping[str, str]) -> dict[str, str]:
  """The ``notes`` worth a line at ``init`` (kernels and raw matrices left plain; not the vectors)."""
  return {p: why for p, why in notes.items() if why != VECTOR}


def log_unconditioned(notes: dict[str, str]) -> None:
  """One log line (logger ``scsgd_jax``, INFO) naming every kernel left unconditioned and why."""
  logging.getLogger("scsgd_jax").info("kernels left unconditioned (plain updates): %s",
                                      "; ".join(f"{p} ({why})" for p, why in notes.items()))


def summary_of(kernel_plans, notes=(), asked_rank: Optional[int] = None, refresher=None) -> PlanSummary:
  """Each conditioned kernel's plan (a rank below ``asked_rank`` says why), then each kernel left unconditioned
  and why (``notes``, which win over a plan of the same kernel); ``refresher``: :class:`PlanSummary`'s."""
  notes = dict(notes)
  return PlanSummary([*((p, plan.describe(asked_rank)) for p, plan in kernel_plans.items() if p not in notes),
                      *notes.items()], {p: plan.layout() for p, plan in kernel_plans.items()}, refresher)


def fresh_kernel_states(kernel_plans, seed: int):
  """The state key (``None`` without kernels) and the kernels' ``(statistics, factors, clipped rows)`` before any
  data (a kernel that reads another's statistics keeps none: its entries are the other's): statistics and factors
  in their banks (:class:`~scsgd_jax._src.banks.Banked`), built by one compiled
  program (called eagerly, one small program per kernel's shapes would compile)."""
  own = plan_lib.own_statistics(kernel_plans)
  index = banks_lib.BankIndex.of(own, aliases=[(p, plan.reads) for p, plan in kernel_plans.items() if plan.reads])

  def fresh():
    key, per_kernel = _fresh_kernel_states(own, seed)
    part = lambda i: {p: f[i] for p, f in per_kernel.items()}
    return key, (banks_lib.Banked.of(index, part(0)), banks_lib.Banked.of(index, part(1)),
                 banks_lib.Banked.of(index.per_kernel(), part(2)))

  return jax.jit(fresh)()


def _fresh_kernel_states(kernel_plans, seed: int):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(kernel_plans) + 1)

  def statistics(plan, key):
    if plan.slices is None:
      return plan.statistics.init(plan.n, key)
    # slice after slice (lax.map): a batched QR over the slices deadlocked XLA:CPU now and then
    return jax.lax.map(lambda kk: plan.statistics.init(plan.n, kk), jax.random.split(key, plan.slices))

  # one kernel after another: each kernel's key waits for the previous kernel's statistics, so the sketches' QRs
  # (LAPACK calls) never run concurrently on XLA:CPU's thread pool, where concurrent ones were seen to deadlock
  out, previous = {}, None
  for (p, plan), kk in zip(kernel_plans.items(), keys[1:]):
    if previous is not None:
      kk, _ = jax.lax.optimization_barrier((kk, previous))
    previous = statistics(plan, kk)
    out[p] = (previous, initial_factor(plan), jnp.zeros([], jnp.int32))
  return keys[0] if kernel_plans else None, out


def same_shapes(a, b) -> bool:
  """Whether trees ``a`` and ``b`` have one structure and their leaves one shape each."""
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.shape(x) == np.shape(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def noted(state: ScaleBySketchedConditioningState, kernel_plans, skipped=(), asked_rank: Optional[int] = None):
  """``state`` with its summary: the plans, the kernels left unconditioned at ``init`` and those ``skipped`` in
  this update. A state whose statistics or factors do not have the plans' shapes (a checkpoint of another plan or
  of an earlier version of the state) is refused, naming the kernel."""
  notes = {**{p: why for p, why in state.plan.items if p not in kernel_plans}, **dict(skipped)}
  if not all(isinstance(x, banks_lib.Banked) for x in (state.statistics, state.factors, state.clipped_rows)):
    raise ValueError(
        "the state keeps its statistics, factors or clipped-row counts per kernel, a format of an earlier "
        "scsgd_jax: it cannot run here. Restore checkpoints into the state of tx.init(params) of this version (a "
        "checkpoint of an earlier format does not restore; see the changelog).")
  _, shapes = jax.eval_shape(lambda: _fresh_kernel_states(kernel_plans, 0))
  for p in kernel_plans:
    if not same_shapes((state.statistics[p], state.factors[p]), shapes[p][:2]):
      raise ValueError(
          f"the state of kernel '{p}' does not have the shapes its plan keeps ({kernel_plans[p].describe()}): it "
          "comes from another plan or an earlier version of the state. Restore checkpoints into the state of "
          "tx.init(params) of the same optimizer and scsgd_jax version (see the changelog for format changes).")
  return state._replace(plan=summary_of(kernel_plans, notes, asked_rank, state.plan.refresher))


def plans(opt_state) -> dict[str, str]:
  """How each kernel is conditioned, or why it is not, read from any optimizer state holding this library's
  conditioning: ``tx.init(params)`` or ``jax.eval_shape(tx.init, params)`` of a chain, ``optax.masked``,
  ``optax.inject_hyperparams``, ``optax.MultiSteps``, an alias, or an ``nnx.Optimizer``'s ``opt_state``. Several
  conditionings (both sides of :func:`scsgd_jax.contrib.scsgd_two_sided`) join their lines per kernel with ``' | '``.

  Example::

    scsgd_jax.plans(jax.eval_shape(tx.init, params))  # {'conv1/kernel': 'dense C, full C^(1/2), n=25', ...}
  """
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleBySketchedConditioningState))
           if isinstance(x, ScaleBySketchedConditioningState)]
  if not found:
    raise ValueError("plans: opt_state holds no scsgd_jax conditioning state; pass the state an scsgd_jax "
                     "transformation's init returned (or jax.eval_shape of it), or an nnx.Optimizer's opt_state.")
  out: dict[str, str] = {}
  for state in found:
    for path, line in state.summary().items():
      out[path] = line if path not in out else f"{out[path]} | {line}"
  return out
