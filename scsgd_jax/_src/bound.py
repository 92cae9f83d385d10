"""A bound on each layer's step relative to its weight: LARS's and LAMB's trust ratio as a clip, which acts only on
a step above it."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import checks

__all__ = ["clip_by_relative_norm"]


Slices = Callable[[Any], Any]  # params -> a tree of their structure: per leaf its stack axes, or None


def _norms(x: jax.Array, stack: int) -> jax.Array:
  """The Frobenius norm of each slice over the leading ``stack`` axes (shape: those axes, then ones)."""
  return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(stack, x.ndim)), keepdims=True))


def _floor(w: jax.Array, stack: int, floor_rms: Optional[float]) -> jax.Array:
  """The weight norm the bound assumes at least, per slice: ``floor_rms`` times ``sqrt(slice size)``, or (``None``)
  the norm of a lecun-normal init of the slice's shape, ``sqrt(shape[-1])`` (fan-in ``size / shape[-1]``: Flax's
  kernels put their outputs last)."""
  if floor_rms is None:
    return jnp.sqrt(jnp.float32(w.shape[-1]))
  return floor_rms * jnp.sqrt(jnp.float32(math.prod(w.shape[stack:])))


def _matrices(params) -> Any:
  return jax.tree.map(lambda w: 0 if jnp.ndim(w) >= 2 else None, params)


def clip_by_relative_norm(max_ratio: float, floor_rms: Optional[float] = None, *,
                          slices: Optional[Slices] = None) -> optax.GradientTransformation:
  r"""Each layer's step scaled, when its norm is above it, to
  :math:`\text{max\_ratio} \cdot \max(\|W\|, \text{floor})`, ``W`` the layer's weight: by default every update
  leaf of two or more axes (kernels, embedding tables), whole; vectors (biases, norms' scales) pass as they are.

  It goes last in a chain (its updates are the steps applied): a layer's step is then at most ``max_ratio`` of its
  weight, where a rate too high for that layer (a softmax head near the warmup's peak) would multiply it. A step
  within the bound passes bit for bit. The floor lets a small or zero-initialised layer move as a freshly
  initialised one would: by default the norm of a lecun-normal init of its shape, ``sqrt(shape[-1])`` (RMS
  ``1 / sqrt(fan_in)``); ``floor_rms`` sets the RMS instead. No state; ``update`` needs ``params``. A non-finite
  step passes as it is (the optimizer's own guards see it).

  Args:
    max_ratio: the largest step norm per unit of weight norm (> 0).
    floor_rms: the weight's RMS the bound assumes at least (``>= 0``); ``None``: the layer's init scale.
    slices: ``params -> tree`` of the params' structure holding, per leaf, how many of its leading axes index
      separate layers (a scan's or an ensemble's stack: each slice bounded by its own weight), or ``None`` for a
      leaf that passes unbounded. Default: every leaf of two or more axes, whole. ``scsgd`` passes its kernels'
      layouts.
  """
  checks.check_float("max_ratio", max_ratio, low=0.0, low_open=True)
  if floor_rms is not None:
    checks.check_float("floor_rms", floor_rms, low=0.0)
  stack_of = slices or _matrices

  def one(stack, u, w):
    if u is None or stack is None or u.ndim - stack < 2:
      return u
    norm = _norms(u, stack)
    limit = max_ratio * jnp.maximum(_norms(w, stack), _floor(w, stack, floor_rms))
    clip = jnp.isfinite(norm) & (norm > limit)
    return jnp.where(clip, u * (limit / jnp.where(clip, norm, 1.0)).astype(u.dtype), u)

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("clip_by_relative_norm (scsgd's max_relative_step) bounds each step by its parameter's norm: "
                       "pass params to update (tx.update(grads, state, params)), or build scsgd with "
                       "max_relative_step=None.")
    stacks = stack_of(params)
    return jax.tree.map(one, stacks, updates, params, is_leaf=lambda x: x is None), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
