"""What each Flax layer's kernel needs from its input: one :class:`LayerSpec` per layer type.

What a layer sows is what its kernel's statistics need, stored under the layer's path with the
parameter's name (``kernel``, or ``embedding``), so that the captured rows mirror the parameter tree:

- Dense/Linear ``(n, p)``: input rows ``(m, n)``.
- Conv ``(*window, cin, cout)``: im2col rows of sampled output positions, ``(m, prod(window) * cin)``.
- DenseGeneral/LinearGeneral (and so every attention projection): the contracted
  input axes moved last and flattened, in the kernel's input-axis order.
- Einsum: the input's contracted labels, in the order the kernel holds them.
- Embed: the integer ids (its input is one-hot, so the statistic is their histogram).

:func:`layer_spec` is the one place that knows each layer type; the NNX and Linen captures
(``capture_nnx.py``, ``capture_linen.py``) only intercept the calls.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.recurrent import DenseParams
from flax import nnx

from scsgd_jax._src import patches

__all__ = ["LayerSpec", "layer_rows", "layer_spec"]

NNX_LAYERS = (nnx.Linear, nnx.Conv, nnx.ConvTranspose, nnx.LinearGeneral, nnx.Einsum, nnx.Embed)
# DenseParams: the gate kernels of Linen's OptimizedLSTMCell, each read as a Dense (the cell multiplies by them itself)
LINEN_LAYERS = (nn.Dense, DenseParams, nn.Conv, nn.ConvTranspose, nn.DenseGeneral, nn.Einsum, nn.Embed)


class LayerSpec(NamedTuple):
  """What one layer's kernel needs from its input.

  Attributes:
    param: the parameter's name (``'kernel'`` or ``'embedding'``).
    input_axes: the kernel axes contracted with the input (``None`` when the
      equation is only known at call time).
    rows: ``rows(x, max_rows, key) -> (m, n)`` rows (or the ids of an embedding).
  """

  param: str
  input_axes: Optional[tuple[int, ...]]
  rows: Callable[[jax.Array, Optional[int], Optional[jax.Array]], jax.Array]
  output_axes: Optional[Callable[[int], tuple[int, ...]]] = None
  """``output_axes(y.ndim)``: the axes of the layer's output ``y`` that the kernel's output axes make, in the
  kernel's order (``None``: no output side, e.g. an embedding)."""
  groups: int = 1
  """Feature groups (a grouped convolution): ``rows`` then returns ``(groups, m, n)``, group ``i``'s rows."""
  contracts: Optional[tuple[int, ...]] = None
  """The input's axes whose values make one row, in order, where the rows are just those (Dense, DenseGeneral):
  two such layers called on one array with these axes equal read the same rows (``None``: not compared)."""


def _to_tuple(v, d):
  if v is None:
    return (1,) * d
  return (v,) * d if isinstance(v, int) else tuple(v)


