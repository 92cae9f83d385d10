r"""The optax transformation: per-kernel input statistics and periodic conditioner refreshes.

The per-kernel plan (which statistics, which rank) is decided in :mod:`plan`; this module folds the
captured rows into the statistics, refreshes the factors when due and conditions the gradients.
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
from typing import Any, Callable, Hashable, Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import schedule
from scsgd_jax._src import sketch
from scsgd_jax._src import state as state_lib
from scsgd_jax._src import statistics as stats_lib
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = [
    "STATIC_ARGS",
    "ScaleBySketchedConditioningState",
    "resolve_static_args",
    "scale_by_sketched_conditioning",
]

ConditionerKind = Literal["auto", "sketched", "full"]
NormalizeKind = Literal["none", "embeddings", "all"]
StatisticsKind = Union[Literal["auto", "dense", "streaming", "diagonal"], stats_lib.CorrelationStatistics]

#: Arguments that decide shapes or the compiled schedule; under ``optax.inject_hyperparams`` list
#: those you pass in ``static_args`` (those left at their defaults need nothing).
STATIC_ARGS = ("rank", "update_every", "full_max_dim", "oversample", "power_iterations", "statistics_every")


def _static_int(name: str, value, default: int, minimum: int) -> int:
  """A shape-deciding integer argument: a Python int, or a clear error (``inject_hyperparams`` makes arrays)."""
  if value is None:
    return default
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    raise ValueError(
        f"{name} decides shapes or the compiled schedule and must be a Python int, got an array "
        f"({value!r}); optax.inject_hyperparams turns numeric arguments into arrays: list it in "
        f"static_args, e.g. optax.inject_hyperparams(scsgd_jax.scsgd, static_args=scsgd_jax.STATIC_ARGS)."
    )
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
  return int(value)


def resolve_static_args(**args) -> dict[str, int]:
  """The shape-deciding arguments of :func:`scale_by_sketched_conditioning` (:data:`STATIC_ARGS`) with
  ``None`` (or absent) resolved to the library's defaults, each checked: what a run records.

  >>> resolve_static_args(rank=8)["full_max_dim"]
  32
  """
  unknown = sorted(set(args) - set(STATIC_ARGS))
  if unknown:
    raise TypeError(f"resolve_static_args takes {STATIC_ARGS}, got {unknown}.")
  rank = _static_int("rank", args.get("rank"), defaults.RANK, 1)
  return {
      "rank": rank,
      "update_every": _static_int("update_every", args.get("update_every"), defaults.UPDATE_EVERY, 1),
      "full_max_dim": _static_int("full_max_dim", args.get("full_max_dim"), defaults.FULL_MAX_DIM_PER_RANK * rank, 0),
      "oversample": _static_int("oversample", args.get("oversample"), defaults.OVERSAMPLE, 0),
      "power_iterations": _static_int("power_iterations", args.get("power_iterations"), defaults.POWER_ITERATIONS, 0),
      "statistics_every": _static_int("statistics_every", args.get("statistics_every"), defaults.STATISTICS_EVERY, 1),
  }


def _flat_inputs(layer_inputs) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(layer_inputs)
  return {plan_lib.path_to_str(p): leaf for p, leaf in flat}


def scale_by_sketched_conditioning(
    rank: Optional[int] = None,
    *,
    update_every: Optional[int] = None,
    ema_rate: float = defaults.EMA_RATE,
    conditioner: ConditionerKind = "auto",
    statistics: StatisticsKind = "auto",
    warm_start: bool = True,
    normalize: NormalizeKind = defaults.NORMALIZE,
    stagger: bool = True,
    budget: Literal["kernel", "model"] = defaults.BUDGET,
    outlier_threshold: float = defaults.OUTLIER_THRESHOLD,
    full_max_dim: Optional[int] = None,
    oversample: Optional[int] = None,
    power_iterations: Optional[int] = None,
    eigenvalue_floor: float = defaults.EIGENVALUE_FLOOR,
    statistics_every: Optional[int] = None,
    kernel_filter: Optional[Callable[[str, Any], bool]] = None,
    input_axes: plan_lib.InputAxes = None,
    axis_name: Optional[Hashable] = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditions each kernel gradient on its input side (Gonen & Shalev-Shwartz, Section 3).

  A kernel ``W`` read as the matrix ``(n, p)`` over its input axes, with inputs ``x``, gets
  ``A^{-1} G`` for its gradient ``G`` (the paper's :math:`\delta (A^{-1} x)^\top`), with
  :math:`A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - QQ^\top)` rebuilt every ``update_every`` steps
  from an EMA of :math:`C = E[x x^\top]`, inside the jitted step. A step costs ``O(n k)`` per
  gradient column. ``statistics='auto'`` picks each kernel's statistics (dense ``C``, streaming
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
    update_every: refresh period ``N`` in steps (default 50, the paper's).
    ema_rate: :math:`\nu \in (0, 1]`, the EMA weight of a new batch per step (a fold every ``s``
      steps weighs its batch :math:`1 - (1 - \nu)^s`, so the average spans the same steps).
    conditioner: ``'full'`` (:math:`A = C^{1/2}`, Theorem 1), ``'sketched'`` (Algorithm 1) or
      ``'auto'`` (full when the dense ``C`` is kept and ``n <= full_max_dim``).
    statistics: ``'auto'``, ``'dense'``, ``'streaming'``, ``'diagonal'`` or a :class:`CorrelationStatistics`.
    warm_start: bias-corrected statistics and refreshes after 1, 2, 4, ... folds (else the paper's
      ``C_0 = I`` and refreshes every ``update_every`` steps from step 0).
    normalize: which kernels are conditioned by ``C / (tr C / n)``, i.e. ``A^{-1}`` times ``sqrt(tr C / n)`` (the
      direction of ``C``'s mean eigenvalue keeps its gradient's scale, so the conditioned step scales with the
      inputs as SGD's does): ``'none'`` (the paper's ``A = C^{1/2}`` everywhere, whose step is invariant to the
      inputs' scale), ``'embeddings'`` (default; the embeddings alone: their inputs are one-hot, ``tr C / n = 1 / vocab``,
      so the paper's ``A`` multiplies the table's step by ``sqrt(vocab)`` at the mean frequency; normalized, each
      token's step follows its frequency relative to the uniform one) or ``'all'`` (every kernel: one rate that
      fits SGD fits every layer).
    stagger: spread the kernels' periodic refreshes over the window.
    budget: memory rule of ``'auto'``: ``'model'`` (the model's leftover floats too) or ``'kernel'``.
    outlier_threshold: rows above this multiple (``>= 1``) of the running ``tr C`` (squared norm) are
      clipped before they enter the statistics; ``inf`` turns the guard off.
    full_max_dim: ``n`` up to which ``'auto'`` picks the full conditioner (default ``4 * rank``).
    oversample: sketch columns beyond ``rank`` (default 10).
    power_iterations: range-finder power iterations of the dense sketch (default 1).
    eigenvalue_floor: eigenvalues below this multiple (in ``[0, 1]``) of ``tr(C) / n`` are raised to it
      (default 1e-2: no direction amplified more than 10x the average scale).
    statistics_every: fold statistics every this many steps (default 2: half the fold cost; the EMA then
      averages over twice the steps).
    kernel_filter: ``(path, leaf) -> bool`` selecting the conditioned leaves (default: Flax kernels
      and embeddings, :func:`default_kernel_filter`).
    input_axes: each kernel's input axes, a callable ``(path, leaf) -> axes`` or a mapping ``{path: axes}``
      (e.g. :func:`scsgd_jax.input_axes_nnx` of the model), overriding what the capture read. Not needed
      with :func:`~scsgd_jax.capture_nnx` / :func:`~scsgd_jax.capture_linen`: their output says each
      kernel's axes, read from its layer (Einsum equations included). ``init`` sees only the parameters
      and reads a kernel by :func:`default_input_axes` (right for Dense, Conv, attention, embeddings);
      a DenseGeneral/Einsum kernel read otherwise is re-planned at the first update with its true axes,
      keeping the kind of statistics ``init`` chose (so the state keeps its structure) and starting them
      afresh (the state's shapes change once: ``jit`` traces twice, and a checkpoint template from
      ``init`` does not fit it; pass ``input_axes`` to plan with the true axes at ``init``).
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
  return conditioning(dict(locals()))


def arguments(caller: str, rank=None, **kwargs) -> dict[str, Any]:
  """Every argument of :func:`scale_by_sketched_conditioning`, ``kwargs`` over its defaults: the one
  signature the output side and :func:`scsgd_jax.contrib.scsgd_two_sided` build from (``caller`` names the
  function in the error for an argument it does not take)."""
  try:
    bound = inspect.signature(scale_by_sketched_conditioning).bind(rank, **kwargs)
  except TypeError as e:
    raise TypeError(f"{caller}: {e}") from None
  bound.apply_defaults()
  return dict(bound.arguments)


def conditioning(args: dict[str, Any], *, default_axes=plan_lib.default_input_axes,
                 budget_share: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """:func:`scale_by_sketched_conditioning` from its arguments ``args`` (:func:`arguments`), reading a kernel
  along ``default_axes`` unless told otherwise (the output side passes the kernel's output axes), its
  statistics within ``budget_share`` of the memory rule's budget under ``statistics='auto'`` (the two sides
  of :func:`scsgd_jax.contrib.scsgd_two_sided` splitting it)."""
  tx, _ = conditioning_and_plans(args, default_axes=default_axes, budget_share=budget_share)
  return tx


def conditioning_and_plans(args: dict[str, Any], *, default_axes=plan_lib.default_input_axes,
                           budget_share: float = 1.0, extra=None):
  """:func:`conditioning` and its plans: ``plans(tree, captured_axes=None) -> {path: KernelPlan}``, the plans its
  ``init`` and ``update`` use for a tree of that structure (cached), for a transformation built on it;
  ``extra``: what that transformation keeps per kernel beside the statistics, for the memory rule
  (:class:`~scsgd_jax._src.plan.Spec`'s)."""
  a = types.SimpleNamespace(**args)
  static = resolve_static_args(rank=a.rank, update_every=a.update_every, full_max_dim=a.full_max_dim,
                               oversample=a.oversample, power_iterations=a.power_iterations,
                               statistics_every=a.statistics_every)
  _check_choices(a.conditioner, a.statistics, a.budget, a.warm_start, a.stagger, a.normalize)
  checks.check_float("outlier_threshold", a.outlier_threshold, low=1.0, allow_inf=True)
  checks.check_float("ema_rate", a.ema_rate, low=0.0, high=1.0, low_open=True)
  checks.check_float("budget_share", budget_share, low=0.0, high=1.0, low_open=True)
  if isinstance(a.statistics, stats_lib.CorrelationStatistics):
    _refuse_unread_by_custom_statistics(a)
  # ema_rate is per step: a fold every s steps weighs its batch 1 - (1 - nu)^s, so the EMA spans as many steps
  fold_rate = 1.0 - (1.0 - a.ema_rate) ** static["statistics_every"]
  choices = plan_lib.StatisticsChoices(fold_rate, warm_start=a.warm_start, oversample=static["oversample"],
                                       power_iterations=static["power_iterations"],
                                       eigenvalue_floor=a.eigenvalue_floor)
  spec = plan_lib.Spec(static["rank"], static["update_every"], static["full_max_dim"], static["oversample"],
                       a.conditioner, a.statistics, a.budget, a.stagger, plan_lib.kernels_of(a.kernel_filter, a.input_axes),
                       a.input_axes, choices, default_axes, budget_share, extra)
  plans = state_lib.PlanCache(spec)

  def init_fn(params):
    kernel_plans = plans(params)
    if not kernel_plans and default_axes is plan_lib.default_input_axes:  # the input side: say it, once a model
      warn_nothing_conditioned(params, plans.notes)
    key, fresh = state_lib.fresh_kernel_states(kernel_plans, a.seed)
    return ScaleBySketchedConditioningState(
        count=jnp.zeros([], jnp.int32),
        key=key,
        statistics={p: f[0] for p, f in fresh.items()},
        factors={p: f[1] for p, f in fresh.items()},
        clipped_rows={p: f[2] for p, f in fresh.items()},
        plan=state_lib.summary_of(kernel_plans, plans.notes, static["rank"]),
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
    state = state_lib.replanned(state, kernel_plans, a.seed, skipped, static["rank"])
    phases = plan_lib.slice_phases(kernel_plans, static["update_every"], a.stagger)  # fixed by the plans
    if skipped:
      state_lib.log_unconditioned(skipped)  # once per trace
      kernel_plans = {p: plan for p, plan in kernel_plans.items() if p not in skipped}
    rows = _checked_rows(kernel_plans, layer_inputs)
    fold = lambda operand: fold_lib.fold(kernel_plans, rows, *operand, a.outlier_threshold, a.axis_name)
    operand = (state.statistics, state.clipped_rows)
    if static["statistics_every"] == 1:
      new_stats, clipped = fold(operand)
    else:
      new_stats, clipped = jax.lax.cond(state.count % static["statistics_every"] == 0, fold, lambda o: o, operand)
    due = lambda count, phase: schedule.refresh_due(count, phase, static["update_every"], a.warm_start,
                                            static["statistics_every"])
    factors, key = schedule.refresh(kernel_plans, phases, new_stats, state.factors, state.key, state.count, due,
                                    a.normalize)
    return _condition(updates, kernel_plans, factors), state._replace(
        count=optax.safe_increment(state.count), key=key, statistics=new_stats, factors=factors,
        clipped_rows=clipped)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn), plans


def _refuse_unread_by_custom_statistics(a) -> None:
  """A ``CorrelationStatistics`` given as ``statistics=`` carries its own rate, prior, oversampling, power
  iterations and floor: the same arguments given beside it would do nothing, so they are refused."""
  given = {name: getattr(a, name) for name, default in (
      ("ema_rate", defaults.EMA_RATE), ("warm_start", True), ("oversample", None), ("power_iterations", None),
      ("eigenvalue_floor", defaults.EIGENVALUE_FLOOR)) if getattr(a, name) != default}
  if given:
    raise ValueError(
        f"statistics= is a CorrelationStatistics, which carries its own settings; {given} would do nothing beside "
        "it: set them on the statistics object (e.g. scsgd_jax.sketch.ema_correlation(rate, oversample=..., "
        "eigenvalue_floor=..., identity_prior=...)) and leave them out here.")


def warn_nothing_conditioned(params, notes: dict[str, str]) -> None:
  """A warning (once per model) that no leaf of ``params`` is conditioned: why for each kernel the filter took
  (``notes``), or, when it took none, the matrices it saw."""
  if notes:
    warnings.warn("scsgd_jax: no leaf is conditioned, so every leaf gets plain updates: "
                  + "; ".join(f"{p} ({why})" for p, why in notes.items()), stacklevel=3)
    return
  matrices = [plan_lib.path_to_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
              if np.ndim(leaf) >= 2]
  warnings.warn(
      f"scsgd_jax: no leaf is conditioned, so every leaf gets plain updates: the kernel filter took none of the "
      f"parameters' matrices {matrices[:8]}{' ...' if len(matrices) > 8 else ''}. Flax names kernels 'kernel' and "
      "'embedding'; for other names (Equinox's 'weight', a plain dict) say each kernel's input axes, e.g. "
      "input_axes={'layers/0/weight': scsgd_jax.Layout(input_axes=(1,))} for an (out, in) weight, (0,) for "
      "(in, out).", stacklevel=3)


def _check_choices(conditioner, statistics, budget, warm_start, stagger, normalize) -> None:
  if conditioner not in ("auto", "sketched", "full"):
    raise ValueError(f"conditioner must be 'auto', 'sketched' or 'full', got {conditioner!r}.")
  if not isinstance(statistics, stats_lib.CorrelationStatistics) and statistics not in (
      "auto", "dense", "streaming", "diagonal"):
    raise ValueError(
        "statistics must be 'auto', 'dense', 'streaming', 'diagonal' or a CorrelationStatistics, "
        f"got {statistics!r}.")
  if statistics == "streaming" and conditioner == "full":
    raise ValueError("conditioner='full' needs the dense C: it cannot be combined with statistics='streaming'.")
  if budget not in ("kernel", "model"):
    raise ValueError(f"budget must be 'kernel' or 'model', got {budget!r}.")
  for name, value in (("warm_start", warm_start), ("stagger", stagger)):
    if not isinstance(value, bool):
      raise ValueError(f"{name} must be a bool, got {value!r}.")
  if normalize not in ("none", "embeddings", "all"):
    raise ValueError(f"normalize must be 'none', 'embeddings' or 'all', got {normalize!r}.")


def _condition(updates, kernel_plans, factors):
  """``A^{-1} G`` for every conditioned kernel; other leaves pass through."""

  def condition(path, g):
    p = plan_lib.path_to_str(path)
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
