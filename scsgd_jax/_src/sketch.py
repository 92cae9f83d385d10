r"""Pure sketching math of Gonen & Shalev-Shwartz, "Faster SGD Using Sketched Conditioning".

Everything here is stateless and works under ``jax.jit`` and ``jax.vmap``. A
conditioner is kept in the factored inverse form of Lemma 2,

.. math::

  A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - Q Q^\top),

as a :class:`Factor`. The sketched conditioner (Algorithm 1), the exact rank-k
conditioner (Section 2.2) and the full conditioner :math:`A = C^{1/2}`
(Theorem 1) are all returned in this one form, so they are interchangeable.

Numerics (where the paper assumes ``rank(C) >= k`` and ``a > 0``): every
eigenvalue used to form ``B^{-1}`` and the tail mean ``a^2 = (tr C - tr Q^T C Q) / (n - k)``
are clamped from below by ``floor = max(eigenvalue_floor * tr(C) / n, tiny)``,
so a rank-deficient ``C`` gives a finite conditioner that amplifies no direction
by more than ``1 / sqrt(eigenvalue_floor)`` relative to the average scale
``sqrt(tr(C) / n)``. A zero, or non-finite, ``C`` gives the identity factor
(plain SGD), never NaN or Inf.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from scsgd_jax._src import defaults

__all__ = [
    "Factor",
    "apply_inverse",
    "bound_terms",
    "conditioner_matrix",
    "diagonal_factor",
    "full_factor",
    "identity_factor",
    "inverse_matrix",
    "low_rank_factor",
    "nystrom_factor",
    "precondition_kernel",
    "sketched_factor",
    "sketched_factor_from_data",
]

_TINY = 1e-30


class Factor(NamedTuple):
  r"""The factored inverse conditioner of Lemma 2.

  .. math:: A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - Q Q^\top)

  Two further forms keep a conditioner in the fewest floats and products:

  - diagonal: ``q = b_inv = None`` (``k = 0``) and ``a_inv`` a vector ``(n,)``,
    ``A^{-1} = diag(a_inv)`` (:func:`diagonal_factor`);
  - dense: ``q = None`` and ``b_inv`` the ``(n, n)`` matrix ``A^{-1}`` itself (``a_inv`` a scalar 0),
    the full conditioner applied in one product (:func:`dense_factor`).

  Attributes:
    q: ``(n, k)`` matrix with orthonormal columns (``None`` for a diagonal or dense factor).
    b_inv: ``(k, k)`` symmetric positive definite matrix ``B^{-1}`` (``None`` for a diagonal
      factor; ``A^{-1}`` for a dense one).
    a_inv: scalar ``a^{-1} >= 0`` applied on the orthogonal complement of ``Q``
      (irrelevant when ``k == n``); or the diagonal's vector ``(n,)``. ``None`` rather than
      empty arrays keeps the state checkpointable (orbax refuses zero-size arrays).
  """

  q: jax.Array
  b_inv: jax.Array
  a_inv: jax.Array

  @property
  def dim(self) -> int:
    if self.q is not None:
      return self.q.shape[-2]
    return self.a_inv.shape[-1] if self.b_inv is None else self.b_inv.shape[-1]

  @property
  def rank(self) -> int:
    if self.q is not None:
      return self.q.shape[-1]
    return 0 if self.b_inv is None else self.b_inv.shape[-1]


def _floor(trace: jax.Array, n: int, eigenvalue_floor: float) -> jax.Array:
  return jnp.maximum(eigenvalue_floor * trace / n, _TINY)


def _inv_sqrt_psd(mat: jax.Array, floor: jax.Array) -> jax.Array:
  """``mat^{-1/2}`` of a symmetric PSD matrix with eigenvalues floored."""
  evals, evecs = jnp.linalg.eigh(0.5 * (mat + mat.T))
  evals = jnp.maximum(evals, floor)
  return (evecs * jax.lax.rsqrt(evals)[None, :]) @ evecs.T


def _finite_or_identity(factor: Factor, trace: jax.Array) -> Factor:
  """Replaces a factor of a zero or non-finite ``C`` by the identity (Lemma 2 with B = I, a = 1)."""
  ok = jnp.isfinite(trace) & (trace > _TINY)
  ok &= jnp.all(jnp.isfinite(factor.a_inv))
  if factor.q is None and factor.b_inv is None:
    return factor._replace(a_inv=jnp.where(ok, factor.a_inv, jnp.ones_like(factor.a_inv)))
  if factor.q is None:  # dense
    ok &= jnp.all(jnp.isfinite(factor.b_inv))
    ident = jnp.eye(factor.b_inv.shape[-1], dtype=factor.b_inv.dtype)
    return factor._replace(b_inv=jnp.where(ok, factor.b_inv, ident))
  ok &= jnp.all(jnp.isfinite(factor.q)) & jnp.all(jnp.isfinite(factor.b_inv))
  n, k = factor.q.shape
  ident = identity_factor(n, k, factor.q.dtype)
  # An orthonormal Q is still needed when falling back: use the first k axes.
  ident = ident._replace(a_inv=jnp.ones_like(factor.a_inv))
  return jax.tree.map(lambda f, i: jnp.where(ok, f, i), factor, ident)


def identity_factor(n: int, k: int, dtype=jnp.float32) -> Factor:
  """The factor of ``A = I`` (plain SGD), with ``Q`` the first ``k`` coordinate axes."""
  return Factor(
      q=jnp.eye(n, k, dtype=dtype),
      b_inv=jnp.eye(k, dtype=dtype),
      a_inv=jnp.ones((), dtype),
  )


def _top_eigenvectors(mat: jax.Array, k: int) -> jax.Array:
  """The ``k`` leading eigenvectors (columns, descending eigenvalues) of a symmetric matrix."""
  _, evecs = jnp.linalg.eigh(0.5 * (mat + mat.T))  # ascending
  return evecs[:, ::-1][:, :k]


def _factor_from_compressed(
    q: jax.Array, c_tilde: jax.Array, trace: jax.Array, eigenvalue_floor: float
) -> Factor:
  """``B^{-1} = C~^{-1/2}`` and ``a^{-1} = sqrt((n-k)/(tr C - tr C~))`` from ``C~ = Q^T C Q`` (Algorithm 1, Theorem 2)."""
  n, k = q.shape
  floor = _floor(trace, n, eigenvalue_floor)
  b_inv = _inv_sqrt_psd(c_tilde, floor)
  a_inv = _tail_inverse(trace, jnp.trace(c_tilde), n, k, floor)
  return _finite_or_identity(Factor(q, b_inv, a_inv.astype(c_tilde.dtype)), trace)


def _tail_inverse(trace, captured, n: int, k: int, floor) -> jax.Array:
  """``a^{-1} = sqrt((n - k) / (tr C - captured))`` (Theorem 2), the tail mean floored; 0 when ``k == n``."""
  if k == n:
    return jnp.zeros((), jnp.result_type(trace))
  return jnp.sqrt((n - k) / jnp.maximum(trace - captured, (n - k) * floor))


def _factor_from_basis(
    q: jax.Array, c: jax.Array, trace: jax.Array, eigenvalue_floor: float
) -> Factor:
  """The factor of basis ``Q`` for a dense ``C``: ``C~ = Q^T C Q``, then :func:`_factor_from_compressed`."""
  return _factor_from_compressed(q, q.T @ (c @ q), trace, eigenvalue_floor)


def sketched_factor(
    key: jax.Array,
    correlation: jax.Array,
    rank: int,
    *,
    oversample: int = defaults.SKETCH_OVERSAMPLE,
    power_iterations: int = 1,
    eigenvalue_floor: float = defaults.SKETCH_EIGENVALUE_FLOOR,
) -> Factor:
  r"""Sketched conditioner of Algorithm 1 computed from a correlation matrix ``C``.

  With ``r = rank + oversample`` and :math:`\Omega \in \mathbb{R}^{n \times r}`
  with i.i.d. :math:`\mathcal{N}(0, 1/r)` entries: ``P = QR(C Omega)`` (after
  ``power_iterations`` subspace iterations, Halko-Martinsson-Tropp Alg. 4.4), the
  top-``rank`` eigenvectors ``U'_k`` of the small ``r x r`` matrix ``P^T C P``,
  ``Q = P U'_k``, ``B^{-1} = (Q^T C Q)^{-1/2}`` and
  ``a^{-1} = sqrt((n - k) / (tr C - tr Q^T C Q))``.

  When ``C = X X^T / m``, ``P^T C P = (P^T X)(P^T X)^T / m``, so ``U'`` is exactly
  the left singular basis of ``Y = P^T X`` in Algorithm 1; sketching ``C`` rather
  than ``X`` applies the range finder to ``X X^T``, i.e. one free power step.
  Cost: ``O(n^2 r (1 + power_iterations) + n r^2)``.

  Args:
    key: PRNG key for :math:`\Omega`.
    correlation: ``(n, n)`` symmetric PSD matrix ``C``.
    rank: ``k`` with ``0 < k <= n`` (``k = n`` gives ``A = C^{1/2}``).
    oversample: extra sketch columns, ``r = k + oversample`` (capped at ``n``).
    power_iterations: subspace iterations to sharpen the range (0 for the paper's
      plain range finder).
    eigenvalue_floor: relative eigenvalue floor, see the module docstring.

  Returns:
    A :class:`Factor` of rank ``k``.
  """
  c = jnp.asarray(correlation)
  n = c.shape[-1]
  _check_sketch_rank(rank, n)
  r = min(rank + oversample, n)
  c = 0.5 * (c + c.T)
  trace = jnp.trace(c)
  omega = jax.random.normal(key, (n, r), c.dtype) / jnp.sqrt(jnp.asarray(r, c.dtype))
  # Scale-free range finding: dividing C by its trace changes nothing but keeps
  # the power iterations inside the float range for extreme scales.
  c_unit = c / jnp.where(trace > _TINY, trace, 1.0)
  p, _ = jnp.linalg.qr(c_unit @ omega)
  for _ in range(power_iterations):
    p, _ = jnp.linalg.qr(c_unit @ p)
  q = p @ _top_eigenvectors(p.T @ (c_unit @ p), rank)
  return _factor_from_basis(q, c, trace, eigenvalue_floor)


def sketched_factor_from_data(
    key: jax.Array,
    x: jax.Array,
    rank: int,
    *,
    oversample: int = defaults.SKETCH_OVERSAMPLE,
    power_iterations: int = 0,
    eigenvalue_floor: float = defaults.SKETCH_EIGENVALUE_FLOOR,
) -> Factor:
  r"""Algorithm 1 on the data matrix ``X`` (``n x m``, columns are examples), in ``O(m n k)``.

  ``Z = X Omega`` with :math:`\Omega \in \mathbb{R}^{m \times r}` i.i.d.
  :math:`\mathcal{N}(0, 1/r)`; ``P = QR(Z)``; ``Y = P^T X``; SVD
  ``Y = U' S' V'^T`` (its ``U'`` taken as the eigenvectors of ``Y Y^T``, ``r x r``); ``Q = P U'_k``; ``C~ = Q^T C Q`` with ``C = X X^T / m``
  (formed as ``(Q^T X)(Q^T X)^T / m``, never materialising ``C``);
  ``B^{-1} = C~^{-1/2}``; ``a^{-1} = sqrt((n - k) / (tr C - tr C~))``.
  ``power_iterations`` > 0 applies ``Z <- X (X^T Z)`` with re-orthonormalisation
  (Halko-Martinsson-Tropp); 0 is the paper's algorithm.
  """
  x = jnp.asarray(x)
  n, m = x.shape
  _check_sketch_rank(rank, n)
  r = min(rank + oversample, n)
  omega = jax.random.normal(key, (m, r), x.dtype) / jnp.sqrt(jnp.asarray(r, x.dtype))
  p, _ = jnp.linalg.qr(x @ omega)
  for _ in range(power_iterations):
    p, _ = jnp.linalg.qr(x @ (x.T @ p))
  y = p.T @ x
  # U' of the SVD Y = U' S' V'^T = the eigenvectors of the r x r matrix Y Y^T (as Lemma 3 states it):
  # O(m r^2), never forms V' (m x m), and stays r x r even when m < r.
  q = p @ _top_eigenvectors(y @ y.T, rank)
  qx = q.T @ x
  return _factor_from_compressed(q, qx @ qx.T / m, jnp.sum(x * x) / m, eigenvalue_floor)


def nystrom_factor(
    sketch_y: jax.Array,
    omega: jax.Array,
    trace: jax.Array,
    rank: int,
    *,
    eigenvalue_floor: float = defaults.SKETCH_EIGENVALUE_FLOOR,
) -> Factor:
  r"""Sketched conditioner from a streamed sketch ``Y = C Omega``: single-pass Nystrom, then Algorithm 1's ``B``, ``a``.

  ``C`` itself is never needed, so a statistic can keep the ``O(n r)`` pair
  ``(Y, tr C)`` instead of the ``O(n^2)`` matrix. The fixed-rank PSD
  approximation of Tropp, Yurtsever, Udell & Cevher (2017, Alg. 3): with a
  shift :math:`\mu = \sqrt{n}\,\epsilon\,\|Y\|`, ``Y_mu = Y + mu Omega``,
  ``L = chol(Omega^T Y_mu)``, ``E = Y_mu L^{-T}``, ``E = U S V^T``; then
  :math:`C \approx U (S^2 - \mu) U^\top`. The top-``rank`` columns give ``Q``,
  ``C~ = Q^T C Q ~ diag(S^2 - mu)`` gives ``B^{-1} = C~^{-1/2}``, and the tail
  ``a^{-1} = sqrt((n - k) / (tr C - tr C~))`` as in Theorem 2. The Nystrom
  approximation is below ``C`` in the PSD order, so the tail mass is never
  under-counted. Eigenvalues are floored as in the module docstring.

  Args:
    sketch_y: ``(n, r)``, ``C Omega`` (or an EMA of ``C_t Omega``).
    omega: ``(n, r)`` test matrix with orthonormal columns (``r >= rank``).
    trace: ``tr C``.
    rank: ``k <= r``.
    eigenvalue_floor: relative eigenvalue floor.

  Returns:
    A :class:`Factor` of rank ``k``. Cost ``O(n r^2)``.

  References:
    Tropp, Yurtsever, Udell & Cevher, Fixed-rank approximation of a positive-semidefinite
    matrix from streaming data, NeurIPS 2017.
  """
  y = jnp.asarray(sketch_y)
  n, r = y.shape
  _check_sketch_rank(rank, r)
  trace = jnp.asarray(trace, y.dtype)
  # Scale-free: work with C / tr C so that extreme scales stay in range.
  unit = jnp.where(trace > _TINY, trace, 1.0)
  y_unit = y / unit
  eps = jnp.finfo(y.dtype).eps
  shift = jnp.sqrt(jnp.asarray(n, y.dtype)) * eps * jnp.linalg.norm(y_unit) + eps
  y_shift = y_unit + shift * omega
  small = omega.T @ y_shift
  chol = jnp.linalg.cholesky(0.5 * (small + small.T))
  e = jax.scipy.linalg.solve_triangular(chol, y_shift.T, lower=True).T
  u, s, _ = jnp.linalg.svd(e, full_matrices=False)
  evals = jnp.maximum(s[:rank] ** 2 - shift, 0.0) * unit
  q = u[:, :rank]
  floor = _floor(trace, n, eigenvalue_floor)
  b_inv = jnp.diag(jax.lax.rsqrt(jnp.maximum(evals, floor)))
  a_inv = _tail_inverse(trace, jnp.sum(evals), n, rank, floor)
  return _finite_or_identity(Factor(q, b_inv, a_inv.astype(y.dtype)), trace)


def diagonal_factor(
    diagonal: jax.Array, *, eigenvalue_floor: float = defaults.SKETCH_EIGENVALUE_FLOOR
) -> Factor:
  r"""``A = diag(C)^{1/2}``: exact Theorem 1 when ``C`` is diagonal (one-hot inputs of an embedding).

  Returned as a rank-0 :class:`Factor` whose tail ``a_inv`` is the vector
  :math:`\max(d_i, \text{floor})^{-1/2}`, so ``A^{-1} v = a_inv * v`` costs ``O(n)``.
  For a non-diagonal ``C`` it is the Jacobi conditioner (per-input RMS
  normalisation). A zero or non-finite diagonal gives the identity.
  """
  d = jnp.asarray(diagonal)
  n = d.shape[-1]
  trace = jnp.sum(d)
  a_inv = jax.lax.rsqrt(jnp.maximum(d, _floor(trace, n, eigenvalue_floor)))
  return _finite_or_identity(Factor(None, None, a_inv), trace)


def low_rank_factor(
    correlation: jax.Array,
    rank: int,
    *,
    eigenvalue_floor: float = defaults.SKETCH_EIGENVALUE_FLOOR,
) -> Factor:
  """Exact rank-k conditioner of Section 2.2: ``Q = U_k`` (top-k eigenvectors of ``C``), ``B = C~^{1/2}``, ``a`` of Theorem 2.

  Costs a full ``O(n^3)`` eigendecomposition; it is the oracle the sketch approximates.
  """
  c = jnp.asarray(correlation)
  n = c.shape[-1]
  _check_sketch_rank(rank, n)
  c = 0.5 * (c + c.T)
  return _factor_from_basis(_top_eigenvectors(c, rank), c, jnp.trace(c), eigenvalue_floor)


def full_factor(
    correlation: jax.Array, *, eigenvalue_floor: float = defaults.SKETCH_EIGENVALUE_FLOOR
) -> Factor:
  """Full conditioner ``A = C^{1/2}`` of Theorem 1, as a rank-``n`` :class:`Factor`.

  ``Q`` holds all eigenvectors, ``B^{-1} = diag(lambda)^{-1/2}`` (floored) and
  ``a^{-1} = 0`` (``I - Q Q^T = 0``).
  """
  c = jnp.asarray(correlation)
  n = c.shape[-1]
  c = 0.5 * (c + c.T)
  trace = jnp.trace(c)
  evals, evecs = jnp.linalg.eigh(c)
  evals = jnp.maximum(evals, _floor(trace, n, eigenvalue_floor))
  factor = Factor(evecs, jnp.diag(jax.lax.rsqrt(evals)), jnp.zeros((), c.dtype))
  return _finite_or_identity(factor, trace)


def dense_factor(factor: Factor) -> Factor:
  """``factor`` in its dense form: ``A^{-1}`` as one ``(n, n)`` matrix (``q = None``, ``a_inv = 0``).

  The same conditioner; for a full-rank factor (``k = n``, :func:`full_factor`) it halves the floats kept
  (``n^2`` against ``2 n^2``) and :func:`apply_inverse` costs one product instead of three.
  """
  return Factor(None, inverse_matrix(factor), jnp.zeros((), factor.a_inv.dtype))


def apply_inverse(factor: Factor, v: jax.Array) -> jax.Array:
  r"""``A^{-1} v`` in ``O(n k)`` per column (Lemma 2).

  Uses :math:`A^{-1} v = a^{-1} v + Q (B^{-1} - a^{-1} I) Q^\top v` (one product for a dense factor).

  Args:
    factor: the conditioner.
    v: a vector ``(n,)`` or a batch of columns ``(n, m)``.
  """
  q, b_inv, a_inv = factor
  if a_inv.ndim == 1:  # diagonal conditioner (k == 0)
    return (a_inv[:, None] if v.ndim == 2 else a_inv) * v
  if q is None:  # dense: b_inv is A^{-1}
    return b_inv @ v
  qtv = q.T @ v
  inner = b_inv @ qtv - a_inv * qtv
  return a_inv * v + q @ inner


def precondition_kernel(
    factor: Factor, grad: jax.Array, input_axes: Optional[Sequence[int]] = None
) -> jax.Array:
  r"""Conditions a kernel gradient on its input side: ``G A^{-1}`` in the paper's ``(out, in)`` layout.

  The kernel's ``input_axes`` are the axes contracted with the layer input
  (default: all but the last, as for Dense ``(n, p)`` and Conv
  ``(kh, kw, cin, cout)`` read as ``(kh*kw*cin, cout)``); attention's query
  kernel ``(in, heads, head_dim)`` has ``input_axes=(0,)``, its output kernel
  ``(heads, head_dim, out)`` has ``(0, 1)``. The gradient is read as the matrix
  ``(n, p)`` with ``n`` the product of the input axes (in kernel order) and
  ``A^{-1} G`` is returned in the kernel's layout: the update of Equation
  (updateGeneric), :math:`W \leftarrow W - \eta\, \delta (A^{-1} x)^\top`.
  Computed in ``float32`` (or wider) and cast back to the gradient's dtype.
  """
  dtype = jnp.promote_types(grad.dtype, jnp.float32)
  g, restore = kernel_matrix(grad, input_axes)
  cast = Factor(*(None if a is None else a.astype(dtype) for a in factor))
  return restore(apply_inverse(cast, g.astype(dtype))).astype(grad.dtype)


def kernel_matrix(kernel: jax.Array, input_axes: Optional[Sequence[int]] = None):
  """``kernel`` as the matrix ``(n, p)`` over its ``input_axes`` (default: all but the last; ``n`` their product,
  in kernel order), and ``restore(matrix) -> array`` that puts a matrix of that shape back in the kernel's layout."""
  if input_axes is None:
    input_axes = tuple(range(kernel.ndim - 1))
  axes = tuple(a % kernel.ndim for a in input_axes)
  perm = axes + tuple(a for a in range(kernel.ndim) if a not in axes)
  identity = perm == tuple(range(kernel.ndim))
  moved = kernel if identity else jnp.transpose(kernel, perm)
  n = math.prod(moved.shape[:len(axes)])

  def restore(matrix):
    out = matrix.reshape(moved.shape)
    return out if identity else jnp.transpose(out, tuple(perm.index(a) for a in range(kernel.ndim)))

  return moved.reshape(n, -1), restore


