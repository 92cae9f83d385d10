r"""The optax transformation: per-kernel input statistics and periodic conditioner refreshes."""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scsgd_jax._src import sketch
from scsgd_jax._src import statistics as stats_lib

__all__ = [
    "KernelPlan",
    "STATIC_ARGS",
    "ScaleBySketchedConditioningState",
    "default_input_axes",
    "default_kernel_filter",
    "kernel_paths",
    "path_to_str",
    "scale_by_sketched_conditioning",
]

ConditionerKind = Literal["auto", "sketched", "full"]
StatisticsKind = Union[Literal["auto", "dense", "streaming", "diagonal"], stats_lib.CorrelationStatistics]

# The defaults of the shape-deciding arguments live here, once. They are ``None`` in the
# signatures so that ``optax.inject_hyperparams`` (which turns every numeric default into an
# array) leaves them alone.
DEFAULT_RANK = 32
DEFAULT_UPDATE_EVERY = 50
DEFAULT_OVERSAMPLE = 10
DEFAULT_POWER_ITERATIONS = 1
DEFAULT_STATISTICS_EVERY = 1
DEFAULT_OUTLIER_THRESHOLD = 100.0
DEFAULT_BUDGET = "model"  # statistics="auto": the model-wide memory rule (scale_by_sketched_conditioning docs)

#: Arguments that decide shapes or the compiled schedule; under ``optax.inject_hyperparams`` list
#: those you pass in ``static_args`` (those left at their defaults need nothing).
STATIC_ARGS = ("rank", "update_every", "full_max_dim", "oversample", "power_iterations", "statistics_every")


class ScaleBySketchedConditioningState(NamedTuple):
  """State of :func:`scale_by_sketched_conditioning`.

  Attributes:
    count: number of updates applied so far (``int32``).
    key: PRNG key, split at every refresh for the sketches' Gaussian matrices.
    statistics: ``{kernel path: statistics}`` (e.g. an :class:`~scsgd_jax.EmaState` of the
      dense ``C``, or the streaming sketch), one per conditioned kernel.
    factors: ``{kernel path: Factor}``, the conditioner currently applied.
    clipped_rows: ``{kernel path: int32}``, input rows clipped by the outlier guard so far.
  """

  count: jax.Array
  key: jax.Array
  statistics: dict[str, Any]
  factors: dict[str, sketch.Factor]
  clipped_rows: dict[str, jax.Array]

  def summary(self) -> dict[str, str]:
    """How each conditioned kernel is conditioned, read off this state (works on ``jax.eval_shape`` of ``init``).

    E.g. ``{'conv1/kernel': 'dense C, full C^(1/2), n=25', 'dense1/kernel': 'streaming C Omega, rank 32,
    n=800'}``; kernels absent from it get plain updates.
    """
    out = {}
    for path, f in self.factors.items():
      stats, n = self.statistics[path], f.dim
      if f.q is None:
        kind = "token frequencies" if path.rsplit("/", 1)[-1] == "embedding" else "diagonal C"
      elif isinstance(stats, stats_lib.NystromState):
        kind = f"streaming C Omega, rank {f.rank}"
      elif isinstance(stats, stats_lib.EmaState) and len(stats.moments.shape) == 2:
        kind = "dense C, full C^(1/2)" if f.rank == n else f"dense C, rank {f.rank}"
      else:
        kind = f"custom statistics, rank {f.rank}"
      out[path] = f"{kind}, n={n}"
    return out


