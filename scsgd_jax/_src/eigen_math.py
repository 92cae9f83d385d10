r"""The eigenbasis' arithmetic per kernel, pure (no state, no optax): the basis ``U = Q V`` of a conditioner's
factor, Adam's second moment carried from one basis to the next, the bounded step in a basis and its tail, and
Adam's bound on ``|m_hat| / sqrt(v_hat)``. :mod:`eigenbasis` keeps the state and schedules these."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp

from scsgd_jax._src import sketch

Tail = Literal["factored", "scalar", "orthogonal"]
_TINY = 1e-30
# Muon's quintic Newton-Schulz iteration (Jordan et al. 2024): 5 steps take a matrix's singular values near 1
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
# an orthogonalized (n, p) tail is scaled by this times sqrt(max(n, p)): AdamW's typical update RMS (Liu et al. 2025)
_ORTHOGONAL_RMS = 0.2
# a row of the factored tail inside the basis' span (structurally 0: the coordinate basis of init's identity factor)
# holds float32 round-off alone; its moment is read at least this share of the mean row moment, so round-off over
# eps never makes a step
_ROW_FLOOR = 1e-6
# a rotated coordinate of a gradient structurally 0 there (a direction of the basis outside the inputs' span: the
# null space of C, where eigh's basis is arbitrary) holds the rotation's float32 round-off alone, about 2^-23 of its
# column's norm, which Adam's ratio would scale to a step of the rate (and Muon's orthogonalization after it, to a
# full one); a coordinate's step is weighted by 1 / (1 + (f / v)^2), f this share of its column's norm, squared
# (256x that round-off): round-off steps by 2^-32 of the rate, a coordinate above 2^-12 of its column's norm as
# Adam's to 3e-4
_ROUND_OFF = 2.0**-15


class EigenMoments(NamedTuple):
  """Adam's second moment of one conditioned kernel, in its eigenbasis (a leading stack axis per slice).

  Attributes:
    lead: ``(k, p)``, the second moment of ``U^T G``; ``(n, p)`` of ``G`` itself for a diagonal kind.
    row: ``(n,)``, the tail's row second moments (Adafactor), or ``None`` (scalar or orthogonalized tail, or no
      tail: ``k = n``).
    col: ``(p,)``, the tail's column second moments; ``()`` for a scalar tail; ``None`` for an orthogonalized tail
      (it keeps none) or with no tail.
  """

  lead: jax.Array
  row: Optional[jax.Array]
  col: Optional[jax.Array]


def eigenbasis(factor: sketch.Factor) -> Optional[jax.Array]:
  r"""The orthonormal eigenbasis ``U`` of a conditioner ``factor``: ``Q V`` where ``B^{-1} = V D V^\top``
  (``n x k``), or the eigenvectors of a dense ``A^{-1}`` (``n x n``); ``None`` for a diagonal factor (the
  coordinate basis). ``A^{-1} = U D U^\top + a^{-1}(I - U U^\top)``: the same conditioner, rotated to be diagonal."""
  v = rotation(factor)
  return None if v is None else basis(factor.q, v)


def rotation(factor: sketch.Factor) -> Optional[jax.Array]:
  """``V``, the eigenvectors of ``B^{-1}`` (of ``A^{-1}`` for a dense factor); ``None`` for a diagonal one."""
  if factor.b_inv is None:
    return None
  return jnp.linalg.eigh(0.5 * (factor.b_inv + factor.b_inv.T))[1]


def basis(q: Optional[jax.Array], v: jax.Array) -> jax.Array:
  return v if q is None else q @ v


def significance(lead: jax.Array) -> jax.Array:
  """Each rotated coordinate's weight in the step, ``1 / (1 + (f / v)^2)`` with ``f = 2^-30`` its column's sum of
  ``v``: 1 for Adam's coordinates (above ``2^-12`` of its column's norm: to 3e-4), ``2^-32`` for one holding the
  rotation's float32 round-off alone (a direction outside the inputs' span, whose gradient is structurally 0),
  which Adam's ratio would otherwise scale to a step of the rate with a random sign."""
  floor = _ROUND_OFF**2 * jnp.sum(lead, axis=-2, keepdims=True)
  return 1.0 / (1.0 + jnp.square(floor / jnp.maximum(lead, _TINY)))


