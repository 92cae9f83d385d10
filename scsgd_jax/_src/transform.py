r"""The optax transformation: per-kernel input statistics and periodic conditioner refreshes.

The per-kernel plan (which statistics, which rank) is decided in :mod:`plan`; this module folds the
captured rows into the statistics, refreshes the factors when due and conditions the gradients.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scsgd_jax._src import apart
from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import options
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import sketch
from scsgd_jax._src import state as state_lib
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = [
    "STATIC_ARGS",
    "ScaleBySketchedConditioningState",
    "scale_by_sketched_conditioning",
]

#: Arguments that decide shapes; under ``optax.inject_hyperparams`` list them in ``static_args`` (the options'
#: integers are fields of objects, which it leaves alone).
STATIC_ARGS = ("rank",)


class Settings(NamedTuple):
  """The conditioning's settings, checked (:func:`settings`): what :func:`scale_by_sketched_conditioning` takes,
  and what the output side and the eigenbasis build their conditioning from."""

  rank: int
  statistics: options.Statistics
  refresh: options.Refresh
  conditioner: options.Conditioner
  kernel_filter: Optional[Callable[[str, Any], bool]]
  input_axes: layout_lib.InputAxes
  axis_name: Optional[Hashable]
  seed: int


def settings(rank: Optional[int] = None,
             statistics: options.StatisticsOption = options.Statistics(),
             refresh: options.Refresh = options.Refresh(),
             conditioner: options.Conditioner = options.Conditioner(),
             kernel_filter=None,
             input_axes: layout_lib.InputAxes = None,
             axis_name: Optional[Hashable] = None,
             seed: int = 0) -> Settings:
  """:class:`Settings` from :func:`scale_by_sketched_conditioning`'s arguments, each checked (one place)."""
  rank = defaults.RANK if rank is None else options.static_int("rank", rank, 1)
  statistics = options.checked_together(statistics, refresh, conditioner)
  if kernel_filter is not None and not callable(kernel_filter):
    raise TypeError(f"kernel_filter must be a callable (path, leaf) -> bool, got {kernel_filter!r}.")
  return Settings(rank, statistics, refresh, conditioner, kernel_filter, input_axes, axis_name, seed)


def _flat_inputs(layer_inputs) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(layer_inputs)
  return {layout_lib.path_to_str(p): leaf for p, leaf in flat}


