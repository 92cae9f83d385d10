r"""The optax transformation: each kernel's gradient conditioned by the factor its input statistics give.

The per-kernel plan (which statistics, which rank) is decided in :mod:`plan`; the statistics, their fold and the
refreshes are the estimator's (:mod:`estimator`); this module conditions the gradients by its factors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import estimator as estimator_lib
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import sketch
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.conditioning import checked
from scsgd_jax._src.conditioning import refuses_moved_keywords
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = ["ScaleBySketchedConditioningState", "scale_by_sketched_conditioning"]


@refuses_moved_keywords
def scale_by_sketched_conditioning(conditioning: Conditioning = Conditioning(),
                                   *,
                                   memory_share: float = 1.0) -> optax.GradientTransformationExtraArgs:
  r"""Conditions each kernel gradient on its input side (Gonen & Shalev-Shwartz, Section 3).

  A kernel ``W`` read as the matrix ``(n, p)`` over its input axes, with inputs ``x``, gets
  ``A^{-1} G`` for its gradient ``G`` (the paper's :math:`\delta (A^{-1} x)^\top`), with
  :math:`A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - QQ^\top)` rebuilt every ``Refresh.every`` steps
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
    conditioning: the settings, a :class:`Conditioning` (rank, statistics, refresh, conditioner, kernel filter,
      input axes, data-parallel axis name, seed).
    memory_share: the share of the memory rule's budget its statistics take (``Statistics(kind='auto')``; two
      transformations splitting it, as :func:`scsgd_jax.contrib.scsgd_two_sided`'s two sides, take half each).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, arXiv:1506.02649, 2015.
    Tropp, Yurtsever, Udell & Cevher, Fixed-rank approximation of a positive-semidefinite
    matrix from streaming data, NeurIPS 2017.
  """
  c = checked(conditioning, "scale_by_sketched_conditioning")
  return conditioning_transform(estimator_lib.Estimator(c, memory_share=memory_share))


def conditioning_transform(est: estimator_lib.Estimator) -> optax.GradientTransformationExtraArgs:
  """The transformation that conditions each kernel of estimator ``est``'s plans by its factors (the input side's,
  or the output side's reading the kernels along their output axes)."""

  def update_fn(updates, state, params=None, *, layer_inputs=None, **extra_args):
    del params, extra_args
    state, kernel_plans, _ = est.update(updates, state, layer_inputs)
    return _condition(updates, kernel_plans, state.factors), state

  return optax.GradientTransformationExtraArgs(est.init, update_fn)


def _condition(updates, kernel_plans, factors):
  """``A^{-1} G`` for every conditioned kernel; other leaves pass through.

  The kernels of one bank whose slices read as matrices of one shape (and dtype) are conditioned as one batched
  product over their slices stacked, each by its own slice of the bank's factors (a kernel that reads another's
  statistics by that kernel's), so the program holds one product per bank and shape, not one per kernel.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
  out = [g for _, g in flat]
  groups: dict[tuple, list] = {}
  for i, (path, g) in enumerate(flat):
    p = layout_lib.path_to_str(path)
    if p not in kernel_plans or g is None:
      continue
    mats, restore = _slice_matrices(kernel_plans[p], g)
    bank, start, size, _ = factors.index.place(p)
    groups.setdefault((bank, mats.shape[1:], mats.dtype), []).append((i, mats, restore, np.arange(start, start + size)))
  for (bank, _, dtype), members in groups.items():
    rows = np.concatenate([m[3] for m in members])
    factor = sketch.Factor(*(None if a is None else _rows(a, rows).astype(dtype) for a in factors.banks[bank]))
    conditioned = jax.vmap(sketch.apply_inverse)(factor, banks_lib.stacked([m[1] for m in members],
                                                                           [False] * len(members)))
    parts = banks_lib.unstacked(conditioned, [len(m[3]) for m in members], [False] * len(members))
    for (i, _, restore, _), part in zip(members, parts):
      out[i] = restore(part).astype(out[i].dtype)
  return jax.tree_util.tree_unflatten(treedef, out)


def _slice_matrices(plan, g):
  """A kernel gradient as its slices' matrices ``(slices, n, p)`` in ``float32`` (or wider), and the function that
  puts such an array back in the gradient's layout (a kernel of one slice: one)."""
  dtype = jnp.promote_types(g.dtype, jnp.float32)
  x = g[None] if plan.slices is None else plan.to_slices(g)
  # the slice axis leads the matrix' rows: (slices * n, p), read as (slices, n, p)
  matrix, restore = sketch.kernel_matrix(x, (0,) + tuple(a % (x.ndim - 1) + 1 for a in plan.input_axes))
  mats = matrix.reshape(x.shape[0], -1, matrix.shape[-1]).astype(dtype)

  def back(m):
    y = restore(m.reshape(matrix.shape))
    return y[0] if plan.slices is None else plan.from_slices(y, g.shape)

  return mats, back


def _rows(a, rows: np.ndarray):
  """The rows ``rows`` (static) of a bank's stacked leaf: the leaf itself, a slice, or a gather."""
  if np.array_equal(rows, np.arange(a.shape[0])):
    return a
  if np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
    return banks_lib.member(a, int(rows[0]), len(rows), False)
  return jnp.take(a, jnp.asarray(rows), axis=0)