def inverse_matrix(factor: Factor) -> jax.Array:
  """Dense ``A^{-1}`` (``n x n``), for tests and diagnostics."""
  return apply_inverse(factor, jnp.eye(factor.dim, dtype=factor.a_inv.dtype))


def conditioner_matrix(factor: Factor) -> jax.Array:
  """Dense ``A = Q B Q^T + a (I - Q Q^T)`` (Equation lowCond), for tests and diagnostics.

  ``a = 1 / a^{-1}`` (taken as 0 when ``a^{-1} = 0``, i.e. a full-rank factor).
  """
  q, b_inv, a_inv = factor
  a = jnp.where(a_inv > 0, 1.0 / jnp.where(a_inv > 0, a_inv, 1.0), 0.0)
  if a_inv.ndim == 1:
    return jnp.diag(a)
  evals, evecs = jnp.linalg.eigh(0.5 * (b_inv + b_inv.T))
  b = (evecs / evals[None, :]) @ evecs.T
  if q is None:  # dense: A = (A^{-1})^{-1}
    return b
  n = q.shape[-2]
  return q @ b @ q.T + a * (jnp.eye(n, dtype=q.dtype) - q @ q.T)


class BoundTerms(NamedTuple):
  """The two terms of Lemma 1's bound, ``tr(A)`` and ``tr(A^{-1} C)``."""

  trace_a: jax.Array
  trace_a_inv_c: jax.Array


