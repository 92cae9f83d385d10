"""A bound on each layer's step relative to its weight: LARS's and LAMB's trust ratio as a clip, which acts only on
a step above it."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import checks

__all__ = ["clip_by_relative_norm"]


def _norm(x: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _floor(w: jax.Array, floor_rms: Optional[float]) -> jax.Array:
  """The weight norm the bound assumes at least: ``floor_rms`` times ``sqrt(size)``, or (``None``) the norm of a
  lecun-normal init of the leaf's shape, ``sqrt(shape[-1])`` (fan-in ``size / shape[-1]``: Flax's kernels put their
  outputs last)."""
  if floor_rms is None:
    return jnp.sqrt(jnp.float32(w.shape[-1]))
  return floor_rms * jnp.sqrt(jnp.float32(w.size))


def clip_by_relative_norm(max_ratio: float, floor_rms: Optional[float] = None) -> optax.GradientTransformation:
  r"""Each update leaf of two or more axes (kernels, embedding tables) scaled, when its norm is above it, to
  :math:`\text{max\_ratio} \cdot \max(\|W\|, \text{floor})`, ``W`` the leaf's parameter; vectors (biases, norms'
  scales) pass as they are.

  It goes last in a chain (its updates are the steps applied): a layer's step is then at most ``max_ratio`` of its
  weight, where a rate too high for that layer (a softmax head near the warmup's peak) would multiply it. A step
  within the bound passes bit for bit. The floor lets a small or zero-initialised leaf move as a freshly
  initialised one would: by default the norm of a lecun-normal init of its shape, ``sqrt(shape[-1])`` (RMS
  ``1 / sqrt(fan_in)``); ``floor_rms`` sets the RMS instead. No state; ``update`` needs ``params``. A non-finite
  step passes as it is (the optimizer's own guards see it).

  Args:
    max_ratio: the largest step norm per unit of weight norm (> 0).
    floor_rms: the weight's RMS the bound assumes at least (``>= 0``); ``None``: the leaf's init scale.
  """
  checks.check_float("max_ratio", max_ratio, low=0.0, low_open=True)
  if floor_rms is not None:
    checks.check_float("floor_rms", floor_rms, low=0.0)

  def one(u, w):
    if u is None or jnp.ndim(u) < 2:
      return u
    norm = _norm(u)
    limit = max_ratio * jnp.maximum(_norm(w), _floor(w, floor_rms))
    clip = jnp.isfinite(norm) & (norm > limit)
    return jnp.where(clip, u * (limit / jnp.where(clip, norm, 1.0)).astype(u.dtype), u)

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("clip_by_relative_norm bounds each step by its parameter's norm: pass params to update.")
    return jax.tree.map(one, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