def tail_moment(moments: EigenMoments) -> jax.Array:
  """The tail's second moment per coordinate ``(n, p)`` (Adafactor's ``r c^T / mean(r)``, each row's at least
  ``1e-6`` of the mean), or a scalar."""
  if moments.row is None:
    return moments.col
  mean = jnp.maximum(jnp.mean(moments.row), _TINY)
  return jnp.maximum(moments.row, _ROW_FLOOR * mean)[:, None] * moments.col[None, :] / mean


def carried(moments: EigenMoments, new: jax.Array, old: jax.Array) -> EigenMoments:
  r"""``moments`` carried from basis ``old`` to ``new``: with ``P = (U_new^\top U_old)^{\circ 2}``, each new
  direction's second moment is ``P`` times the old ones, plus the tail's share it takes from outside the old
  span (``1 - `` its row of ``P``) at the tail's average second moment per column: exact when the rotated
  coordinates are uncorrelated."""
  if new is None:
    return moments
  p = jnp.square(new.T @ old)
  lead = p @ moments.lead
  if moments.col is not None:  # the tail's mean second moment per column: Adafactor's column moment (or the scalar)
    col = moments.col[None, :] if moments.col.ndim else moments.col
  elif new.shape[1] < new.shape[0]:  # an orthogonalized tail keeps no moment: the old lead's mean per column
    col = jnp.mean(moments.lead, axis=0, keepdims=True)
  else:  # k = n: no tail
    return moments._replace(lead=lead)
  lead = lead + jnp.clip(1.0 - jnp.sum(p, axis=1), 0.0, 1.0)[:, None] * col
  return moments._replace(lead=lead)


def carried_both(moments: EigenMoments, new: jax.Array, old: jax.Array, new_out: jax.Array,
                  old_out: jax.Array) -> EigenMoments:
  r"""``moments`` of a kernel rotated on both sides carried to the bases ``(new, new_out)``: with
  ``P = (U_new^\top U_old)^{\circ 2}`` per side, ``P lead P_out^\top``, plus the share each new coordinate takes
  from outside the old spans at the tail's mean second moment (an orthogonalized tail: the old lead's mean)."""
  p, p_out = jnp.square(new.T @ old), jnp.square(new_out.T @ old_out)
  lead = p @ moments.lead @ p_out.T
  if new.shape[1] == new.shape[0] and new_out.shape[1] == new_out.shape[0]:  # both full: no tail
    return moments._replace(lead=lead)
  mean = jnp.mean(moments.col) if moments.col is not None else jnp.mean(moments.lead)
  inside = jnp.outer(jnp.sum(p, axis=1), jnp.sum(p_out, axis=1))
  return moments._replace(lead=lead + jnp.clip(1.0 - inside, 0.0, 1.0) * mean)


def orthogonalize(x: jax.Array) -> jax.Array:
  """The nearest semi-orthogonal matrix to ``x`` (its polar factor ``U V^T``), approximately: Muon's quintic
  Newton-Schulz iteration, 5 steps from ``x / |x|_F`` (singular values end in about ``[0.7, 1.2]``)."""
  a, b, c = _NS_COEFFICIENTS
  wide = x.shape[0] <= x.shape[1]
  y = x if wide else x.T
  y = y / (jnp.linalg.norm(y) + 1e-7)
  for _ in range(_NS_STEPS):
    s = y @ y.T
    y = a * y + (b * s + c * (s @ s)) @ y
  return y if wide else y.T