class KernelPlan(NamedTuple):
  """How one kernel is conditioned (decided from its shape at ``init``, see :func:`scale_by_sketched_conditioning`).

  Attributes:
    input_axes: the kernel axes contracted with the layer input.
    n: the input dimension (product of ``input_axes``).
    kind: ``'dense'``, ``'streaming'``, ``'diagonal'``, ``'embedding'`` or ``'custom'``.
    rank: the factor's rank; ``None`` for the full ``C^{1/2}``; ``0`` for diagonal kinds.
    statistics: the :class:`~scsgd_jax.CorrelationStatistics` kept for it.
    phase: the step (mod ``update_every``) at which its refresh falls.
  """

  input_axes: tuple[int, ...]
  n: int
  kind: str
  rank: Optional[int]
  statistics: stats_lib.CorrelationStatistics
  phase: int


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_to_str(path) -> str:
  """``('conv1', 'kernel')``-style key path as ``'conv1/kernel'`` (the names used in errors and in the state).

  The trailing ``.value`` of an ``nnx.Variable`` leaf is dropped, so an NNX state
  of Variables and its pure-array form give the same names.
  """
  path = tuple(path)
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]
  return "/".join(_key_str(k) for k in path)


def default_kernel_filter(path: str, leaf: jax.Array) -> bool:
  """Flax's conventions: a ``kernel`` with at least two dims (Dense, Conv, DenseGeneral, Einsum) or a 2-D ``embedding``."""
  name = path.rsplit("/", 1)[-1]
  ndim = getattr(leaf, "ndim", 0)
  return (name == "kernel" and ndim >= 2) or (name == "embedding" and ndim == 2)


def default_input_axes(path: str, leaf: jax.Array) -> tuple[int, ...]:
  """The input axes of a Flax kernel, read from its name and rank.

  - ``.../embedding`` ``(vocab, features)``: ``(0,)`` (one-hot input).
  - attention's ``.../query|key|value/kernel`` ``(in, heads, head_dim)`` (``nnx.MultiHeadAttention``,
    ``nn.MultiHeadDotProductAttention``): ``(0,)``.
  - everything else: all but the last axis (Dense ``(n, p)``, Conv ``(*window, cin, cout)``,
    attention's ``out`` ``(heads, head_dim, out)``, a DenseGeneral with one output axis).

  A DenseGeneral with several output axes or an Einsum kernel needs the exact axes:
  pass ``input_axes=scsgd_jax.input_axes_nnx(model)`` (or ``input_axes_linen``); a
  mismatch with the captured rows is reported at the first update, naming the kernel.
  """
  parts = path.split("/")
  ndim = leaf.ndim
  if parts[-1] == "embedding":
    return (0,)
  if ndim == 3 and len(parts) >= 2 and parts[-2] in ("query", "key", "value"):
    return (0,)
  return tuple(range(ndim - 1))


def kernel_paths(tree, kernel_filter: Callable[[str, Any], bool] = default_kernel_filter) -> dict[str, Any]:
  """``{path: leaf}`` of the leaves of ``tree`` that ``kernel_filter`` selects."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {path_to_str(p): leaf for p, leaf in flat if kernel_filter(path_to_str(p), leaf)}


def _flat_inputs(layer_inputs) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(layer_inputs)
  return {path_to_str(p): leaf for p, leaf in flat}


def _keep_if_not_finite(new, old):
  """``new`` if every leaf is finite, else ``old`` (a non-finite batch must not poison the state)."""
  ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(new)]))
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


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


def _state_floats(kind: str, n: int, k: Optional[int], width: int) -> int:
  """Floats of one kernel's statistics + factor (the memory rule; a test checks it against real states)."""
  if kind in ("diagonal", "embedding"):
    return 2 * n + 1
  factor = 2 * n * n + 1 if k is None else n * k + k * k + 1
  stats = n * n + 1 if kind == "dense" else 2 * n * width + 2
  return stats + factor


