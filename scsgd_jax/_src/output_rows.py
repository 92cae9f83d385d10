"""The output side's layouts and rows, which the eigenbasis' two sides and the experimental output conditioning
(:mod:`scsgd_jax.contrib`) read: each kernel read along its output axes, and the captured output gradients' rows."""

from __future__ import annotations

from typing import Mapping, Optional

import jax

from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import patches

__all__ = ["check_output_grads", "default_output_axes", "output_axes_from", "output_kernel_filter",
           "output_kernel_filter_from", "sample_rows"]


def output_kernel_filter(path: str, leaf) -> bool:
  """The kernels :func:`scale_by_output_conditioning` conditions by default: :func:`default_kernel_filter`'s
  but embeddings (whose output side is the model's width, conditioned by the layers that read it)."""
  return layout_lib.default_kernel_filter(path, leaf) and not layout_lib.is_embedding(path)


def default_output_axes(path: str, leaf) -> tuple[int, ...]:
  """A kernel's output axes: those :func:`default_input_axes` leaves (Dense ``(n, p)``: ``(1,)``)."""
  inputs = layout_lib.default_input_axes(path, leaf)
  return tuple(a for a in range(leaf.ndim) if a not in inputs)


def output_axes_from(input_axes: layout_lib.InputAxes) -> layout_lib.InputAxes:
  """The output side's layouts from the input side's ``input_axes``: each kernel read along the axes of one slice
  its input axes leave (its stack kept), so that a layout given for the input side (an
  Einsum's, a stack's) plans the output side at ``init`` too (a grouped conv's output side is the whole layer's, as
  the capture reads it); ``None`` when ``input_axes`` is ``None``. A kernel the input side leaves :class:`Plain`
  is left out by :func:`output_kernel_filter_from`."""
  if input_axes is None:
    return None

  def axes(path: str, leaf) -> layout_lib.Layout:
    layout = layout_lib.layout_of(path, leaf, input_axes) if callable(input_axes) or path in input_axes else None
    if layout is None:
      return layout_lib.Layout(default_output_axes(path, leaf))
    rest = tuple(a for a in range(leaf.ndim - layout.stack) if a not in layout.input_axes)
    # the output rows are the whole layer's, as captured, and each kernel's own (two kernels of one input differ here)
    return layout._replace(input_axes=rest, groups=1, reads=None)

  return axes


def output_kernel_filter_from(kernel_filter, input_axes: layout_lib.InputAxes):
  """``kernel_filter`` (default :func:`output_kernel_filter`) less the kernels ``input_axes`` leaves plain."""
  base = kernel_filter or output_kernel_filter
  if not isinstance(input_axes, Mapping):
    return base
  return lambda path, leaf: base(path, leaf) and layout_lib.plain_why(input_axes, path) is None


def check_output_grads(output_grads, who: str, otherwise: str = "") -> None:
  """Raises ``ValueError`` naming ``who`` when its update got no ``output_grads`` (``otherwise``: an alternative)."""
  if output_grads is None:
    raise ValueError(
        f"{who}.update needs the keyword argument `output_grads`: the loss's gradient with respect to the output "
        "perturbations (scsgd_jax.contrib.output_perturbations_nnx / _linen passed to the capture), e.g. "
        f"tx.update(grads, state, params, layer_inputs=layer_inputs, output_grads=output_grads){otherwise}.")


def sample_rows(output_grads, key: jax.Array, max_rows: Optional[int]):
  """Each kernel's captured output-gradient rows as ``(rows, p)``, at most ``max_rows`` of them sampled uniformly
  (stream ``i`` of ``key`` for the ``i``-th leaf)."""
  leaves, treedef = jax.tree_util.tree_flatten(output_grads)
  sampled = [patches.sample_rows(r.reshape(-1, r.shape[-1]), max_rows, patches.stream_key(key, i))
             if getattr(r, "ndim", 0) >= 2 else r  # anything else: the inner transformation names the culprit
             for i, r in enumerate(leaves)]
  return jax.tree_util.tree_unflatten(treedef, sampled)