def scale_by_sketched_conditioning(
    rank: Optional[int] = None,
    *,
    statistics: options.StatisticsOption = options.Statistics(),
    refresh: options.Refresh = options.Refresh(),
    conditioner: options.Conditioner = options.Conditioner(),
    kernel_filter: Optional[Callable[[str, Any], bool]] = None,
    input_axes: layout_lib.InputAxes = None,
    axis_name: Optional[Hashable] = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditions each kernel gradient on its input side (Gonen & Shalev-Shwartz, Section 3).

  A kernel ``W`` read as the matrix ``(n, p)`` over its input axes, with inputs ``x``, gets
  ``A^{-1} G`` for its gradient ``G`` (the paper's :math:`\delta (A^{-1} x)^\top`), with
  :math:`A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - QQ^\top)` rebuilt every ``refresh.every`` steps
  from an EMA of :math:`C = E[x x^\top]`, inside the jitted step. A step costs ``O(n k)`` per
  gradient column. The default :class:`Statistics` picks each kernel's statistics (dense ``C``, streaming
  ``C \Omega``, diagonal) so the whole state stays within Adam's; embeddings get the exact
  diagonal ``C^{1/2}`` of their token frequencies. ``state.summary()`` says what each kernel got.
  The full description is in ``docs/how_it_works.md``.

  ``update(updates, state, params=None, *, layer_inputs)`` takes the captured inputs: at each
  conditioned kernel's path, rows ``(..., n)`` in the kernel's input-axis order (integer ids for
  an embedding); see :func:`scsgd_jax.capture_nnx` and :func:`scsgd_jax.capture_linen`, whose
  output also says each kernel's input axes. Rows
  that are not finite are skipped, outliers clipped (``state.clipped_rows``), a kernel with no rows
  in a step (shape ``(0, n)``) keeps its statistics, and a non-finite refresh keeps the old factor.

  Args:
    rank: sketch rank ``k`` (default 32).
    statistics: how ``C`` is kept, a :class:`Statistics` (its kind, EMA rate, fold period, outlier guard,
      sketch and memory rule), or a :class:`~scsgd_jax.sketch.CorrelationStatistics` of your own.
    refresh: when the conditioner is rebuilt, a :class:`Refresh` (period, staggering, warm start).
    conditioner: what is built, a :class:`Conditioner` (full or sketched, eigenvalue floor, normalization).
    kernel_filter: ``(path, leaf) -> bool`` selecting the conditioned leaves (default: Flax kernels
      and embeddings, and the matrices ``input_axes`` names, :func:`default_kernel_filter`).
    input_axes: each kernel's input axes, a callable ``(path, leaf) -> axes`` or a mapping ``{path: axes}``
      (e.g. :func:`scsgd_jax.input_axes_nnx` of the model), read by ``init``. ``init`` sees only the
      parameters and reads any other kernel by :func:`default_input_axes` (right for Dense, Conv, attention,
      embeddings). Plans are fixed at ``init``: an update whose captured layers read a kernel otherwise (a
      DenseGeneral/Einsum, a stack, feature groups) is refused, naming the kernel and this fix.
    axis_name: under ``jax.pmap`` or ``shard_map`` with a data-parallel axis, its name: the folded
      statistics are averaged over it (``lax.pmean``), so every replica keeps the same state, equal to
      one device folding the gathered rows. Not needed under ``jit`` with sharded arrays (the rows are
      global there). Without it under ``pmap`` each replica folds only its shard and the replicas drift.
    seed: seed of the PRNG key kept in the state.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, arXiv:1506.02649, 2015.
    Tropp, Yurtsever, Udell & Cevher, Fixed-rank approximation of a positive-semidefinite
    matrix from streaming data, NeurIPS 2017.
  """
  return conditioning(settings(rank, statistics, refresh, conditioner, kernel_filter, input_axes, axis_name, seed))


def conditioning(s: Settings,
                 *,
                 default_axes=layout_lib.default_input_axes,
                 budget_share: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """:func:`scale_by_sketched_conditioning` from its settings ``s``, reading a kernel along ``default_axes`` unless
  told otherwise (the output side passes the kernel's output axes), its statistics within ``budget_share`` of the
  memory rule's budget (the two sides of :func:`scsgd_jax.contrib.scsgd_two_sided` splitting it)."""
  tx, _ = conditioning_and_plans(s, default_axes=default_axes, budget_share=budget_share)
  return tx


def _spec(s: Settings, default_axes, budget_share: float, extra) -> tuple[plan_lib.Spec, int]:
  """The plans' spec of settings ``s``, and the fold period."""
  checks.check_float("budget_share", budget_share, low=0.0, high=1.0, low_open=True)
  st = s.statistics
  got = (options.Statistics(every=st.every) if st.custom else st).resolved()
  cond = s.conditioner.resolved(s.rank)
  # ema_rate is per step: a fold every s steps weighs its batch 1 - (1 - nu)^s, so the EMA spans as many steps
  fold_rate = 1.0 - (1.0 - got["ema_rate"])**got["every"]
  choices = plan_lib.StatisticsChoices(fold_rate,
                                       warm_start=s.refresh.warm_start,
                                       oversample=got["oversample"],
                                       power_iterations=got["power_iterations"],
                                       eigenvalue_floor=cond["eigenvalue_floor"])
  spec = plan_lib.Spec(s.rank, s.refresh.every, cond["full_max_dim"], got["oversample"], cond["kind"],
                       st.kind, got["budget"], s.refresh.stagger,
                       layout_lib.kernels_of(s.kernel_filter,
                                           s.input_axes), s.input_axes, choices, default_axes, budget_share, extra)
  return spec, got["every"]


def conditioning_and_plans(s: Settings,
                           *,
                           default_axes=layout_lib.default_input_axes,
                           budget_share: float = 1.0,
                           extra=None):
  """:func:`conditioning` and its plans: ``plans(tree, captured_axes=None) -> {path: KernelPlan}``, the plans its
  ``init`` and ``update`` use for a tree of that structure (cached), for a transformation built on it;
  ``extra``: what that transformation keeps per kernel beside the statistics, for the memory rule
  (:class:`~scsgd_jax._src.plan.Spec`'s)."""
  spec, fold_every = _spec(s, default_axes, budget_share, extra)
  threshold = s.statistics.outlier_threshold
  plans = state_lib.PlanCache(spec)

  def init_fn(params):
    kernel_plans = plans(params)
    if not kernel_plans and default_axes is layout_lib.default_input_axes:  # the input side: say it, once a model
      warn_nothing_conditioned(params, plans.notes)
    key, (statistics, factors, clipped) = state_lib.fresh_kernel_states(kernel_plans, s.seed)
    refresher = (apart.refresher(kernel_plans, s.refresh, fold_every, s.conditioner.normalize)
                 if s.refresh.apart else None)
    return ScaleBySketchedConditioningState(
        count=jnp.zeros([], jnp.int32),
        key=key,
        statistics=statistics,
        factors=factors,
        clipped_rows=clipped,
        plan=state_lib.summary_of(kernel_plans, plans.notes, s.rank, refresher),
    )

  def update_fn(updates, state, params=None, *, layer_inputs=None, **extra_args):
    del params, extra_args
    kernel_plans = plans(updates, getattr(layer_inputs, "input_axes", None))
    if set(kernel_plans) != set(state.factors):
      raise ValueError(
          f"the conditioned kernels of `updates` {sorted(kernel_plans)} do not match those the state "
          f"was initialised with {sorted(state.factors)}.")
    # layers the capture cannot condition: plain updates, their state untouched, the summary says so
    skipped = {p: f"not conditioned: {why}" for p, why in getattr(layer_inputs, "unconditioned", {}).items()
               if p in kernel_plans}
    state = state_lib.noted(state, kernel_plans, skipped, s.rank)
    refresher = apart.refresher(kernel_plans, s.refresh, fold_every, s.conditioner.normalize)  # fixed by the plans
    if skipped:
      state_lib.log_unconditioned(skipped)  # once per trace
      kernel_plans = {p: plan for p, plan in kernel_plans.items() if p not in skipped}
    rows = _checked_rows(kernel_plans, layer_inputs)
    fold = lambda operand: fold_lib.fold(kernel_plans, rows, *operand, threshold, s.axis_name)
    operand = (state.statistics, state.clipped_rows)
    if fold_every == 1:
      new_stats, clipped = fold(operand)
    else:
      new_stats, clipped = jax.lax.cond(state.count % fold_every == 0, fold, lambda o: o, operand)
    factors, key = state.factors, state.key
    if not s.refresh.apart:  # else refresh_conditioners rebuilds them, apart from this step
      factors, key = refresher.rebuild(new_stats, factors, key, state.count, planned=kernel_plans)
    return _condition(updates, kernel_plans, factors), state._replace(
        count=optax.safe_increment(state.count), key=key, statistics=new_stats, factors=factors,
        clipped_rows=clipped)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn), plans


def warn_nothing_conditioned(params, notes: dict[str, str]) -> None:
  """A warning (once per model) that no leaf of ``params`` is conditioned: why for each kernel the filter took
  (``notes``), or, when it took none, the matrices it saw."""
  if notes:
    warnings.warn("scsgd_jax: no leaf is conditioned, so every leaf gets plain updates: "
                  + "; ".join(f"{p} ({why})" for p, why in notes.items()), stacklevel=3)
    return
  matrices = [layout_lib.path_to_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
              if np.ndim(leaf) >= 2]
  warnings.warn(
      f"scsgd_jax: no leaf is conditioned, so every leaf gets plain updates: the kernel filter took none of the "
      f"parameters' matrices {matrices[:8]}{' ...' if len(matrices) > 8 else ''}. Flax names kernels 'kernel' and "
      "'embedding'; for other names (Equinox's 'weight', a plain dict) say each kernel's input axes, e.g. "
      "input_axes={'layers/0/weight': scsgd_jax.Layout(input_axes=(1,))} for an (out, in) weight, (0,) for "
      "(in, out).", stacklevel=3)


def _condition(updates, kernel_plans, factors):
  """``A^{-1} G`` for every conditioned kernel; other leaves pass through."""

  def condition(path, g):
    p = layout_lib.path_to_str(path)
    if p not in kernel_plans or g is None:
      return g
    plan = kernel_plans[p]
    if plan.slices is None:
      return sketch.precondition_kernel(factors[p], g, plan.input_axes)
    # a stack of layers or groups: each slice conditioned by its own factor
    sliced = jax.vmap(lambda f, s: sketch.precondition_kernel(f, s, plan.input_axes))(factors[p], plan.to_slices(g))
    return plan.from_slices(sliced, g.shape)

  return jax.tree_util.tree_map_with_path(condition, updates)


def _checked_rows(kernel_plans: dict[str, plan_lib.KernelPlan], layer_inputs) -> dict[str, jax.Array]:
  """Each conditioned kernel's rows ``(m, n)`` (or ids), with a clear error naming the kernel on bad input."""
  if layer_inputs is None:
    raise ValueError(
        "scale_by_sketched_conditioning.update needs the keyword argument `layer_inputs`: "
        "the captured inputs of each conditioned layer (see scsgd_jax.capture_nnx / capture_linen), "
        "e.g. tx.update(grads, state, params, layer_inputs=layer_inputs).")
  inputs = _flat_inputs(layer_inputs)
  rows = {}
  for path, plan in kernel_plans.items():
    n = plan.n
    if path not in inputs:
      raise ValueError(
          f"layer_inputs has no entry for the conditioned kernel '{path}' (input dimension n={n}); "
          f"it has entries for {sorted(inputs)}. Capture the layer's inputs, or exclude the kernel "
          "with kernel_filter / optax.masked.")
    x = inputs[path]
    shape = getattr(x, "shape", None)
    lead = plan.stack + ((plan.groups,) if plan.groups > 1 else ())  # a stacked kernel's rows: (*lead, ..., n)
    if lead and (shape is None or tuple(shape[:len(lead)]) != lead):
      raise ValueError(
          f"layer_inputs['{path}'] has shape {shape}, expected leading axes {lead} (the kernel's "
          + (f"stack {plan.stack}" if plan.stack else "") + (" and " if plan.stack and plan.groups > 1 else "")
          + (f"{plan.groups} feature groups" if plan.groups > 1 else "") + "), one set of rows per slice, "
          "as scsgd_jax.capture_nnx / capture_linen capture them.")
    rows_shape = (-1,) if not lead else (math.prod(lead), -1)
    if plan.statistics.takes_ids:
      if shape is None or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"layer_inputs['{path}'] must hold the integer token ids of embedding '{path}' "
            f"(vocabulary n={n}), got {type(x).__name__} of dtype {getattr(x, 'dtype', None)}.")
      rows[path] = jax.lax.stop_gradient(x).reshape(rows_shape)
      continue
    if shape is None or len(shape) < 2 + len(lead) or shape[-1] != n:
      raise ValueError(
          f"layer_inputs['{path}'] has shape {shape}, expected ({'*' + str(lead) + ', ' if lead else ''}rows, {n}) "
          f"to match kernel '{path}' read with input axes {plan.input_axes} (n={n}). A conv kernel (kh, kw, cin, "
          "cout) needs im2col rows of size kh*kw*cin; rows not captured by scsgd_jax.capture_nnx / capture_linen "
          "(whose output says each kernel's layout) of a DenseGeneral/Einsum kernel whose input axes are not the "
          "default, or of a stacked (scanned) kernel, need input_axes=scsgd_jax.input_axes_nnx(model) (or "
          "input_axes_linen).")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"layer_inputs['{path}'] must be floating point, got dtype {x.dtype}.")
    rows[path] = jax.lax.stop_gradient(x).reshape(rows_shape + (n,)).astype(jnp.float32)
  return rows
