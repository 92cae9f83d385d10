"""Layer-wise grafting: one optimizer's direction at another's step size.

Agarwal, Anil, Hazan, Koren & Zhang, "Disentangling Adaptive Gradient Methods from Learning Rates"
(arXiv:2002.11803, 2020): per parameter, the update of ``direction`` rescaled to the norm of the
update of ``magnitude``, both computed from the same gradients. Distributed Shampoo grafts its
preconditioned direction onto a normalized RMSprop's norm this way, so that one learning rate serves
every layer whatever the scale of its conditioner.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import layout as layout_lib

__all__ = ["FactoredRMSState", "GraftState", "scale_by_grafting", "scale_by_normalized_factored_rms", "scale_by_normalized_rms"]


def _norm(x):
  """The Frobenius norm of a leaf, accumulated in float32."""
  return jnp.linalg.norm(x.astype(jnp.float32).ravel())


class GraftState(NamedTuple):
  magnitude: optax.OptState
  direction: optax.OptState


def scale_by_grafting(magnitude: optax.GradientTransformation, direction: optax.GradientTransformation,
                      eps: float = 1e-16) -> optax.GradientTransformationExtraArgs:
  r"""Per leaf, ``direction``'s update with the Frobenius norm of ``magnitude``'s:
  :math:`u = d \, \|m\| / \max(\|d\|, \epsilon)` (zero where ``d`` is zero).

  Both transformations see the same gradients; extra arguments (``layer_inputs=`` for
  :func:`scale_by_sketched_conditioning`) reach whichever accepts them.
  """
  checks.check_float("eps", eps, low=0.0, low_open=True)
  magnitude = optax.with_extra_args_support(magnitude)
  direction = optax.with_extra_args_support(direction)

  def init(params):
    return GraftState(magnitude.init(params), direction.init(params))

  def update(updates, state, params=None, **extra):
    m, m_state = magnitude.update(updates, state.magnitude, params, **extra)
    d, d_state = direction.update(updates, state.direction, params, **extra)

    def graft(m_leaf, d_leaf):
      return (d_leaf * (_norm(m_leaf) / jnp.maximum(_norm(d_leaf), eps))).astype(d_leaf.dtype)

    return jax.tree.map(graft, m, d), GraftState(m_state, d_state)

  return optax.GradientTransformationExtraArgs(init, update)


def scale_by_normalized_rms(decay: float = defaults.GRAFT_DECAY, eps: float = defaults.GRAFT_EPS) -> optax.GradientTransformation:
  r"""Shampoo's ``RMSPROP_NORMALIZED`` grafting step: each leaf's gradient divided by its norm, then
  RMSprop with bias correction, :math:`\hat g / (\sqrt{\hat v} + \epsilon)`. Conditioned SCSGD grafted
  onto it, then Nesterov momentum (Shampoo's layout; rates on Adam's scale)::

    optax.chain(scale_by_grafting(scale_by_normalized_rms(), scale_by_sketched_conditioning()),
                optax.sgd(learning_rate, momentum=0.9, nesterov=True))
  """
  checks.check_float("decay", decay, low=0.0, high=1.0, high_open=True)
  checks.check_float("eps", eps, low=0.0)

  return optax.chain(_unit(), optax.scale_by_rms(decay=decay, eps=eps, eps_in_sqrt=False, bias_correction=True))


class FactoredRMSState(NamedTuple):
  """State of :func:`scale_by_normalized_factored_rms`: the moments of ``optax.scale_by_factored_rms``, laid out
  so that every leaf of a parameter-shaped tree has its parameter's shape (``nnx.Optimizer`` gives such a leaf its
  parameter's sharding annotation).

  Attributes:
    count: updates applied so far.
    rows, cols: ``{leaf path: moment}``, a factored leaf's row and column moments.
    v: a tree like the parameters: RMSprop's moment of each leaf not factored; ``optax.MaskedNode`` at the
      factored ones.
  """

  count: jax.Array
  rows: dict[str, jax.Array]
  cols: dict[str, jax.Array]
  v: optax.Updates


def scale_by_normalized_factored_rms(decay: float = defaults.GRAFT_DECAY,
                                     eps: float = defaults.GRAFT_EPS) -> optax.GradientTransformation:
  r""":func:`scale_by_normalized_rms` with Adafactor's factored second moment (``optax.scale_by_factored_rms``):
  a leaf whose two largest axes are each at least 128 keeps their row and column moments (``n + p`` floats, not
  ``n p``), read as ``v \approx r c^\top / \mathrm{mean}(r)``; a smaller leaf keeps RMSprop's. Each moment is an
  EMA at the fixed ``decay``, bias-corrected as RMSprop's (Adafactor's rising decay replaced); ``eps^2`` joins
  every squared gradient. The grafted step's norm as RMSprop's, nearly, at Adafactor's memory."""
  checks.check_float("decay", decay, low=0.0, high=1.0, high_open=True)
  checks.check_float("eps", eps, low=0.0)

  def corrected(step, rate):  # the EMA's weight at update `step` (0 first) with RMSprop's bias correction folded in
    t = jnp.asarray(step, jnp.float32) + 1.0
    return rate * (1.0 - rate ** (t - 1.0)) / (1.0 - rate ** t)

  factored = optax.scale_by_factored_rms(decay_rate=decay, epsilon=eps**2, decay_rate_fn=corrected)

  def init(params):
    return _laid_out(factored.init(params), params)

  def update(updates, state, params=None):
    del params  # optax's factored RMS reads shapes and dtypes alone: the updates'
    out, inner = factored.update(updates, _optax_state(state, updates), updates)
    return out, _laid_out(inner, updates)

  return optax.chain(_unit(), optax.GradientTransformation(init, update))


def _laid_out(inner, like) -> FactoredRMSState:
  """optax's ``FactoredState`` as :class:`FactoredRMSState` (a leaf is factored where optax's full moment is not
  its shape)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  rows, cols, v = {}, {}, []
  for (path, leaf), r, c, full in zip(flat, *(treedef.flatten_up_to(t) for t in (inner.v_row, inner.v_col, inner.v))):
    if full.shape == leaf.shape:
      v.append(full)
    else:
      name = layout_lib.path_to_str(path)
      rows[name], cols[name] = r, c
      v.append(optax.MaskedNode())
  return FactoredRMSState(inner.count, rows, cols, treedef.unflatten(v))


def _optax_state(state: FactoredRMSState, like):
  """:class:`FactoredRMSState` back as optax's ``FactoredState`` (its placeholders of shape ``(1,)`` rebuilt)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  rows, cols, v = [], [], []
  for (path, leaf), full in zip(flat, treedef.flatten_up_to(state.v)):
    name, blank = layout_lib.path_to_str(path), jnp.zeros((1,), leaf.dtype)
    factored = isinstance(full, optax.MaskedNode)
    rows.append(state.rows[name] if factored else blank)
    cols.append(state.cols[name] if factored else blank)
    v.append(blank if factored else full)
  return optax.FactoredState(state.count, *(treedef.unflatten(t) for t in (rows, cols, v)))


def _unit() -> optax.GradientTransformation:
  """Each leaf divided by its Frobenius norm (a zero leaf stays zero)."""

  def unit(g):
    return g / jnp.maximum(_norm(g), 1e-30).astype(g.dtype)

  return optax.stateless(lambda updates, params: jax.tree.map(unit, updates))