def _guard_rows(rows: jax.Array, reference: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
  """Clips rows whose squared norm exceeds ``threshold * reference`` back to that bound; returns the count.

  ``reference`` is the running ``tr C`` (the expected squared row norm); before any
  data it is the batch's median squared norm (its mean if the median is 0). Norms
  are taken with a per-row rescale, so rows of 1e18 do not overflow.
  """
  scale = jnp.max(jnp.abs(rows), axis=1)
  safe = jnp.where(scale > 0, scale, 1.0)
  norms = safe * jnp.sqrt(jnp.sum(jnp.square(rows / safe[:, None]), axis=1))
  norms = jnp.where(scale > 0, norms, 0.0)
  sq = jnp.square(norms)
  batch_ref = jnp.median(sq)
  batch_ref = jnp.where(batch_ref > 0, batch_ref, jnp.mean(sq))
  ref = jnp.where(reference > 0, reference, batch_ref)
  bound = jnp.sqrt(threshold * ref)
  over = norms > bound
  factor = jnp.where(over, bound / jnp.where(over, norms, 1.0), 1.0)
  return rows * factor[:, None], jnp.sum(over).astype(jnp.int32)


def _identity_factor(plan: KernelPlan) -> sketch.Factor:
  if plan.kind in ("diagonal", "embedding"):
    return sketch.Factor(None, None, jnp.ones((plan.n,)))
  return sketch.identity_factor(plan.n, plan.n if plan.rank is None else plan.rank)


def scale_by_sketched_conditioning(
    rank: Optional[int] = None,
    *,
    update_every: Optional[int] = None,
    ema_rate: float = 0.05,
    conditioner: ConditionerKind = "auto",
    statistics: StatisticsKind = "auto",
    warm_start: bool = True,
    stagger: bool = True,
    budget: Literal["kernel", "model"] = DEFAULT_BUDGET,
    outlier_threshold: float = DEFAULT_OUTLIER_THRESHOLD,
    full_max_dim: Optional[int] = None,
    oversample: Optional[int] = None,
    power_iterations: Optional[int] = None,
    eigenvalue_floor: float = stats_lib.DEFAULT_EIGENVALUE_FLOOR,
    statistics_every: Optional[int] = None,
    kernel_filter: Optional[Callable[[str, Any], bool]] = None,
    input_axes: Union[None, Mapping[str, Sequence[int]], Callable[[str, Any], Sequence[int]]] = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditions each kernel gradient on its input side (Gonen & Shalev-Shwartz, Section 3).

  For a kernel ``W`` read as the matrix ``(n, p)`` over its input axes (Dense
  ``(n, p)``; Conv ``(kh*kw*cin, cout)``; attention's query ``(in, heads*head_dim)``)
  with inputs ``x``, the gradient ``G`` becomes ``A^{-1} G``, i.e. the paper's
  :math:`\delta (A^{-1} x)^\top`, where

  .. math::

    A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - QQ^\top)

  is rebuilt from an EMA of the input correlation :math:`C = E[x x^\top]`. The
  refresh runs inside the jitted step under ``lax.cond``, kernels of equal shape
  factored together under ``jax.vmap``. Between refreshes a step costs
  ``O(n k)`` per gradient column.

  **Statistics, per kernel** (``statistics``): ``'dense'`` is the paper's ``n x n``
  EMA of ``C``; ``'streaming'`` keeps only ``Y = C Omega`` (``n x (rank + oversample)``)
  and ``tr C`` and factors them by single-pass Nystrom; ``'diagonal'`` keeps
  ``diag C`` (``A = diag(C)^{1/2}``). ``'auto'`` (default) picks by memory, from
  each kernel's options best first (dense, streaming at ``rank``, streaming at each
  smaller rank, diagonal): the best whose statistics and factor fit in ``n * p``
  floats (what Adam keeps beyond SGD's momentum, its second moment), so that
  ``scsgd``'s whole state is at most Adam's for every kernel; a kernel where none
  fits (``p = 1``) is left to plain SGD. With ``budget='model'`` (default) the
  bound is the model's: after that first choice, the floats the model has left
  (one per parameter, less the state's counters) go to the kernels of smallest
  ``n`` first, each taking its best option that they pay for (LeNet: conv1 gets
  the dense ``C`` and full ``C^{1/2}``, conv2 the dense ``C``); the whole state
  stays within Adam's. ``budget='kernel'`` keeps the first, per-kernel choice. An embedding (a 2-D ``embedding`` leaf) always gets the exact
  diagonal ``A = C^{1/2}`` of its token frequencies. A :class:`CorrelationStatistics`
  is used for every kernel as given.

  **Conditioner** (``conditioner``): ``'full'`` uses :math:`A = C^{1/2}` (Theorem 1,
  forces dense statistics); ``'sketched'`` uses Algorithm 1 with rank ``k < n``;
  ``'auto'`` uses the full conditioner when dense statistics are kept and
  ``n <= full_max_dim`` (default ``4 * rank``), else the sketched one.

  **Schedule.** With ``warm_start`` (default) the statistics have no identity
  prior (bias-corrected EMA) and every kernel refreshes after 1, 2, 4, ... folds
  until ``update_every``, so the first steps are conditioned; ``warm_start=False``
  is the paper's ``C_0 = I`` with refreshes every ``update_every`` steps from step 0.
  With ``stagger`` the periodic refreshes of the kernels are spread over the
  ``update_every`` window so that no step pays for all of them.

  **Robustness.** Before folding, input rows whose squared norm exceeds
  ``outlier_threshold`` times the running ``tr C`` are clipped to that bound and
  counted in ``state.clipped_rows``; a batch whose rows (or folded statistics)
  are not finite is skipped; a refresh that would give a non-finite factor keeps
  the previous one.

  ``update(updates, state, params=None, *, layer_inputs)`` needs the captured
  inputs as a keyword argument: a tree with, at each conditioned kernel's path,
  an array ``(..., n)`` of input rows in the kernel's input-axis order (integer
  ids for an embedding); see :func:`scsgd_jax.capture_nnx` and
  :func:`scsgd_jax.capture_linen`.

  Args:
    rank: sketch rank ``k`` (default 32).
    update_every: refresh period ``N`` in steps (default 50, the paper's).
    ema_rate: :math:`\nu`, the EMA weight of a new batch.
    conditioner: ``'auto'``, ``'sketched'`` or ``'full'``.
    statistics: ``'auto'``, ``'dense'``, ``'streaming'``, ``'diagonal'`` or a
      :class:`CorrelationStatistics`.
    warm_start: bias-corrected statistics and doubling refreshes at the start.
    stagger: spread the kernels' periodic refreshes over the window.
    budget: the memory rule of ``statistics='auto'``: ``'model'`` (default), the model's leftover
      floats too (see above); ``'kernel'``, each kernel within its own ``n * p`` floats.
    outlier_threshold: rows above this multiple of the running ``tr C`` (squared
      norm) are clipped before they enter the statistics.
    full_max_dim: ``n`` up to which ``'auto'`` picks the full conditioner (default ``4 * rank``).
    oversample: sketch columns beyond ``rank`` (default 10).
    power_iterations: range-finder power iterations of the dense sketch (default 1).
    eigenvalue_floor: relative eigenvalue floor (default 1e-2): eigenvalues below this multiple of
      ``tr(C) / n`` are raised to it, so no direction is amplified by more than ``1 / sqrt(floor)`` = 10x
      the average scale (the pure sketching functions default to 1e-5, a numerical guard only).
    statistics_every: fold statistics every this many steps (default 1: every step).
    kernel_filter: ``(path, leaf) -> bool`` selecting the conditioned leaves
      (default :func:`default_kernel_filter`).
    input_axes: each kernel's input axes: a callable ``(path, leaf) -> axes``, or
      a mapping ``{path: axes}`` overriding :func:`default_input_axes` for the
      paths it names (e.g. :func:`scsgd_jax.input_axes_nnx` of the model).
    seed: seed of the PRNG key kept in the state.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, arXiv:1506.02649, 2015.
    Tropp, Yurtsever, Udell & Cevher, Fixed-rank approximation of a positive-semidefinite
    matrix from streaming data, NeurIPS 2017.
  """
  rank = _static_int("rank", rank, DEFAULT_RANK, 1)
  update_every = _static_int("update_every", update_every, DEFAULT_UPDATE_EVERY, 1)
  oversample = _static_int("oversample", oversample, DEFAULT_OVERSAMPLE, 0)
  power_iterations = _static_int("power_iterations", power_iterations, DEFAULT_POWER_ITERATIONS, 0)
  statistics_every = _static_int("statistics_every", statistics_every, DEFAULT_STATISTICS_EVERY, 1)
  full_max_dim = _static_int("full_max_dim", full_max_dim, 4 * rank, 0)
  if conditioner not in ("auto", "sketched", "full"):
    raise ValueError(f"conditioner must be 'auto', 'sketched' or 'full', got {conditioner!r}.")
  custom = isinstance(statistics, stats_lib.CorrelationStatistics)
  if not custom and statistics not in ("auto", "dense", "streaming", "diagonal"):
    raise ValueError(
        "statistics must be 'auto', 'dense', 'streaming', 'diagonal' or a CorrelationStatistics, "
        f"got {statistics!r}.")
  if statistics == "streaming" and conditioner == "full":
    raise ValueError("conditioner='full' needs the dense C: it cannot be combined with statistics='streaming'.")
  if budget not in ("kernel", "model"):
    raise ValueError(f"budget must be 'kernel' or 'model', got {budget!r}.")
  if not isinstance(warm_start, bool) or not isinstance(stagger, bool):
    raise ValueError(f"warm_start and stagger must be bools, got {warm_start!r} and {stagger!r}.")
  if kernel_filter is None:
    kernel_filter = default_kernel_filter
  prior = not warm_start
  common = dict(identity_prior=prior, eigenvalue_floor=eigenvalue_floor)
  dense_stats = stats_lib.ema_correlation(
      ema_rate, oversample=oversample, power_iterations=power_iterations, **common)
  diag_stats = stats_lib.diagonal_correlation(ema_rate, **common)
  id_stats = stats_lib.diagonal_correlation(ema_rate, takes_ids=True, **common)
  streaming_stats = {}

  def streaming(k):
    if k not in streaming_stats:
      streaming_stats[k] = stats_lib.nystrom_correlation(k, ema_rate, oversample=oversample, **common)
    return streaming_stats[k]

  def axes_of(path, leaf):
    if callable(input_axes):
      axes = input_axes(path, leaf)
    elif input_axes is not None and path in input_axes:
      axes = input_axes[path]
    else:
      axes = default_input_axes(path, leaf)
    axes = tuple(int(a) % leaf.ndim for a in axes)
    if not axes or len(set(axes)) != len(axes) or len(axes) >= leaf.ndim:
      raise ValueError(
          f"input axes {axes} of kernel '{path}' {tuple(leaf.shape)} must be distinct and leave at "
          "least one output axis.")
    return axes

  def check_rank(path, n, k):
    if k >= n:
      raise ValueError(
          f"rank={k} must be < n={n}, the input dimension of kernel '{path}'; "
          "lower rank, or use conditioner='auto' or 'full'.")

  def choose(path, n) -> Union[tuple[str, Optional[int], stats_lib.CorrelationStatistics], list]:
    """``(kind, rank, statistics)`` of one kernel, or under ``'auto'`` its options, best first."""
    full = conditioner == "full" or (conditioner == "auto" and n <= full_max_dim)
    if conditioner == "sketched":
      check_rank(path, n, rank)
    if custom:
      if not full:
        check_rank(path, n, rank)
      return "custom", None if full else rank, statistics
    if statistics == "diagonal":
      return "diagonal", 0, diag_stats
    if statistics == "dense" or conditioner == "full":
      if not full:
        check_rank(path, n, rank)
      return "dense", None if full else rank, dense_stats
    if statistics == "streaming":
      check_rank(path, n, rank)
      return "streaming", rank, streaming(rank)
    options = [("dense", None if full else rank)] if full or rank < n else []
    options += [("streaming", k) for k in range(min(rank, n - 1), 0, -1)] + [("diagonal", 0)]
    return [(kind, k, _state_floats(kind, n, k, min((k or 0) + oversample, n))) for kind, k in options]

  def allot(shapes: dict[str, tuple[int, int]], options: dict[str, list], floats: int) -> dict[str, int]:
    """'auto': each kernel's option (an index into its list; ``len`` = none); ``floats``: the model's bound.

    Every kernel takes its best option that fits in its own ``n * p`` floats, so each
    kernel alone is within Adam's bound; with ``budget='model'`` what the model has left
    over then goes to the kernels of smallest ``n`` first (cheapest to upgrade), each
    taking its best option that the leftover pays for.
    """
    chosen = {}
    for path, opts in options.items():
      n, p = shapes[path]
      # 'model': 3 = this kernel's clipped-row counter and, were it alone, the count and key beyond Adam's.
      bound = n * p - (3 if budget == "model" else 0)
      chosen[path] = next((i for i, o in enumerate(opts) if o[2] <= bound), len(opts))
    if budget == "kernel":
      return chosen
    cost = lambda path: options[path][chosen[path]][2] if chosen[path] < len(options[path]) else 0
    left = floats - sum(cost(path) for path in options)
    for path in sorted(options, key=lambda q: shapes[q][0]):
      mine = cost(path)
      best = next((i for i, o in enumerate(options[path]) if o[2] <= mine + left), chosen[path])
      if best < chosen[path]:
        chosen[path] = best
        left -= cost(path) - mine
    return chosen

  def plans(tree) -> dict[str, KernelPlan]:
    out, shapes, options = {}, {}, {}
    for path, leaf in kernel_paths(tree, kernel_filter).items():
      axes = axes_of(path, leaf)
      n = math.prod(leaf.shape[a] for a in axes)
      if path.rsplit("/", 1)[-1] == "embedding" and not custom:
        out[path] = ("embedding", 0, id_stats, axes, n)
        continue
      chosen = choose(path, n)
      if isinstance(chosen, list):
        shapes[path], options[path] = (n, leaf.size // n), chosen
        out[path] = (None, None, None, axes, n)
      else:
        out[path] = (*chosen, axes, n)
    if options:
      # budget='model': Adam's state beyond SGD's momentum, one float per parameter, less this state's scalars
      # (count and key beyond Adam's count, a clipped-row counter per kernel) and the embeddings' statistics.
      floats = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree)) - 2 - len(out)
      floats -= sum(_state_floats("embedding", o[4], 0, 0) for o in out.values() if o[0] == "embedding")
      for path, i in allot(shapes, options, floats).items():
        if i == len(options[path]):
          del out[path]  # nothing fits: plain SGD
          continue
        kind, k, _ = options[path][i]
        out[path] = (kind, k, {"dense": dense_stats, "diagonal": diag_stats}.get(kind) or streaming(k),
                     *out[path][3:])
    total = len(out)
    return {
        path: KernelPlan(axes, n, kind, k, stats, (i * update_every) // total if stagger else 0)
        for i, (path, (kind, k, stats, axes, n)) in enumerate(out.items())
    }

  def init_fn(params):
    kernel_plans = plans(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(kernel_plans) + 1)
    return ScaleBySketchedConditioningState(
        count=jnp.zeros([], jnp.int32),
        key=keys[0],
        statistics={p: plan.statistics.init(plan.n, kk) for (p, plan), kk in zip(kernel_plans.items(), keys[1:])},
        factors={p: _identity_factor(plan) for p, plan in kernel_plans.items()},
        clipped_rows={p: jnp.zeros([], jnp.int32) for p in kernel_plans},
    )

  def refresh_due(count, phase):
    due = (count >= phase) & ((count - phase) % update_every == 0)
    if warm_start:
      t = count + 1  # folds so far
      due |= (t < update_every) & ((t & (t - 1)) == 0)
    return due

  def update_fn(updates, state, params=None, *, layer_inputs=None, **extra_args):
    del params, extra_args
    kernel_plans = plans(updates)
    if set(kernel_plans) != set(state.factors):
      raise ValueError(
          f"the conditioned kernels of `updates` {sorted(kernel_plans)} do not match those the state "
          f"was initialised with {sorted(state.factors)}.")
    rows = _checked_rows(kernel_plans, layer_inputs)

    def fold(operand):
      stats, clipped = operand
      new_stats, new_clipped = {}, {}
      for path, plan in kernel_plans.items():
        x, n_clipped = rows[path], jnp.zeros([], jnp.int32)
        if not plan.statistics.takes_ids:
          x, n_clipped = _guard_rows(x, plan.statistics.trace(stats[path]), outlier_threshold)
        new_stats[path] = _keep_if_not_finite(plan.statistics.update(stats[path], x), stats[path])
        new_clipped[path] = clipped[path] + n_clipped
      return new_stats, new_clipped

    count = state.count
    operand = (state.statistics, state.clipped_rows)
    if statistics_every == 1:
      new_stats, clipped = fold(operand)
    else:
      new_stats, clipped = jax.lax.cond(count % statistics_every == 0, fold, lambda o: o, operand)
    factors, key = _refresh(kernel_plans, new_stats, state.factors, state.key, count, refresh_due)

    def condition(path, g):
      p = path_to_str(path)
      if p in factors and g is not None:
        return sketch.precondition_kernel(factors[p], g, kernel_plans[p].input_axes)
      return g

    new_updates = jax.tree_util.tree_map_with_path(condition, updates)
    return new_updates, ScaleBySketchedConditioningState(
        count=optax.safe_increment(count), key=key, statistics=new_stats, factors=factors,
        clipped_rows=clipped)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _checked_rows(kernel_plans: dict[str, KernelPlan], layer_inputs) -> dict[str, jax.Array]:
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
    if plan.statistics.takes_ids:
      if shape is None or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"layer_inputs['{path}'] must hold the integer token ids of embedding '{path}' "
            f"(vocabulary n={n}), got {type(x).__name__} of dtype {getattr(x, 'dtype', None)}.")
      rows[path] = jax.lax.stop_gradient(x).reshape(-1)
      continue
    if shape is None or len(shape) < 2 or shape[-1] != n:
      raise ValueError(
          f"layer_inputs['{path}'] has shape {shape}, expected (rows, {n}) to match kernel '{path}' "
          f"read with input axes {plan.input_axes} (n={n}). A conv kernel (kh, kw, cin, cout) needs im2col "
          "rows of size kh*kw*cin; a DenseGeneral/Einsum kernel whose input axes are not the default "
          "needs input_axes=scsgd_jax.input_axes_nnx(model) (or input_axes_linen).")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"layer_inputs['{path}'] must be floating point, got dtype {x.dtype}.")
    rows[path] = jax.lax.stop_gradient(x).reshape(-1, n).astype(jnp.float32)
  return rows


def _refresh(kernel_plans, stats, old_factors, key, count, refresh_due):
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
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[group_stats[p] for p in group])
        group_keys = jnp.stack([key_of[p] for p in group])
        out = jax.vmap(lambda s, kk, plan=plan: plan.statistics.factor(s, kk, plan.rank))(stacked, group_keys)
        for i, p in enumerate(group):
          # never replace a good factor by a non-finite one
          new[p] = _keep_if_not_finite(jax.tree.map(lambda a, i=i: a[i], out), group_factors[p])
      return new

    operand = ({p: stats[p] for p in paths}, {p: old_factors[p] for p in paths})
    factors.update(jax.lax.cond(
        refresh_due(count, phase), do_refresh, lambda o: dict(o[1]), operand))
  return factors, keys[0]
