"""Folding one step's captured rows into each kernel's statistics, guarded: outlier rows clipped,
a non-finite result dropped, the replicas' folds averaged under ``pmap``/``shard_map``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def keep_if_finite(new, old):
  """``new`` if every leaf is finite, else ``old`` (a non-finite batch must not poison the state)."""
  ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(new)]))
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _row_norms(rows: jax.Array) -> jax.Array:
  """Each row's norm, taken with a per-row rescale (rows of 1e18 do not overflow, rows of 1e-18 keep their
  precision)."""
  scale = jnp.max(jnp.abs(rows), axis=1)
  safe = jnp.where(scale > 0, scale, 1.0)
  norms = safe * jnp.sqrt(jnp.sum(jnp.square(rows / safe[:, None]), axis=1))
  return jnp.where(scale > 0, norms, 0.0)


def guard_rows(rows: jax.Array, reference: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
  """Clips rows whose squared norm exceeds ``threshold * reference`` back to that bound; returns the count.

  ``reference`` is the running ``tr C`` (the expected squared row norm); before any
  data it is the batch's median squared norm (its mean if the median is 0). Norms are float32's sums of
  squares where those are normal numbers, else taken again with a per-row rescale, so rows of 1e18 do not
  overflow and rows of 1e-18 keep their precision.
  """
  sq = jnp.sum(jnp.square(rows), axis=1)
  info = jnp.finfo(sq.dtype)
  plain = jnp.all((sq < info.max) & ((sq >= info.tiny / info.eps) | jnp.all(rows == 0, axis=1, keepdims=False)))
  norms = jax.lax.cond(plain, jnp.sqrt, lambda sq: _row_norms(rows), sq)

  def batch_reference(norms):  # before any data: the batch's median squared norm (its mean if that is 0)
    sq = jnp.square(norms)
    median = jnp.median(sq)
    return jnp.where(median > 0, median, jnp.mean(sq))

  # the running reference typed as the rows are (under shard_map the state is replicated, the rows are not)
  running = lambda norms: reference.astype(norms.dtype) + jnp.zeros_like(norms[0])
  ref = jax.lax.cond(reference > 0, running, batch_reference, norms)
  bound = jnp.sqrt(threshold) * jnp.sqrt(ref)  # not sqrt(threshold * ref): that overflows at ref ~ 3e36
  over = norms > bound
  factor = jnp.where(over, bound / jnp.where(over, norms, 1.0), 1.0)
  count = jnp.sum(over).astype(jnp.int32)
  # a batch with no row over the bound (the common case) is passed on as it is, not multiplied by ones
  return jax.lax.cond(count > 0, lambda rows: rows * factor[:, None], lambda rows: rows, rows), count


def fold_kernel(plan, state, x, outlier_threshold):
  """One kernel's (or slice's) rows ``x`` folded into its statistics ``state``, guarded (:func:`guard_rows`;
  ids are not); returns the new statistics and the number of rows clipped."""
  n_clipped = jnp.zeros([], jnp.int32)
  if not plan.statistics.takes_ids:
    x, n_clipped = guard_rows(x, plan.statistics.trace(state), outlier_threshold)
  return plan.statistics.update(state, x), n_clipped


def fold(kernel_plans, rows, stats, clipped, outlier_threshold, axis_name=None):
  """Each kernel's rows folded into its statistics (guarded; a non-finite result keeps the old ones); a stacked
  or grouped kernel's slices each fold their own rows, as one ``vmap``.

  With ``axis_name`` (``pmap``/``shard_map``) the folded statistics are averaged over that axis: the
  statistics are an EMA, affine in the batch's moments, so the mean of the replicas' folds is the fold of
  the mean moments, i.e. of the gathered rows (equal shards); every replica then holds the same state.
  """
  new_stats, new_clipped = dict(stats), dict(clipped)  # kernels without a plan here keep theirs
  for path, plan in kernel_plans.items():
    x = rows[path]
    if x.size == 0:  # no rows this step (an empty micro-batch, a fully masked layer): nothing to fold
      continue

    one = functools.partial(fold_kernel, plan, outlier_threshold=outlier_threshold)
    if plan.slices is None:
      folded, n_clipped = one(stats[path], x)
    else:
      folded, n_clipped = jax.vmap(one)(stats[path], x)
      n_clipped = jnp.sum(n_clipped)
    if axis_name is not None:
      folded, n_clipped = jax.lax.pmean(folded, axis_name), jax.lax.psum(n_clipped, axis_name)
    keep = keep_if_finite if plan.slices is None else jax.vmap(keep_if_finite)
    new_stats[path] = keep(folded, stats[path])
    new_clipped[path] = clipped[path] + n_clipped
  return new_stats, new_clipped
