"""Folding one step's captured rows into each kernel's statistics, guarded: the rows checked against the plans
(:func:`checked_rows`), outlier rows clipped, a non-finite result dropped, the replicas' folds averaged under
``pmap``/``shard_map``."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import plan as plan_lib


def all_finite(tree) -> jax.Array:
  """Whether every leaf of ``tree`` is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def keep_if_finite(new, old):
  """``new`` if every leaf is finite, else ``old`` (a non-finite batch must not poison the state)."""
  ok = all_finite(new)
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


def fold(kernel_plans, rows, stats: banks_lib.Banked, clipped: banks_lib.Banked, outlier_threshold, axis_name=None):
  """Each kernel's rows folded into its statistics (guarded; a non-finite result keeps the old ones), a bank at a
  time: the members of a bank (:mod:`banks`) whose rows have one shape per slice fold as one computation over
  their slices stacked (a stacked or grouped kernel's slices each fold their own rows), and add the rows they
  clipped to their counts (``clipped``, one place per kernel in the statistics' banks). Kernels without a plan
  here (left unconditioned in this update) or without rows keep their statistics.

  With ``axis_name`` (``pmap``/``shard_map``) the folded statistics are averaged over that axis: the
  statistics are an EMA, affine in the batch's moments, so the mean of the replicas' folds is the fold of
  the mean moments, i.e. of the gathered rows (equal shards); every replica then holds the same state.
  """
  new_banks, new_clipped = list(stats.banks), list(clipped.banks)
  for i, bank in enumerate(stats.index.banks):
    groups: dict[tuple, list[int]] = {}  # members with rows, by the shape of one slice's rows
    for j, path in enumerate(bank.paths):
      x = rows.get(path)
      if path in kernel_plans and x is not None and x.size:
        groups.setdefault(((x.shape if bank.lone[j] else x.shape[1:]), x.dtype), []).append(j)
    for members in groups.values():
      new_banks[i], counts = _fold_members(kernel_plans[bank.paths[members[0]]], bank, members, new_banks[i], rows,
                                           outlier_threshold, axis_name)
      new_clipped[i] = (new_clipped[i] + counts if len(members) == len(bank.paths)
                        else new_clipped[i].at[np.asarray(members)].add(counts))
  return banks_lib.Banked(stats.index, new_banks), banks_lib.Banked(clipped.index, new_clipped)


def _fold_members(plan, bank: banks_lib.Bank, members: list[int], stats, rows, outlier_threshold, axis_name):
  """The bank's statistics ``stats`` with ``members`` (indices into the bank) folded; and each one's clip count
  (summed over its slices)."""
  every = len(members) == len(bank.paths)
  starts = bank.starts()
  places = np.concatenate([np.arange(starts[j], starts[j] + bank.sizes[j]) for j in members]) if not every else None
  old = stats if every else jax.tree.map(lambda a: a[places], stats)
  folded, n_clipped = fold_bank(plan, old, banks_lib.stacked([rows[bank.paths[j]] for j in members],
                                                             [bank.lone[j] for j in members]), outlier_threshold)
  if axis_name is not None:
    folded, n_clipped = jax.lax.pmean(folded, axis_name), jax.lax.psum(n_clipped, axis_name)
  kept = jax.vmap(keep_if_finite)(folded, old)
  new = kept if every else jax.tree.map(lambda a, u: a.at[places].set(u), stats, kept)
  sizes = [bank.sizes[j] for j in members]
  if any(size > 1 for size in sizes):  # a stack's slices: one count for the kernel
    n_clipped = jnp.zeros(len(members), n_clipped.dtype).at[np.repeat(np.arange(len(members)), sizes)].add(n_clipped)
  return new, n_clipped


def _flat_inputs(layer_inputs) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(layer_inputs)
  return {layout_lib.path_to_str(p): leaf for p, leaf in flat}


def checked_rows(kernel_plans: dict[str, plan_lib.KernelPlan], layer_inputs) -> dict[str, jax.Array]:
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
          "default, or of a stacked (scanned) kernel, need scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(model)) (or "
          "input_axes_linen).")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"layer_inputs['{path}'] must be floating point, got dtype {x.dtype}.")
    rows[path] = jax.lax.stop_gradient(x).reshape(rows_shape + (n,)).astype(jnp.float32)
  return rows
