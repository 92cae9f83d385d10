"""Folding one step's captured rows into each kernel's statistics, guarded: outlier rows clipped,
a non-finite result dropped, the replicas' folds averaged under ``pmap``/``shard_map``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scsgd_jax._src import banks as banks_lib


def keep_if_finite(new, old):
  """``new`` if every leaf is finite, else ``old`` (a non-finite batch must not poison the state)."""
  ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(new)]))
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _row_norms(rows: jax.Array) -> jax.Array:
  """Each row's norm (over the last axis), taken with a per-row rescale (rows of 1e18 do not overflow, rows of
  1e-18 keep their precision)."""
  scale = jnp.max(jnp.abs(rows), axis=-1)
  safe = jnp.where(scale > 0, scale, 1.0)
  norms = safe * jnp.sqrt(jnp.sum(jnp.square(rows / safe[..., None]), axis=-1))
  return jnp.where(scale > 0, norms, 0.0)


def guard_rows(rows: jax.Array, reference: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
  """Clips rows whose squared norm exceeds ``threshold * reference`` back to that bound; returns the count.

  ``rows`` ``(..., m, n)``: one kernel's ``(m, n)``, or a bank's members stacked, each with its own ``reference``
  ``(...)``: the running ``tr C`` (the expected squared row norm); before any data the batch's median squared
  norm (its mean if the median is 0). A row's norm is the root of float32's sum of squares where that is a normal
  number, else taken again with a per-row rescale, so rows of 1e18 do not overflow and rows of 1e-18 keep their
  precision. Everything here is ``O(m n)`` elementwise work beside the fold's ``O(m n k)``, so it runs as selects,
  not as ``cond``s over the rows (which would copy them, and compile to a program per branch).
  """
  sq = jnp.sum(jnp.square(rows), axis=-1)
  info = jnp.finfo(sq.dtype)
  plain = (sq < info.max) & ((sq >= info.tiny / info.eps) | (sq == 0))
  norms = jnp.where(plain, jnp.sqrt(jnp.where(plain, sq, 1.0)), _row_norms(rows))
  # the running reference typed as the rows are (under shard_map the state is replicated, the rows are not)
  running = reference.astype(norms.dtype) + jnp.zeros_like(norms[..., 0])

  def with_batch_reference(norms):  # some member before any data: its batch's median squared norm (or mean)
    sq = jnp.sort(jnp.square(norms), axis=-1)  # the median of a sort: jnp.median compiles to ~4x the program
    m = sq.shape[-1]
    median = 0.5 * (sq[..., (m - 1) // 2] + sq[..., m // 2])
    return jnp.where(reference > 0, running, jnp.where(median > 0, median, jnp.mean(sq, axis=-1)))

  ref = jax.lax.cond(jnp.all(reference > 0), lambda norms: running, with_batch_reference, norms)
  bound = (jnp.sqrt(threshold) * jnp.sqrt(ref))[..., None]  # not sqrt(threshold * ref): overflows at ref ~ 3e36
  over = norms > bound
  factor = jnp.where(over, bound / jnp.where(over, norms, 1.0), 1.0)  # 1 (exactly: x * 1 = x) for every other row
  return rows * factor[..., None], jnp.sum(over, axis=-1).astype(jnp.int32)


def fold_bank(plan, stats, rows, outlier_threshold):
  """One bank's rows ``(members, m, n)`` (or ids) folded into its members' statistics stacked, guarded
  (:func:`guard_rows`; ids are not); returns the new statistics and each member's number of rows clipped."""
  n_clipped = jnp.zeros(rows.shape[:1], jnp.int32)
  if not plan.statistics.takes_ids:
    rows, n_clipped = guard_rows(rows, jax.vmap(plan.statistics.trace)(stats), outlier_threshold)
  return jax.vmap(plan.statistics.update)(stats, rows), n_clipped


def fold(kernel_plans, rows, stats, clipped, outlier_threshold, axis_name=None):
  """Each kernel's rows folded into its statistics (guarded; a non-finite result keeps the old ones), a bank at a
  time: the kernels alike (:func:`banks.grouped`) whose rows have one shape per slice fold as one computation over
  their slices stacked (a stacked or grouped kernel's slices each fold their own rows).

  With ``axis_name`` (``pmap``/``shard_map``) the folded statistics are averaged over that axis: the
  statistics are an EMA, affine in the batch's moments, so the mean of the replicas' folds is the fold of
  the mean moments, i.e. of the gathered rows (equal shards); every replica then holds the same state.
  """
  new_stats, new_clipped = dict(stats), dict(clipped)  # kernels without a plan here keep theirs
  # no rows this step (an empty micro-batch, a fully masked layer): nothing to fold
  planned = {path: plan for path, plan in kernel_plans.items() if rows[path].size}

  def per_slice(path):
    x = rows[path]
    return (x.shape if planned[path].slices is None else x.shape[1:]), x.dtype

  for paths in banks_lib.grouped(planned, per_slice):
    lone, sizes = banks_lib.layout(planned, paths)
    old = banks_lib.stacked([stats[p] for p in paths], lone)
    folded, n_clipped = fold_bank(planned[paths[0]], old, banks_lib.stacked([rows[p] for p in paths], lone),
                                  outlier_threshold)
    if axis_name is not None:
      folded, n_clipped = jax.lax.pmean(folded, axis_name), jax.lax.psum(n_clipped, axis_name)
    kept = banks_lib.unstacked(jax.vmap(keep_if_finite)(folded, old), sizes, lone)
    counts = banks_lib.unstacked(n_clipped, sizes, [False] * len(paths))
    for path, new, c in zip(paths, kept, counts):
      new_stats[path] = new
      new_clipped[path] = clipped[path] + jnp.sum(c)
  return new_stats, new_clipped
