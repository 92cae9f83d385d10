"""Candidate step bounds for the paper's method at its edge of stability, measured by :mod:`experiments.zoo.probe`.

Each wraps a whole optimizer (its updates are the final steps, the rate included) and sees the raw gradients and
the parameters:

- ``relative_step``: each layer's step at most ``tau`` times its weight's norm (LARS/LAMB's trust ratio, as a
  clip: it acts only on a step above the bound): the library's ``scsgd(max_relative_step=tau)``
  (:func:`scsgd_jax.clip_by_relative_norm`);
- :func:`predicted_decrease`: the whole step's first-order predicted decrease ``-<step, g>`` at most ``nats``
  (kfac-jax's ``norm_constraint``, in the loss's units);
- :func:`amplification`: each layer's step at most ``kappa`` times Nesterov SGD's at the same rate (what the
  conditioning may add to a raw gradient step);
- :func:`outlier_step`: each layer's relative step at most ``kappa`` times the layers' median (no absolute scale);
- :func:`head_step`: the library's relative step bound (its first floor, RMS 0.01) on the output layer alone (the
  tied table where the head is the embedding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _norm(x):
  return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _bounded(inner: optax.GradientTransformation, bound) -> optax.GradientTransformationExtraArgs:
  """``inner`` whose updates pass through ``bound(updates, grads, params)``."""
  inner = optax.with_extra_args_support(inner)

  def update(grads, state, params=None, **extra):
    updates, state = inner.update(grads, state, params, **extra)
    return bound(updates, grads, params), state

  return optax.GradientTransformationExtraArgs(inner.init, update)


def predicted_decrease(inner, nats: float = 0.5):
  """The whole step scaled by ``min(1, nats / -<step, g>)``: no step predicts more than ``nats`` of decrease."""

  def bound(updates, grads, params):
    del params
    decrease = -sum(jnp.sum(u.astype(jnp.float32) * g.astype(jnp.float32))
                    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)))
    scale = jnp.where(decrease > nats, nats / jnp.maximum(decrease, 1e-30), 1.0)
    return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)

  return _bounded(inner, bound)


def amplification(inner, schedule, kappa: float = 4.0, momentum: float = 0.9):
  """Each leaf: ``|step| <= kappa * (1 + momentum) * rate * |g|`` (Nesterov SGD's first step at that rate)."""
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return (inner.init(params), jnp.zeros([], jnp.int32))

  def update(grads, state, params=None, **extra):
    inner_state, step = state
    updates, inner_state = inner.update(grads, inner_state, params, **extra)
    rate = schedule(step)
    one = lambda u, g: u * jnp.minimum(1.0, kappa * (1 + momentum) * rate * _norm(g) / jnp.maximum(_norm(u), 1e-30))
    return jax.tree.map(one, updates, grads), (inner_state, optax.safe_increment(step))

  return optax.GradientTransformationExtraArgs(init, update)


def outlier_step(inner, kappa: float = 4.0, floor_rms: float = 1e-2):
  """Each leaf of two or more axes: its relative step ``|step| / max(|W|, floor_rms sqrt(size))`` at most ``kappa``
  times the median of all such leaves' (a layer running far above the others, as a softmax head at the edge does,
  is brought back to them; layers moving alike are untouched)."""

  def bound(updates, grads, params):
    del grads
    leaves = [(u, w) for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(params)) if u.ndim >= 2]
    ratio = lambda u, w: _norm(u) / jnp.maximum(_norm(w), floor_rms * jnp.sqrt(jnp.float32(u.size)))
    limit = kappa * jnp.median(jnp.stack([ratio(u, w) for u, w in leaves]))

    def one(u, w):
      if u.ndim < 2:
        return u
      r = ratio(u, w)
      return u * jnp.where(r > limit, limit / jnp.maximum(r, 1e-30), 1.0).astype(u.dtype)

    return jax.tree.map(one, updates, params)

  return _bounded(inner, bound)


def head_step(inner, head: str, tau: float):
  """:func:`scsgd_jax.clip_by_relative_norm` at ``tau`` on the leaves whose path contains ``head`` (``""``: the
  embedding tables, a tied head), every other step as ``inner`` gives it."""
  import scsgd_jax as sk

  def mask(params):
    def one(path, leaf):
      name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
      return (head in name) if head else name.endswith("embedding")
    return jax.tree_util.tree_map_with_path(one, params)

  return optax.chain(inner, optax.masked(sk.clip_by_relative_norm(tau, floor_rms=1e-2), mask))

