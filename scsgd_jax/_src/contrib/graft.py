"""Layer-wise grafting: one optimizer's direction at another's step size.

Agarwal, Anil, Hazan, Koren & Zhang, "Disentangling Adaptive Gradient Methods from Learning Rates"
(arXiv:2002.11803, 2020): per parameter, the update of ``direction`` rescaled to the norm of the
update of ``magnitude``, both computed from the same gradients. Distributed Shampoo grafts its
preconditioned direction onto a normalized RMSprop's norm this way, so that one learning rate serves
every layer whatever the scale of its conditioner.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import layout as layout_lib

__all__ = ["FactoredRMSState", "GraftState", "scale_by_grafting", "scale_by_normalized_factored_rms",
           "scale_by_normalized_rms"]


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
  """State of the factored part of :func:`scale_by_normalized_factored_rms`, keyed by path so that no leaf sits at
  a parameter's place with another shape (``nnx.Optimizer`` gives such a leaf its parameter's sharding
  annotation).

  Attributes:
    count: updates applied so far.
    rows, cols: ``{leaf path: moment}``, a factored leaf's row and column second moments (over its two largest
      axes).
  """

  count: jax.Array
  rows: dict[str, jax.Array]
  cols: dict[str, jax.Array]


# optax's Adafactor factors a leaf's moment where its two largest axes are both at least this
_MIN_DIM_TO_FACTOR = 128


def scale_by_normalized_factored_rms(decay: float = defaults.GRAFT_DECAY,
                                     eps: float = defaults.GRAFT_EPS) -> optax.GradientTransformation:
  r""":func:`scale_by_normalized_rms` with Adafactor's factored second moment for a leaf whose two largest axes
  are each at least 128 (optax's ``scale_by_factored_rms``' rule): their row and column moments (``n + p``
  floats, not ``n p``), bias-corrected EMAs at ``decay`` of the squared normalized gradient plus ``eps^2``, read
  as ``v \approx r c^\top / \mathrm{mean}(r)`` and the step ``g / \sqrt{v}``. Every other leaf gets
  ``optax.scale_by_rms`` as :func:`scale_by_normalized_rms` does. The grafted step's norm as RMSprop's, nearly,
  at Adafactor's memory."""
  checks.check_float("decay", decay, low=0.0, high=1.0, high_open=True)
  checks.check_float("eps", eps, low=0.0)
  factored = lambda tree: jax.tree.map(lambda leaf: _factored_axes(leaf.shape) is not None, tree)
  return optax.chain(
      _unit(),
      optax.masked(optax.scale_by_rms(decay=decay, eps=eps, eps_in_sqrt=False, bias_correction=True),
                   lambda tree: jax.tree.map(lambda f: not f, factored(tree))),
      optax.masked(_scale_by_factored_moments(decay, eps), factored))


def _scale_by_factored_moments(decay: float, eps: float) -> optax.GradientTransformation:
  """Adafactor's step for leaves :func:`_factored_axes` factors (``optax.masked`` gives it those alone)."""

  def init(params):
    rows, cols = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      first, second = _factored_axes(leaf.shape)
      name = layout_lib.path_to_str(path)
      rows[name] = jnp.zeros(_without(leaf.shape, second), leaf.dtype)
      cols[name] = jnp.zeros(_without(leaf.shape, first), leaf.dtype)
    return FactoredRMSState(jnp.zeros([], jnp.int32), rows, cols)

  def update(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    rows, cols, out = {}, {}, []
    for path, g in flat:
      name, (first, second) = layout_lib.path_to_str(path), _factored_axes(g.shape)
      sq = jnp.square(g) + eps**2
      rows[name] = optax.tree.update_moment(jnp.mean(sq, axis=second), state.rows[name], decay, 1)
      cols[name] = optax.tree.update_moment(jnp.mean(sq, axis=first), state.cols[name], decay, 1)
      r, c = (optax.tree.bias_correction(m, decay, count) for m in (rows[name], cols[name]))
      r = jnp.expand_dims(r / jnp.mean(r, axis=first - (first > second), keepdims=True), second)
      out.append(g / jnp.sqrt(r * jnp.expand_dims(c, first)))
    return treedef.unflatten(out), FactoredRMSState(count, rows, cols)

  return optax.GradientTransformation(init, update)


def _factored_axes(shape) -> Optional[tuple[int, int]]:
  """A leaf's two largest axes ``(second largest, largest)`` where both are at least 128; else ``None``."""
  if len(shape) < 2:
    return None
  order = sorted(range(len(shape)), key=lambda a: (shape[a], a))
  return None if shape[order[-2]] < _MIN_DIM_TO_FACTOR else (order[-2], order[-1])


def _without(shape, axis: int) -> tuple[int, ...]:
  return tuple(d for a, d in enumerate(shape) if a != axis)


def _unit() -> optax.GradientTransformation:
  """Each leaf divided by its Frobenius norm (a zero leaf stays zero)."""

  def unit(g):
    return g / jnp.maximum(_norm(g), 1e-30).astype(g.dtype)

  return optax.stateless(lambda updates, params: jax.tree.map(unit, updates))
