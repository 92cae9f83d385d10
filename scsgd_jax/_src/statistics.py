"""Correlation statistics of a layer's inputs: the pluggable piece of the transformation.

A :class:`CorrelationStatistics` is three pure functions. The transformation
only ever calls them; it never looks inside their state. A statistic that
keeps something other than a dense ``C`` (e.g. a streaming ``O(n r)`` sketch)
plugs in by providing the same three functions.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from scsgd_jax._src import sketch

__all__ = ["CorrelationStatistics", "ema_correlation"]


class CorrelationStatistics(NamedTuple):
  """How one kernel's input statistics are kept and turned into a :class:`~scsgd_jax.Factor`.

  Attributes:
    init: ``init(n) -> stats``, the statistics of an ``n``-dim input before any data.
    update: ``update(stats, rows) -> stats`` folds a batch of finite input rows ``(m, n)``
      (``float32``).
    factor: ``factor(stats, key, rank) -> Factor`` refreshes the conditioner; ``rank=None``
      asks for the full conditioner ``A = C^{1/2}``. Must be ``vmap``-able over stats and key.
    correlation: ``correlation(stats) -> C`` dense estimate, for diagnostics and tests.
  """

  init: Callable[[int], Any]
  update: Callable[[Any, jax.Array], Any]
  factor: Callable[[Any, jax.Array, Optional[int]], sketch.Factor]
  correlation: Callable[[Any], jax.Array]


def ema_correlation(
    rate: float = 0.05,
    *,
    oversample: int = 10,
    power_iterations: int = 1,
    eigenvalue_floor: float = sketch.DEFAULT_EIGENVALUE_FLOOR,
) -> CorrelationStatistics:
  r"""Exponential moving average of the input correlation (Section 3).

  Starts at :math:`C = I` and folds each batch of rows as
  :math:`C \leftarrow (1 - \nu) C + \nu \frac{1}{m} \sum_i x_i x_i^\top`.
  Memory ``O(n^2)``, fold ``O(m n^2)``; refresh by :func:`~scsgd_jax.sketched_factor`
  (rank ``k``) or :func:`~scsgd_jax.full_factor`.

  Args:
    rate: :math:`\nu \in (0, 1]`.
    oversample, power_iterations, eigenvalue_floor: passed to the factorisation.
  """
  if not isinstance(rate, jax.core.Tracer) and not 0.0 < float(rate) <= 1.0:  # traced under inject_hyperparams
    raise ValueError(f"ema_rate must lie in (0, 1], got {rate!r}.")

  def init(n: int):
    return jnp.eye(n, dtype=jnp.float32)

  def update(c, rows):
    m = rows.shape[0]
    batch = rows.T @ rows / m
    return (1.0 - rate) * c + rate * batch

  def factor(c, key, rank):
    if rank is None:
      return sketch.full_factor(c, eigenvalue_floor=eigenvalue_floor)
    return sketch.sketched_factor(
        key, c, rank, oversample=oversample, power_iterations=power_iterations,
        eigenvalue_floor=eigenvalue_floor)

  return CorrelationStatistics(init, update, factor, lambda c: c)