def direction(q, v, m, g, moments: EigenMoments, b2, correction, eps, bound, tail: Tail = "factored",
               output=None):
  """One ``(n, p)`` matrix: its second moments updated with ``g`` and Adam's direction of the bias-corrected
  first moment ``m``, in the basis ``U = Q V`` (``q=None``: ``U = V``; ``v=None``: the coordinate basis) and rotated
  back; ``correction`` is the second moment's bias correction ``1 - b2^t``. ``U = Q V`` is formed once (``n k^2``)
  and applied as one product each way. ``output=(q_out, v_out)``: rotated on the output side too, ``U^T x U_out``.

  The step is bounded as Adam's is in its own basis (:func:`adam_ratio_bound`): each rotated coordinate's ratio
  is clipped at ``bound`` (it can pass it only where a refresh carried the moments into a new basis, whose
  second moment is then an estimate), and the tail's step at ``bound (sqrt(n p) - sqrt(k p))`` in Frobenius norm,
  so ``||step||_F <= bound sqrt(n p)``."""
  ema = lambda v, x: b2 * v + (1.0 - b2) * x
  ratio = lambda x, second: jnp.clip(x / (jnp.sqrt(second / correction) + eps), -bound, bound)
  if v is None:
    lead = ema(moments.lead, jnp.square(g))
    return ratio(m, lead), moments._replace(lead=lead)
  if output is None:
    u = v if q is None else q @ v  # formed once: three products each way share it
    rotate = lambda x: u.T @ x
    back = lambda y: u @ y
    full = q is None
  else:
    q_out, v_out = output
    left = lambda x: v.T @ (x if q is None else q.T @ x)
    rotate = lambda x: (left(x) if q_out is None else left(x) @ q_out) @ v_out
    right_back = lambda y: y @ v_out.T if q_out is None else (y @ v_out.T) @ q_out.T
    back = lambda y: v @ right_back(y) if q is None else q @ (v @ right_back(y))
    full = q is None and q_out is None
  g_lead, m_lead = rotate(g), rotate(m)
  lead = ema(moments.lead, jnp.square(g_lead))
  out = back(ratio(m_lead, lead) * significance(lead))
  if full:  # k = n (on both sides, if both): no tail
    return out, moments._replace(lead=lead)
  m_tail = m - back(m_lead)
  tail_limit = bound * (math.sqrt(m.size) - math.sqrt(lead.size))
  if tail == "orthogonal":  # COSMOS's tail: orthogonalized, at AdamW's RMS, no state
    scale = _ORTHOGONAL_RMS * jnp.sqrt(float(max(m.shape)))
    return out + capped(scale * orthogonalize(m_tail), tail_limit), moments._replace(lead=lead)
  g_tail = g - back(g_lead)
  sq = jnp.square(g_tail)
  if moments.row is None:
    new = EigenMoments(lead, None, ema(moments.col, jnp.mean(sq)))
  else:
    new = EigenMoments(lead, ema(moments.row, jnp.mean(sq, axis=1)), ema(moments.col, jnp.mean(sq, axis=0)))
  return out + capped(m_tail / (jnp.sqrt(tail_moment(new) / correction) + eps), tail_limit), new


def capped(x: jax.Array, limit) -> jax.Array:
  """``x`` scaled down to Frobenius norm ``limit`` where it is longer."""
  norm = jnp.linalg.norm(x)
  return x * jnp.minimum(1.0, limit / jnp.maximum(norm, _TINY))


def adam_ratio_bound(b1, b2, count, nesterov: bool = False) -> jax.Array:
  r"""The largest ``|m_hat| / sqrt(v_hat)`` Adam can take at step ``count`` (``eps = 0``), whatever the gradients.

  With ``m_hat = sum_j w_j g_{t-j}`` and ``v_hat = sum_j u_j g_{t-j}^2`` (bias-corrected EMAs), Cauchy-Schwarz
  gives ``|m_hat| <= sqrt(sum_j w_j^2 / u_j) sqrt(v_hat)``: with ``r = b1^2 / b2`` and ``S = sum_{j<t} r^j``,

  .. math::

    c_t^2 = \frac{1 - b_2^t}{1 - b_2} \Big(\frac{1 - b_1}{1 - b_1^t}\Big)^2 S

  (NAdam's Nesterov form, ``w_0`` gaining ``(1 - b1) / (1 - b1^t)``, adds its terms alike). About 7.3 for
  ``(0.9, 0.999)`` late in training, 1 at the first step: Adam's update per coordinate is at most ``c_t`` times
  the rate, in any basis its moments were kept in.
  """
  t = jnp.asarray(count, jnp.float32)
  r = b1 * b1 / jnp.maximum(b2, _TINY)
  series = lambda n: jnp.where(jnp.abs(1.0 - r) < 1e-6, n, (1.0 - r ** n) / jnp.where(r == 1.0, 1.0, 1.0 - r))
  spread = (1.0 - b2 ** t) / (1.0 - b2)
  if not nesterov:
    return jnp.sqrt(spread * ((1.0 - b1) / (1.0 - b1 ** t)) ** 2 * series(t))
  later = b1 * (1.0 - b1) / (1.0 - b1 ** (t + 1.0))
  first = later + (1.0 - b1) / (1.0 - b1 ** t)
  return jnp.sqrt(spread * (first ** 2 + later ** 2 * (series(t) - 1.0)))
