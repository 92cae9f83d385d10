r"""The optax transformation: per-kernel input statistics and periodic conditioner refreshes."""

from __future__ import annotations

import collections
from typing import Any, Callable, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import sketch
from scsgd_jax._src import statistics as stats_lib

__all__ = [
    "ScaleBySketchedConditioningState",
    "default_kernel_filter",
    "kernel_paths",
    "path_to_str",
    "scale_by_sketched_conditioning",
]

ConditionerKind = Literal["auto", "sketched", "full"]


class ScaleBySketchedConditioningState(NamedTuple):
  """State of :func:`scale_by_sketched_conditioning`.

  Attributes:
    count: number of updates applied so far (``int32``).
    key: PRNG key, split at every refresh for the sketches' Gaussian matrices.
    statistics: ``{kernel path: statistics}`` (for the default statistic, the EMA
      correlation ``C``, ``(n, n)`` ``float32``).
    factors: ``{kernel path: Factor}``, the conditioner currently applied.
  """

  count: jax.Array
  key: jax.Array
  statistics: dict[str, Any]
  factors: dict[str, sketch.Factor]


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
  """Flax's convention: a leaf named ``kernel`` with at least two dims (Dense ``(n, p)``, Conv ``(*window, cin, cout)``)."""
  return path.rsplit("/", 1)[-1] == "kernel" and getattr(leaf, "ndim", 0) >= 2


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


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def scale_by_sketched_conditioning(
    rank: int = 32,
    *,
    update_every: int = 50,
    ema_rate: float = 0.05,
    conditioner: ConditionerKind = "auto",
    full_max_dim: Optional[int] = None,
    oversample: int = 10,
    power_iterations: int = 1,
    eigenvalue_floor: float = sketch.DEFAULT_EIGENVALUE_FLOOR,
    statistics_every: int = 1,
    kernel_filter: Optional[Callable[[str, Any], bool]] = None,
    statistics: Optional[stats_lib.CorrelationStatistics] = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditions each kernel gradient on its input side (Gonen & Shalev-Shwartz, Section 3).

  For a kernel ``W`` (Flax layout ``(n, p)``; conv kernels read as
  ``(kh*kw*cin, cout)``) with inputs ``x``, the gradient ``G`` becomes
  ``A^{-1} G``, i.e. the paper's :math:`\delta (A^{-1} x)^\top`, where

  .. math::

    A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - QQ^\top)

  is rebuilt every ``update_every`` steps from an EMA of the input correlation
  :math:`C \leftarrow (1-\nu) C + \nu\, \mathrm{mean}(x x^\top)`, ``C = I`` at
  start. The refresh runs inside the jitted step under ``lax.cond``, with the
  factorisations of kernels of equal input dimension batched by ``jax.vmap``.
  Between refreshes a step costs ``O(n k)`` per gradient column.

  Conditioner choice per kernel (``conditioner``): ``'full'`` uses
  :math:`A = C^{1/2}` (Theorem 1); ``'sketched'`` uses Algorithm 1 with rank ``k``
  (``rank < n`` required); ``'auto'`` (default) uses the full conditioner when
  ``n <= full_max_dim`` (default ``4 * rank``: there a dense ``n x n`` apply costs
  at most twice the sketched ``O(2 n k)`` one and the ``O(n^3)`` eigh is cheap),
  else the sketched one.

  Leaves that are not kernels (biases, norms' scales, ...) pass through unchanged.
  Which leaves are kernels is decided by ``kernel_filter(path, leaf)`` (default:
  Flax's ``kernel`` with ndim >= 2); use ``optax.masked`` / ``optax.partition`` to
  route further.

  ``update(updates, state, params=None, *, layer_inputs)`` needs the captured
  inputs as a keyword argument: a tree with, at each kernel's path, an array
  ``(..., n)`` of input rows (see :func:`scsgd_jax.capture_nnx`,
  :func:`scsgd_jax.capture_linen`). A batch whose rows (or whose folded
  statistics) are not finite is skipped: the statistics stay as they were.

  Args:
    rank: sketch rank ``k``.
    update_every: refresh period ``N`` in steps (paper: 50).
    ema_rate: :math:`\nu`, the EMA weight of a new batch.
    conditioner: ``'auto'``, ``'sketched'`` or ``'full'``.
    full_max_dim: ``n`` up to which ``'auto'`` picks the full conditioner.
    oversample: sketch columns beyond ``rank``.
    power_iterations: range-finder power iterations.
    eigenvalue_floor: relative eigenvalue floor (see :mod:`scsgd_jax` docs).
    statistics_every: fold statistics every this many steps (1: every step).
    kernel_filter: ``(path, leaf) -> bool`` selecting the conditioned leaves
      (default :func:`default_kernel_filter`; a callable must be listed in
      ``static_args`` of ``optax.inject_hyperparams``).
    statistics: a :class:`CorrelationStatistics`; default ``ema_correlation(ema_rate, ...)``.
    seed: seed of the PRNG key kept in the state.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, arXiv:1506.02649, 2015.
  """
  if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
    raise ValueError(
        f"rank must be a positive Python int, got {rank!r}. Under optax.inject_hyperparams pass "
        "static_args=('rank', 'full_max_dim', 'oversample', 'power_iterations', 'update_every', 'statistics_every')."
    )
  for name, value in (("update_every", update_every), ("statistics_every", statistics_every)):
    if _is_concrete(value) and (isinstance(value, bool) or not int(value) == value or int(value) <= 0):
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  if conditioner not in ("auto", "sketched", "full"):
    raise ValueError(f"conditioner must be 'auto', 'sketched' or 'full', got {conditioner!r}.")
  if full_max_dim is None:
    full_max_dim = 4 * rank
  if kernel_filter is None:
    kernel_filter = default_kernel_filter
  if statistics is None:
    statistics = stats_lib.ema_correlation(
        ema_rate, oversample=oversample, power_iterations=power_iterations,
        eigenvalue_floor=eigenvalue_floor)

  def kernel_rank(path: str, n: int) -> Optional[int]:
    """``None`` for the full conditioner, else the sketch rank."""
    if conditioner == "full" or (conditioner == "auto" and n <= full_max_dim):
      return None
    if rank >= n:
      raise ValueError(
          f"rank={rank} must be < n={n}, the input dimension of kernel '{path}'; "
          "lower rank, or use conditioner='auto' or 'full'."
      )
    return rank

  def specs(tree) -> dict[str, tuple[int, Optional[int]]]:
    out = {}
    for path, leaf in kernel_paths(tree, kernel_filter).items():
      n = 1
      for d in leaf.shape[:-1]:
        n *= d
      out[path] = (n, kernel_rank(path, n))
    return out

  def init_fn(params):
    kernel_specs = specs(params)
    factors = {}
    for path, (n, k) in kernel_specs.items():
      factors[path] = sketch.identity_factor(n, n if k is None else k)
    return ScaleBySketchedConditioningState(
        count=jnp.zeros([], jnp.int32),
        key=jax.random.PRNGKey(seed),
        statistics={p: statistics.init(n) for p, (n, _) in kernel_specs.items()},
        factors=factors,
    )

  def refresh(stats, key, kernel_specs):
    """New factors of every kernel; kernels of equal ``(n, rank)`` are factored in one ``vmap``."""
    groups = collections.defaultdict(list)
    for path, spec in kernel_specs.items():
      groups[spec].append(path)
    keys = jax.random.split(key, len(kernel_specs) + 1)
    key_of = dict(zip(kernel_specs, keys[1:]))
    new = {}
    for (_, k), paths in groups.items():
      stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[stats[p] for p in paths])
      group_keys = jnp.stack([key_of[p] for p in paths])
      out = jax.vmap(lambda s, kk: statistics.factor(s, kk, k))(stacked, group_keys)
      for i, p in enumerate(paths):
        new[p] = jax.tree.map(lambda a: a[i], out)
    return new, keys[0]

  def update_fn(updates, state, params=None, *, layer_inputs=None, **extra_args):
    del params, extra_args
    if layer_inputs is None:
      raise ValueError(
          "scale_by_sketched_conditioning.update needs the keyword argument `layer_inputs`: "
          "the captured inputs of each conditioned layer (see scsgd_jax.capture_nnx / capture_linen), "
          "e.g. tx.update(grads, state, params, layer_inputs=layer_inputs)."
      )
    kernel_specs = specs(updates)
    if set(kernel_specs) != set(state.factors):
      raise ValueError(
          f"the kernels of `updates` {sorted(kernel_specs)} do not match those the state was "
          f"initialised with {sorted(state.factors)}."
      )
    inputs = _flat_inputs(layer_inputs)
    rows = {}
    for path, (n, _) in kernel_specs.items():
      if path not in inputs:
        raise ValueError(
            f"layer_inputs has no entry for the conditioned kernel '{path}' (input dimension n={n}); "
            f"it has entries for {sorted(inputs)}. Capture the layer's inputs, or exclude the kernel "
            "with kernel_filter / optax.masked."
        )
      x = inputs[path]
      shape = getattr(x, "shape", None)
      if shape is None or len(shape) < 2 or shape[-1] != n:
        raise ValueError(
            f"layer_inputs['{path}'] has shape {shape}, expected (rows, {n}) to match kernel '{path}' "
            f"whose input dimension is n={n} (a conv kernel (kh, kw, cin, cout) needs im2col rows of "
            "size kh*kw*cin in that order)."
        )
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"layer_inputs['{path}'] must be floating point, got dtype {x.dtype}.")
      rows[path] = jax.lax.stop_gradient(x).reshape(-1, n).astype(jnp.float32)

    def fold(stats):
      new_stats = {}
      for path, old in stats.items():
        new_stats[path] = _keep_if_not_finite(statistics.update(old, rows[path]), old)
      return new_stats

    count = state.count
    if _is_concrete(statistics_every) and statistics_every == 1:
      new_stats = fold(state.statistics)
    else:
      new_stats = jax.lax.cond(count % statistics_every == 0, fold, lambda s: s, state.statistics)

    def do_refresh(operand):
      stats, key, old_factors = operand
      factors, key = refresh(stats, key, kernel_specs)
      # never replace a good factor by a non-finite one
      return {p: _keep_if_not_finite(f, old_factors[p]) for p, f in factors.items()}, key

    def keep(operand):
      _, key, old_factors = operand
      return dict(old_factors), key

    factors, key = jax.lax.cond(
        count % update_every == 0, do_refresh, keep, (new_stats, state.key, state.factors))

    def condition(path, g):
      p = path_to_str(path)
      if p in factors and g is not None:
        return sketch.precondition_kernel(factors[p], g)
      return g

    new_updates = jax.tree_util.tree_map_with_path(condition, updates)
    new_state = ScaleBySketchedConditioningState(
        count=optax.safe_increment(count), key=key, statistics=new_stats, factors=factors)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