def bound_terms(factor: Factor, correlation: jax.Array) -> BoundTerms:
  r"""``tr(A)`` and ``tr(A^{-1} C)`` of Lemma 1 (the bound is :math:`\frac{\sigma\rho}{\sqrt T}(\mathrm{tr}A + \mathrm{tr}A^{-1}C)`).

  Computed from the factor in ``O(n^2 k)`` without inverting ``A``:
  ``tr(A) = tr(B) + a (n - k)`` and ``tr(A^{-1} C) = tr(B^{-1} Q^T C Q) + a^{-1} (tr C - tr Q^T C Q)``.
  """
  q, b_inv, a_inv = factor
  c = jnp.asarray(correlation)
  if a_inv.ndim == 1:  # diagonal conditioner
    a = jnp.where(a_inv > 0, 1.0 / jnp.where(a_inv > 0, a_inv, 1.0), 0.0)
    return BoundTerms(jnp.sum(a), jnp.sum(a_inv * jnp.diagonal(c)))
  if q is None:  # dense: tr(A) from the eigenvalues of A^{-1}
    return BoundTerms(jnp.sum(1.0 / jnp.linalg.eigvalsh(0.5 * (b_inv + b_inv.T))), jnp.sum(b_inv * c.T))
  n, k = q.shape[-2], q.shape[-1]
  evals = jnp.linalg.eigvalsh(0.5 * (b_inv + b_inv.T))
  trace_b = jnp.sum(1.0 / evals)
  a = jnp.where(a_inv > 0, 1.0 / jnp.where(a_inv > 0, a_inv, 1.0), 0.0)
  c_tilde = q.T @ c @ q
  trace_a = trace_b + a * (n - k)
  trace_a_inv_c = jnp.trace(b_inv @ c_tilde) + a_inv * (jnp.trace(c) - jnp.trace(c_tilde))
  return BoundTerms(trace_a, trace_a_inv_c)


def _check_sketch_rank(rank: int, n: int) -> None:
  if not isinstance(rank, int) or isinstance(rank, bool):
    raise TypeError(f"rank must be a Python int, got {rank!r} of type {type(rank).__name__}.")
  if not 0 < rank <= n:
    raise ValueError(
        f"rank must satisfy 0 < rank <= n, got rank={rank} for a correlation of dimension n={n} "
        "(rank = n gives the full conditioner A = C^{1/2}, as full_factor does)."
    )
