"""What a capture returns and the bookkeeping the NNX and Linen captures share: the rows of each
conditioned kernel (:class:`CapturedInputs`), the row-sampling keys, and the output perturbations
of output-side conditioning."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import patches
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src.layers import LayerSpec
from scsgd_jax._src.layers import own_ndim

from scsgd_jax._src.inputs import CapturedInputs  # noqa: F401  (what a capture returns)

# why a tied token table (an Embed whose attend gives the logits) gets plain updates
TIED = ("a tied table: also the output projection (attend), whose gradient the token counts' conditioning does "
        "not describe")



def check_max_rows(max_rows) -> None:
  if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
    raise ValueError(
        f"max_rows must be a positive int (rows kept per layer call) or None (all rows), got {max_rows!r}; "
        "with no rows the statistics never change and training is plain SGD.")


class Counter:
  def __init__(self, rng):
    self.rng = rng
    self.i = itertools.count()

  def key(self):
    """The next layer's sampling key: its own Philox stream of the capture's ``rng``."""
    return None if self.rng is None else patches.stream_key(self.rng, next(self.i))


def merge(rows_tuple):
  """A layer's rows of several calls as one array: rows ``(..., m, n)`` joined along ``m``, ids ``(..., m)``
  along the last axis (the leading axes of a stack stay)."""
  rows = tuple(rows_tuple)
  if len(rows) == 1:
    return rows[0]
  return jnp.concatenate(rows, axis=-1 if jnp.issubdtype(rows[0].dtype, jnp.integer) else -2)


def layout(spec: LayerSpec, layer, full_ndim) -> layout_lib.Layout:
  """The :class:`~scsgd_jax._src.plan.Layout` of ``layer``'s kernel whose parameter has ``full_ndim`` axes
  (``None``: unknown): the axes beyond those the layer declares (:func:`own_ndim`) are a stack of layers."""
  stack = max(full_ndim - own_ndim(layer), 0) if full_ndim is not None else 0
  return layout_lib.Layout(spec.input_axes, stack, spec.groups)


class Reads:
  """Which kernels' layers read the same rows in one traced call of a model: per kernel, each call's input array
  and the axes its rows are made of (:class:`LayerSpec`'s ``contracts``)."""

  def __init__(self):
    self.calls: dict[str, list] = {}

  def __call__(self, path: str, spec: LayerSpec, x) -> None:
    contracts = None if spec.contracts is None else tuple(a % x.ndim for a in spec.contracts)
    self.calls.setdefault(path, []).append((x, contracts))

  def marked(self, layouts: dict) -> dict:
    """``layouts`` (``{param path: Layout or Plain}``) with each kernel whose layer read, call for call, the rows an
    earlier kernel's read (the same arrays, the same axes; one layout) marked ``Layout(reads=<that kernel>)``."""
    out, owners = dict(layouts), []
    same = lambda a, b: len(a) == len(b) and all(x is y and c == d for (x, c), (y, d) in zip(a, b))
    for path, calls in self.calls.items():
      layout = layouts.get(path)
      if not isinstance(layout, layout_lib.Layout) or any(c is None for _, c in calls):
        continue
      owner = next((o for o, o_calls in owners if same(o_calls, calls) and layouts[o] == layout), None)
      if owner is None:
        owners.append((path, calls))
      else:
        out[path] = layout._replace(reads=owner)
    return out


def param_path(name: str, param: str) -> str:
  """The path of a layer's parameter ``param`` (``'kernel'``, ``'embedding'``), as the transformation names it."""
  return f"{name}/{param}" if name else param


class Outputs:
  """What a capture does to each conditioned layer's output ``y``: with ``perturbations`` (``{kernel path:
  (rows, p)}``), adds them, the kernel's output axes of ``y`` moved last and flattened in the kernel's order
  (so their gradient is the rows of the back-propagated ``delta``); without, records their shapes and the
  kernel's output axes (:func:`output_perturbations_nnx`)."""

  def __init__(self, perturbations=None):
    self.perturbations = None if perturbations is None else flat(perturbations)
    self.shapes, self.axes, self.unconditioned = {}, {}, {}

  def __call__(self, path: str, spec: LayerSpec, y, layout: layout_lib.Layout):
    if spec.output_axes is None or spec.input_axes is None:
      return y
    if layout.stack or layout.groups > 1:
      self.unconditioned[path] = ("the output side does not condition a stacked (scanned, vmapped) or grouped "
                                  "kernel; its input side does")
      return y
    out_axes = spec.output_axes(y.ndim)
    rest = tuple(a for a in range(y.ndim) if a not in out_axes)
    perm = rest + out_axes
    moved_shape = tuple(y.shape[a] for a in perm)
    p = math.prod(y.shape[a] for a in out_axes)
    shape = (math.prod(moved_shape) // max(p, 1), p)
    if self.perturbations is None:
      if path in self.shapes:
        raise NotImplementedError(
            f"layer of kernel '{path}' is called more than once in one forward pass; output-side conditioning "
            "needs one call per layer. Exclude the kernel with kernel_filter or optax.masked.")
      self.shapes[path] = jax.ShapeDtypeStruct(shape, y.dtype)
      ndim = len(spec.input_axes) + len(out_axes)
      self.axes[path] = tuple(a for a in range(ndim) if a not in spec.input_axes)
      return y
    if path not in self.perturbations:
      return y
    delta = self.perturbations[path]
    if tuple(delta.shape) != shape:
      raise ValueError(
          f"output_perturbations['{path}'] has shape {tuple(delta.shape)}, expected {shape} (the layer's output "
          f"{tuple(y.shape)} as rows of its kernel's output axes): make them with output_perturbations_nnx / "
          "output_perturbations_linen on a batch of this shape.")
    moved = jnp.transpose(y, perm) + delta.reshape(moved_shape).astype(y.dtype)
    return jnp.transpose(moved, tuple(int(i) for i in np.argsort(perm)))

  def zeros(self) -> "CapturedInputs":
    return CapturedInputs({p: jnp.zeros(s.shape, s.dtype) for p, s in self.shapes.items()}, self.axes,
                          self.unconditioned)


def flat(tree) -> dict:
  """``{'layer/kernel': leaf}``, named as the transformation names kernels (:func:`plan.path_to_str`)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {layout_lib.path_to_str(p): v for p, v in flat}