def _as_tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _conv_spec(layer, name) -> LayerSpec:
  window = tuple(layer.kernel_size) if not isinstance(layer.kernel_size, int) else (layer.kernel_size,)
  d = len(window)
  groups = getattr(layer, "feature_group_count", 1)
  if any(v != 1 for v in _to_tuple(getattr(layer, "input_dilation", 1), d)):
    raise NotImplementedError(f"layer '{name}': input_dilation is not supported by the conv statistics.")

  def rows(x, max_rows, key):
    try:
      out = patches.conv_patch_rows(
          x, window, strides=_to_tuple(layer.strides, d), padding=layer.padding,
          dilation=_to_tuple(layer.kernel_dilation, d), max_rows=max_rows, key=key)
    except (ValueError, NotImplementedError) as e:
      raise type(e)(f"layer '{name}': {e}") from None
    if groups == 1:
      return out
    # a grouped conv: group i's output channels read input channels block i only, so each group is its own
    # (window * cin / groups, cout / groups) problem (block-diagonal C): (m, window, cin) -> (groups, m, n)
    m, cin = out.shape[0], x.shape[-1]
    return jnp.moveaxis(out.reshape(m, -1, groups, cin // groups), 2, 0).reshape(groups, m, -1)

  return LayerSpec("kernel", tuple(range(d + 1)), rows, _last_axes(1), groups)


def _last_axes(count: int) -> Callable[[int], tuple[int, ...]]:
  return lambda ndim: tuple(range(ndim - count, ndim))


def _contracted_rows(x, axes, max_rows, key):
  """``x`` with ``axes`` (in this order) moved last and flattened into rows."""
  axes = tuple(a % x.ndim for a in axes)
  rest = tuple(a for a in range(x.ndim) if a not in axes)
  moved = jnp.transpose(x, rest + axes)
  return patches.sample_rows(moved.reshape(-1, math.prod(x.shape[a] for a in axes)), max_rows, key)


def _general_spec(layer, name, batch) -> LayerSpec:
  if batch:
    raise NotImplementedError(
        f"layer '{name}' has batch axes {tuple(batch)}: its kernel is one matrix per batch index, not "
        "one (n, p) matrix.")
  axis = _as_tuple(layer.axis)
  features = _as_tuple(layer.out_features if isinstance(layer, nnx.LinearGeneral) else layer.features)
  return LayerSpec("kernel", tuple(range(len(axis))), lambda x, m, k: _contracted_rows(x, axis, m, k),
                   _last_axes(len(features)), contracts=axis)


def _expand_ellipsis(labels: str, ndim: int) -> str:
  if "..." not in labels:
    return labels
  pre, post = labels.split("...")
  return pre + "#" * (ndim - len(pre) - len(post)) + post


def _parse_einsum(equation: str, name: str) -> tuple[tuple[int, ...], Callable, Callable]:
  """Kernel input axes, the input's rows and the output's kernel-output axes of ``'lhs,rhs->out'`` (rhs the
  kernel)."""
  eq = equation.replace(" ", "")
  try:
    ins, out = eq.split("->")
    lhs, rhs = ins.split(",")
  except ValueError:
    raise ValueError(f"layer '{name}': einsum equation {equation!r} is not of the form 'lhs,rhs->out'.") from None
  if "." in rhs:
    raise NotImplementedError(f"layer '{name}': an ellipsis in the kernel's subscripts ({equation!r}) is not supported.")
  shared = [c for c in rhs if c in lhs and c in out]
  if shared:
    raise NotImplementedError(
        f"layer '{name}': einsum {equation!r} shares labels {shared} between input, kernel and output, so "
        "its kernel is one matrix per such index.")
  contracted = [c for c in rhs if c in lhs]
  if not contracted:
    raise ValueError(f"layer '{name}': einsum {equation!r} contracts no input axis with the kernel.")
  kernel_axes = tuple(rhs.index(c) for c in contracted)

  def rows(x, max_rows, key):
    labels = _expand_ellipsis(lhs, x.ndim)
    return _contracted_rows(x, tuple(labels.index(c) for c in contracted), max_rows, key)

  def output_axes(ndim):
    labels = _expand_ellipsis(out, ndim)
    return tuple(labels.index(c) for c in rhs if c not in contracted)

  return kernel_axes, rows, output_axes


def _einsum_spec(layer, name, equation) -> LayerSpec:
  if equation is None:
    return LayerSpec("kernel", None, None)
  return LayerSpec("kernel", *_parse_einsum(equation, name))


def _embed_rows(x, max_rows, key):
  del max_rows, key  # the histogram of all ids is O(m + vocab): no sampling needed
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"an Embed layer's input must be integer ids, got dtype {x.dtype}.")
  return x.reshape(-1)


def own_ndim(layer: Any) -> int:
  """The number of axes of one layer's kernel (or embedding) as the layer declares it: a parameter with more
  has leading stack axes (``nnx.scan``/``nnx.vmap``/``nn.scan``), each index its own layer."""
  if isinstance(layer, (nnx.Conv, nn.Conv, nnx.ConvTranspose, nn.ConvTranspose)):
    return (1 if isinstance(layer.kernel_size, int) else len(layer.kernel_size)) + 2
  if isinstance(layer, nnx.LinearGeneral):
    return len(_as_tuple(layer.in_features)) + len(_as_tuple(layer.out_features)) + len(dict(layer.batch_axis))
  if isinstance(layer, nn.DenseGeneral):
    return len(_as_tuple(layer.axis)) + len(_as_tuple(layer.features)) + len(_as_tuple(layer.batch_dims))
  if isinstance(layer, nnx.Einsum):
    return len(layer.kernel_shape)
  if isinstance(layer, nn.Einsum):
    return len(layer.shape)
  return 2  # Linear/Dense (n, p), Embed (vocab, features)


def layer_spec(layer: Any, name: str, einsum_str: Optional[str] = None) -> LayerSpec:
  """The :class:`LayerSpec` of an NNX or Linen layer (``einsum_str``: the equation of this Einsum call, if given).

  Raises ``NotImplementedError`` (naming the layer and why) for a layer whose kernel the conditioning cannot
  read as one ``(n, p)`` matrix over its inputs; the captures then leave that kernel unconditioned."""
  if isinstance(layer, (nnx.ConvTranspose, nn.ConvTranspose)):
    raise NotImplementedError(f"layer '{name}' is a transposed convolution (its inputs are dilated)")
  if isinstance(layer, (nnx.Conv, nn.Conv)):
    return _conv_spec(layer, name)
  if isinstance(layer, (nnx.Linear, nn.Dense, DenseParams)):
    return LayerSpec("kernel", (0,), lambda x, m, k: patches.dense_rows(x, m, k), _last_axes(1), contracts=(-1,))
  if isinstance(layer, nnx.LinearGeneral):
    return _general_spec(layer, name, dict(layer.batch_axis))
  if isinstance(layer, nn.DenseGeneral):
    return _general_spec(layer, name, _as_tuple(layer.batch_dims))
  if isinstance(layer, (nnx.Einsum, nn.Einsum)):
    return _einsum_spec(layer, name, einsum_str or layer.einsum_str)
  if isinstance(layer, (nnx.Embed, nn.Embed)):
    return LayerSpec("embedding", (0,), _embed_rows)
  raise TypeError(f"layer '{name}' of type {type(layer).__name__} is not one the capture knows.")


def layer_rows(
    layer: Any,
    x: jax.Array,
    *,
    name: str,
    max_rows: Optional[int],
    key: Optional[jax.Array],
    einsum_str: Optional[str] = None,
) -> jax.Array:
  """What ``layer``'s kernel statistics need from the layer input ``x``: rows ``(m, n)``, or an embedding's ids.

  ``layer`` is any of ``nnx.Linear``, ``nnx.Conv``, ``nnx.LinearGeneral``,
  ``nnx.Einsum``, ``nnx.Embed`` or their Linen twins; ``name`` names it in errors.
  """
  spec = layer_spec(layer, name, einsum_str)
  return spec.rows(jax.lax.stop_gradient(x), max_rows, key)
