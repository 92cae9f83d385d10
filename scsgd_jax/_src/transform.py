r"""The optax transformation: each kernel's gradient conditioned by the factor its input statistics give.

The per-kernel plan (which statistics, which rank) is decided in :mod:`plan`; the statistics, their fold and the
refreshes are the estimator's (:mod:`estimator`); this module conditions the gradients by its factors.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import estimator as estimator_lib
from scsgd_jax._src import options
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import sketch
from scsgd_jax._src.estimator import Settings
from scsgd_jax._src.estimator import settings
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = [
    "STATIC_ARGS",
    "ScaleBySketchedConditioningState",
    "scale_by_sketched_conditioning",
]

#: Arguments that decide shapes; under ``optax.inject_hyperparams`` list them in ``static_args`` (the options'
#: integers are fields of objects, which it leaves alone).
STATIC_ARGS = ("rank",)


@options.refuses_moved_keywords
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
  return conditioning(settings(
      rank=rank, statistics=statistics, refresh=refresh, conditioner=conditioner, kernel_filter=kernel_filter,
      input_axes=input_axes, axis_name=axis_name, seed=seed))


def conditioning(s: Settings,
                 *,
                 default_axes=layout_lib.default_input_axes,
                 budget_share: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """:func:`scale_by_sketched_conditioning` from its settings ``s``, reading a kernel along ``default_axes`` unless
  told otherwise (the output side passes the kernel's output axes), its statistics within ``budget_share`` of the
  memory rule's budget (the two sides of :func:`scsgd_jax.contrib.scsgd_two_sided` splitting it)."""
  tx, _ = conditioning_and_plans(s, default_axes=default_axes, budget_share=budget_share)
  return tx


def conditioning_and_plans(s: Settings,
                           *,
                           default_axes=layout_lib.default_input_axes,
                           budget_share: float = 1.0,
                           extra=None):
  """:func:`conditioning` and its plans: ``plans(tree, captured_axes=None) -> {path: KernelPlan}``, the plans its
  ``init`` and ``update`` use for a tree of that structure (cached), for a transformation built on it;
  ``extra``: what that transformation keeps per kernel beside the statistics, for the memory rule
  (:class:`~scsgd_jax._src.plan.Spec`'s)."""
  est = estimator_lib.Estimator(s, default_axes=default_axes, budget_share=budget_share, extra=extra)

  def update_fn(updates, state, params=None, *, layer_inputs=None, **extra_args):
    del params, extra_args
    state, kernel_plans = est.update(updates, state, layer_inputs)
    return _condition(updates, kernel_plans, state.factors), state

  return optax.GradientTransformationExtraArgs(est.init, update_fn), est.plans


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

