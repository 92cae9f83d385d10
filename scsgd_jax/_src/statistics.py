r"""Correlation statistics of a layer's inputs: the pluggable piece of the transformation.

A :class:`CorrelationStatistics` is a handful of pure functions. The
transformation only ever calls them; it never looks inside their state. Three
are provided, all exponential moving averages (Section 3) of a different view
of :math:`C = E[x x^\top]`:

- :func:`ema_correlation`: the dense ``n x n`` EMA of ``C`` (the paper's), ``O(n^2)`` memory.
- :func:`nystrom_correlation`: the EMA of the sketch ``Y = C Omega`` and of ``tr C``,
  ``O(n r)`` memory, factored by single-pass Nystrom (never forms ``C``).
- :func:`diagonal_correlation`: the EMA of ``diag C``, ``O(n)``; exact for an
  embedding, whose one-hot inputs make ``C`` diagonal.

Each starts either from the identity prior ``C_0 = I`` (the paper) or, with
``identity_prior=False``, from nothing: with ``w_t = 1 - (1 - \nu)^t`` the weight of
data folded so far, :math:`C_t = S_t / w_t + (1 - w_t) \frac{\mathrm{tr} C_t}{n} I`
(the warm start: bias-corrected, with the missing weight filled by the isotropic
matrix at the data's own scale, so the first batch already shapes the conditioner
without a rank-deficient ``C`` amplifying unseen directions).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import sketch

__all__ = [
    "CorrelationStatistics",
    "EmaState",
    "diagonal_correlation",
    "ema_correlation",
    "nystrom_correlation",
]

class CorrelationStatistics(NamedTuple):
  """How one kernel's input statistics are kept and turned into a :class:`~scsgd_jax.sketch.Factor`.

  Attributes:
    init: ``init(n, key) -> stats``, the statistics of an ``n``-dim input before any data.
    update: ``update(stats, rows) -> stats`` folds one batch: finite input rows
      ``(m, n)`` (``float32``), or, for a statistic with ``takes_ids``, integer
      ids of one-hot inputs (any shape).
    factor: ``factor(stats, key, rank) -> Factor`` refreshes the conditioner; ``rank=None``
      asks for the full conditioner ``A = C^{1/2}``. Must be ``vmap``-able over stats and key.
    correlation: ``correlation(stats) -> C`` dense estimate, for diagnostics and tests.
    trace: ``trace(stats) -> tr C`` estimate (0 before any data without a prior);
      the outlier guard compares new rows with it.
    takes_ids: whether ``update`` takes integer ids (embeddings) instead of rows.
    keyed: ``keyed(rank) -> bool``, whether ``factor`` at ``rank`` reads its key (default: always); a refresh
      whose factors read none draws no keys, and the state's key stays as it is.
  """

  init: Callable[[int, jax.Array], Any]
  update: Callable[[Any, jax.Array], Any]
  factor: Callable[[Any, jax.Array, Optional[int]], sketch.Factor]
  correlation: Callable[[Any], jax.Array]
  trace: Callable[[Any], jax.Array]
  takes_ids: bool = False
  keyed: Callable[[Optional[int]], bool] = lambda rank: True


class EmaState(NamedTuple):
  """An EMA of batch moments and the weight folded in so far.

  ``weight`` is 1 from the start with the identity prior (``moments`` start at
  the moments of ``C = I``) and ``1 - (1 - nu)^t`` after ``t`` folds without it,
  so ``moments / weight`` is the bias-corrected average either way.
  """

  moments: Any
  weight: jax.Array


def _check_arguments(rate, eigenvalue_floor) -> None:
  checks.check_float("ema_rate", rate, low=0.0, high=1.0, low_open=True)
  checks.check_float("eigenvalue_floor", eigenvalue_floor, low=0.0, high=1.0)


def _ema_init(prior_moments, identity_prior: bool) -> EmaState:
  if identity_prior:
    return EmaState(prior_moments, jnp.ones((), jnp.float32))
  return EmaState(jax.tree.map(jnp.zeros_like, prior_moments), jnp.zeros((), jnp.float32))


def _ema_fold(state: EmaState, batch_moments, rate) -> EmaState:
  moments = jax.tree.map(lambda s, b: (1.0 - rate) * s + rate * b, state.moments, batch_moments)
  return EmaState(moments, (1.0 - rate) * state.weight + rate)


def _ema_mean(state: EmaState):
  """``moments / weight``; zero before any data (no prior), which factors to the identity."""
  w = jnp.where(state.weight > 0, state.weight, 1.0)
  return jax.tree.map(lambda s: s / w, state.moments)


def _isotropic_fill(state: EmaState, trace: jax.Array, n: int) -> jax.Array:
  """The weight ``1 - w`` not yet filled by data, times the mean eigenvalue ``tr C / n``.

  Added to the bias-corrected ``C`` as ``(1 - w) (tr C / n) I``: the warm start's prior is the
  isotropic matrix at the data's own scale (scale-free, unlike the paper's ``C_0 = I``), so a
  rank-deficient early ``C`` (one batch of ``m < n`` rows) never amplifies the unseen directions; it
  vanishes as ``w -> 1`` and is 0 with the identity prior (``w = 1`` throughout).
  """
  return jnp.where(state.weight > 0, (1.0 - state.weight) * trace / n, 0.0)


def ema_correlation(
    rate: float = defaults.EMA_RATE,
    *,
    identity_prior: bool = True,
    oversample: int = defaults.OVERSAMPLE,
    power_iterations: int = defaults.POWER_ITERATIONS,
    eigenvalue_floor: float = defaults.EIGENVALUE_FLOOR,
) -> CorrelationStatistics:
  r"""Dense exponential moving average of the input correlation (Section 3).

  Folds each batch of rows as
  :math:`S \leftarrow (1 - \nu) S + \nu \frac{1}{m} \sum_i x_i x_i^\top`, from
  ``S = I`` (``identity_prior=True``, the paper) or ``S = 0`` with the bias
  correction and isotropic fill of the module docstring. Memory ``O(n^2)``, fold ``O(m n^2)``;
  refresh by :func:`~scsgd_jax.sketch.sketched_factor` (rank ``k``) or
  :func:`~scsgd_jax.sketch.full_factor`.

  Args:
    rate: :math:`\nu \in (0, 1]`.
    identity_prior: start from ``C = I`` (paper) rather than bias-correcting.
    oversample, power_iterations, eigenvalue_floor: passed to the factorisation.
  """
  _check_arguments(rate, eigenvalue_floor)

  def init(n, key=None):
    del key
    return _ema_init(jnp.eye(n, dtype=jnp.float32), identity_prior)

  def update(state, rows):
    return _ema_fold(state, rows.T @ rows / rows.shape[0], rate)

  def correlation(state):
    c = _ema_mean(state)
    n = c.shape[-1]
    return c + _isotropic_fill(state, jnp.trace(c), n) * jnp.eye(n, dtype=c.dtype)

  def factor(state, key, rank):
    c = correlation(state)
    if rank is None:
      return sketch.full_factor(c, eigenvalue_floor=eigenvalue_floor)
    return sketch.sketched_factor(
        key, c, rank, oversample=oversample, power_iterations=power_iterations,
        eigenvalue_floor=eigenvalue_floor)

  def trace(state):  # read by the outlier guard every step: O(n), not a division of all of S
    return jnp.trace(state.moments) / jnp.where(state.weight > 0, state.weight, 1.0)

  # the full conditioner's eigh draws nothing; the sketch (rank k) draws its test matrix
  return CorrelationStatistics(init, update, factor, correlation, trace, keyed=lambda rank: rank is not None)


class NystromState(NamedTuple):
  """State of :func:`nystrom_correlation`: EMAs of ``C Omega`` and ``tr C``, and the fixed ``Omega``."""

  ema: EmaState  # moments = (Y (n, r), trace ())
  omega: jax.Array


def nystrom_correlation(
    rank: int,
    rate: float = defaults.EMA_RATE,
    *,
    identity_prior: bool = True,
    oversample: int = defaults.OVERSAMPLE,
    eigenvalue_floor: float = defaults.EIGENVALUE_FLOOR,
) -> CorrelationStatistics:
  r"""Streaming ``O(n r)`` statistic: the EMA of the sketch ``Y = C Omega`` and of ``tr C``, never ``C``.

  ``Omega`` (``n x r``, ``r = min(rank + oversample, n)``, orthonormalised
  Gaussian) is drawn once at ``init``. Since ``C -> C Omega`` is linear, the EMA
  of ``Y_t = mean(x x^T) Omega = X^T (X Omega) / m`` is exactly ``C_ema Omega``,
  folded in ``O(m n r)``. The refresh is :func:`~scsgd_jax.sketch.nystrom_factor`
  (single-pass Nystrom, Tropp et al. 2017), ``O(n r^2)``. Memory: ``2 n r + 2``
  floats (``Y`` and ``Omega``), e.g. 9.25 MiB for ``n = 16384`` at rank 64,
  against 1 GiB for the dense ``C``. Unlike :func:`ema_correlation` it allows no
  power iterations (single pass), and ``rank=None`` (full) is not available.

  Args:
    rank: the conditioner's rank ``k``.
    rate: :math:`\nu \in (0, 1]`.
    identity_prior: start from ``C = I`` rather than bias-correcting.
    oversample: sketch columns beyond ``rank``.
    eigenvalue_floor: relative eigenvalue floor.
  """
  _check_arguments(rate, eigenvalue_floor)

  def width(n):
    return min(rank + oversample, n)

  def init(n, key):
    omega, _ = jnp.linalg.qr(jax.random.normal(key, (n, width(n)), jnp.float32))
    # a copy: the same buffer twice in one state breaks buffer donation (donate_argnums)
    ema = _ema_init((jnp.array(omega, copy=True), jnp.asarray(n, jnp.float32)), identity_prior)
    return NystromState(ema, omega)

  def update(state, rows):
    m = rows.shape[0]
    batch = (rows.T @ (rows @ state.omega) / m, jnp.sum(rows * rows) / m)
    return NystromState(_ema_fold(state.ema, batch, rate), state.omega)

  def factor(state, key, k):
    del key
    if k is None:
      raise ValueError("nystrom_correlation keeps no dense C: it gives sketched factors only (rank=None asked).")
    y, trace = filled(state)
    return sketch.nystrom_factor(y, state.omega, trace, k, eigenvalue_floor=eigenvalue_floor)

  def filled(state):
    y, trace = _ema_mean(state.ema)
    return y + _isotropic_fill(state.ema, trace, y.shape[0]) * state.omega, trace

  def correlation(state):
    y, _ = filled(state)
    core = state.omega.T @ y
    return y @ jnp.linalg.pinv(0.5 * (core + core.T), hermitian=True) @ y.T

  return CorrelationStatistics(init, update, factor, correlation, lambda s: _ema_mean(s.ema)[1],
                               keyed=lambda rank: False)


def diagonal_correlation(
    rate: float = defaults.EMA_RATE,
    *,
    identity_prior: bool = True,
    eigenvalue_floor: float = defaults.EIGENVALUE_FLOOR,
    takes_ids: bool = False,
) -> CorrelationStatistics:
  r"""EMA of ``diag C``, ``O(n)`` memory; the factor is ``A = diag(C)^{1/2}`` (:func:`~scsgd_jax.sketch.diagonal_factor`).

  For an embedding table (``takes_ids=True``) the input is one-hot, so ``C`` is
  exactly diagonal, holding the token frequencies, and ``A = C^{1/2}`` of
  Theorem 1 is exact at ``O(vocab)`` cost: ``update`` then takes the integer
  token ids of the batch. With rows it is the Jacobi conditioner (per-input RMS),
  the fallback for kernels too thin to hold an ``O(n r)`` sketch.
  """
  _check_arguments(rate, eigenvalue_floor)

  def init(n, key=None):
    del key
    return _ema_init(jnp.ones((n,), jnp.float32), identity_prior)

  def update(state, rows):
    n = state.moments.shape[-1]
    if takes_ids:
      ids = rows.reshape(-1)
      batch = jnp.zeros((n,), jnp.float32).at[ids].add(1.0, mode="drop") / ids.shape[0]
    else:
      batch = jnp.mean(rows * rows, axis=0)
    return _ema_fold(state, batch, rate)

  def diagonal(state):
    d = _ema_mean(state)
    return d + _isotropic_fill(state, jnp.sum(d), d.shape[-1])

  def factor(state, key, rank):
    del key, rank
    return sketch.diagonal_factor(diagonal(state), eigenvalue_floor=eigenvalue_floor)

  return CorrelationStatistics(
      init, update, factor, lambda s: jnp.diag(diagonal(s)), lambda s: jnp.sum(_ema_mean(s)), takes_ids,
      keyed=lambda rank: False)
