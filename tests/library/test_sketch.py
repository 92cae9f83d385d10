"""The pure functions against dense numpy oracles (Lemma 2, Algorithm 1, Section 2.2, Theorem 1, Lemma 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scsgd_jax as sk
from tests import helpers


def _spd(rng, k):
  m = rng.standard_normal((k, k))
  return m @ m.T + k * np.eye(k)


def _decaying_data(rng, n, m, decay=0.3):
  """X (n x m) with singular values exp(-decay * i): the fast spectral decay of Theorem 3."""
  u = helpers.orthonormal(rng, n, n)
  return (u * np.exp(-decay * np.arange(n))) @ rng.standard_normal((n, m))


def _random_factor(rng, n, k):
  q = helpers.orthonormal(rng, n, k)
  b = _spd(rng, k)
  a = 0.7
  dense_a = q @ b @ q.T + a * (np.eye(n) - q @ q.T)
  factor = sk.sketch.Factor(jnp.asarray(q, jnp.float32), jnp.asarray(np.linalg.inv(b), jnp.float32),
                     jnp.asarray(1 / a, jnp.float32))
  return factor, dense_a


def test_apply_inverse_matches_dense_inverse():
  rng = np.random.default_rng(0)
  n, k = 12, 4
  factor, dense_a = _random_factor(rng, n, k)
  dense_inv = np.linalg.inv(dense_a)
  v = rng.standard_normal(n)
  batch = rng.standard_normal((n, 5))
  np.testing.assert_allclose(sk.sketch.apply_inverse(factor, jnp.asarray(v, jnp.float32)), dense_inv @ v,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(sk.sketch.apply_inverse(factor, jnp.asarray(batch, jnp.float32)), dense_inv @ batch,
                             rtol=1e-4, atol=1e-5)
  # A conv kernel gradient (kh, kw, cin, cout) = (2, 2, 3, 7) is the (12, 7) matrix.
  g = rng.standard_normal((2, 2, 3, 7))
  out = sk.sketch.precondition_kernel(factor, jnp.asarray(g, jnp.float32))
  assert out.shape == g.shape
  np.testing.assert_allclose(out.reshape(12, 7), dense_inv @ g.reshape(12, 7), rtol=1e-4, atol=1e-5)


def test_dense_factor_is_the_same_conditioner_in_one_matrix():
  """dense_factor keeps A^{-1} as one (n, n) matrix: every function reads it as the factor it came from."""
  rng = np.random.default_rng(11)
  factor, dense_a = _random_factor(rng, 10, 3)
  c = jnp.asarray(_spd(rng, 10), jnp.float32)
  for f, oracle_a in ((factor, dense_a), (sk.sketch.full_factor(c), helpers.psd_power(np.asarray(c, np.float64), 0.5))):
    dense = sk.sketch.dense_factor(f)
    assert dense.q is None and dense.b_inv.shape == (10, 10) and dense.dim == dense.rank == 10
    np.testing.assert_allclose(dense.b_inv, np.linalg.inv(oracle_a), rtol=1e-3, atol=1e-4)
    g = jnp.asarray(rng.standard_normal((2, 5, 7)), jnp.float32)  # input axes (0, 1): n = 10
    np.testing.assert_allclose(sk.sketch.precondition_kernel(dense, g), sk.sketch.precondition_kernel(f, g), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(sk.sketch.conditioner_matrix(dense), oracle_a, rtol=1e-3, atol=1e-3)


def test_lemma2_a_times_a_inverse_is_identity():
  rng = np.random.default_rng(1)
  factor, dense_a = _random_factor(rng, 10, 3)
  np.testing.assert_allclose(dense_a @ np.asarray(sk.sketch.inverse_matrix(factor)), np.eye(10), atol=1e-5)
  np.testing.assert_allclose(sk.sketch.conditioner_matrix(factor), dense_a, rtol=1e-4, atol=1e-5)
  assert np.all(np.linalg.eigvalsh(dense_a) > 0)


@pytest.mark.parametrize("from_data", [False, True])
def test_rank_n_sketch_equals_full_conditioner(from_data):
  rng = np.random.default_rng(2)
  n, m = 8, 200
  x = rng.standard_normal((n, m)) * np.linspace(0.5, 2.0, n)[:, None]
  c = x @ x.T / m
  key = jax.random.PRNGKey(0)
  if from_data:
    f = sk.sketch.sketched_factor_from_data(key, jnp.asarray(x, jnp.float32), n)
  else:
    f = sk.sketch.sketched_factor(key, jnp.asarray(c, jnp.float32), n)
  expected = np.linalg.inv(helpers.psd_power(c, 0.5))
  np.testing.assert_allclose(sk.sketch.inverse_matrix(f), expected, rtol=2e-3, atol=2e-3)
  np.testing.assert_allclose(sk.sketch.inverse_matrix(sk.sketch.full_factor(jnp.asarray(c, jnp.float32))), expected,
                             rtol=2e-3, atol=2e-3)


def test_low_rank_factor_matches_section_2_2():
  rng = np.random.default_rng(3)
  n, k = 10, 3
  x = _decaying_data(rng, n, 300)
  c = x @ x.T / 300
  w, v = np.linalg.eigh(c)
  w, v = w[::-1], v[:, ::-1]
  a = np.sqrt((np.trace(c) - w[:k].sum()) / (n - k))
  dense_a = v[:, :k] @ np.diag(np.sqrt(w[:k])) @ v[:, :k].T + a * (np.eye(n) - v[:, :k] @ v[:, :k].T)
  f = sk.sketch.low_rank_factor(jnp.asarray(c, jnp.float32), k)
  np.testing.assert_allclose(sk.sketch.inverse_matrix(f), np.linalg.inv(dense_a), rtol=1e-3, atol=1e-3)
  # With r = k + oversample >= n the range finder spans R^n, so the sketch is the exact rank-k factor.
  s = sk.sketch.sketched_factor(jax.random.PRNGKey(1), jnp.asarray(c, jnp.float32), k, oversample=n)
  np.testing.assert_allclose(sk.sketch.inverse_matrix(s), np.linalg.inv(dense_a), rtol=1e-3, atol=1e-3)


def test_sketch_from_data_and_from_correlation_agree_with_exact_low_rank_on_a_gap():
  rng = np.random.default_rng(4)
  n, m, k = 40, 500, 5
  u = helpers.orthonormal(rng, n, n)
  s = np.concatenate([np.full(k, 10.0), np.full(n - k, 0.1)])
  x = (u * s) @ rng.standard_normal((n, m)) / np.sqrt(m) * np.sqrt(m)
  c = x @ x.T / m
  exact = np.asarray(sk.sketch.inverse_matrix(sk.sketch.low_rank_factor(jnp.asarray(c, jnp.float32), k)))
  f_c = sk.sketch.sketched_factor(jax.random.PRNGKey(0), jnp.asarray(c, jnp.float32), k)
  f_x = sk.sketch.sketched_factor_from_data(jax.random.PRNGKey(0), jnp.asarray(x, jnp.float32), k, power_iterations=1)
  for f in (f_c, f_x):
    np.testing.assert_allclose(np.asarray(sk.sketch.inverse_matrix(f)), exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def test_lemma3_range_finder_error_within_twice_best_rank_k():
  """E ||Q Q^T X - X||_F <= 2 ||X - X_k||_F (Lemma 3), averaged over 30 seeds, plain Algorithm 1."""
  rng = np.random.default_rng(5)
  n, m = 60, 400
  x = _decaying_data(rng, n, m, decay=0.15)
  sv = np.linalg.svd(x, compute_uv=False)
  for k in (3, 8, 15):
    best = np.sqrt(np.sum(sv[k:] ** 2))
    errs = []
    for seed in range(30):
      f = sk.sketch.sketched_factor_from_data(jax.random.PRNGKey(seed), jnp.asarray(x, jnp.float32), k,
                                       oversample=k, power_iterations=0)
      q = np.asarray(f.q, np.float64)
      errs.append(np.linalg.norm(q @ (q.T @ x) - x))
    assert np.mean(errs) <= 2 * best, (k, np.mean(errs), best)
    assert np.mean(errs) >= best * (1 - 1e-3)  # never better than the optimum (Eckart-Young)


def test_bound_terms_match_dense_traces_and_theorem1_optimality():
  rng = np.random.default_rng(6)
  n = 15
  x = _decaying_data(rng, n, 200)
  c = x @ x.T / 200
  cj = jnp.asarray(c, jnp.float32)
  for f in (sk.sketch.full_factor(cj), sk.sketch.low_rank_factor(cj, 4), sk.sketch.sketched_factor(jax.random.PRNGKey(0), cj, 4),
            sk.sketch.dense_factor(sk.sketch.full_factor(cj))):
    a = np.asarray(sk.sketch.conditioner_matrix(f), np.float64)
    t = sk.sketch.bound_terms(f, cj)
    np.testing.assert_allclose(t.trace_a, np.trace(a), rtol=2e-3)
    np.testing.assert_allclose(t.trace_a_inv_c, np.trace(np.linalg.inv(a) @ c), rtol=2e-3)
  full = sk.sketch.bound_terms(sk.sketch.full_factor(cj), cj)
  root = np.trace(helpers.psd_power(c, 0.5))
  np.testing.assert_allclose(full.trace_a, root, rtol=2e-3)
  np.testing.assert_allclose(full.trace_a_inv_c, root, rtol=2e-3)


@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-12, 1e12])
def test_degenerate_and_extreme_correlations_stay_finite(scale):
  rng = np.random.default_rng(7)
  n, k = 20, 5
  low = rng.standard_normal((n, 2))  # rank 2 < k
  c = jnp.asarray(scale * low @ low.T, jnp.float32)
  for f in (sk.sketch.sketched_factor(jax.random.PRNGKey(0), c, k), sk.sketch.low_rank_factor(c, k), sk.sketch.full_factor(c),
            sk.sketch.dense_factor(sk.sketch.full_factor(c)),
            sk.sketch.sketched_factor_from_data(jax.random.PRNGKey(0), jnp.asarray(np.sqrt(scale) * low, jnp.float32), k)):
    for leaf in jax.tree.leaves(f):
      assert np.all(np.isfinite(np.asarray(leaf))), (scale, f)
    g = sk.sketch.precondition_kernel(f, jnp.ones((n, 3), jnp.float32))
    assert np.all(np.isfinite(np.asarray(g)))


def test_zero_correlation_gives_identity():
  f = sk.sketch.sketched_factor(jax.random.PRNGKey(0), jnp.zeros((6, 6)), 2)
  np.testing.assert_allclose(sk.sketch.inverse_matrix(f), np.eye(6), atol=1e-6)


def test_functions_jit_and_vmap():
  rng = np.random.default_rng(8)
  cs = []
  for _ in range(3):
    x = rng.standard_normal((9, 50))
    cs.append(x @ x.T / 50)
  cs = jnp.asarray(np.stack(cs), jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  batched = jax.jit(jax.vmap(lambda c, k: sk.sketch.sketched_factor(k, c, 3)))(cs, keys)
  for i in range(3):
    single = sk.sketch.sketched_factor(keys[i], cs[i], 3)
    np.testing.assert_allclose(sk.sketch.inverse_matrix(jax.tree.map(lambda a: a[i], batched)),
                               sk.sketch.inverse_matrix(single), rtol=1e-3, atol=1e-4)


def test_rank_errors_name_the_problem():
  with pytest.raises(ValueError, match="rank=7.*n=6"):
    sk.sketch.sketched_factor(jax.random.PRNGKey(0), jnp.eye(6), 7)
  with pytest.raises(TypeError, match="rank must be a Python int"):
    sk.sketch.low_rank_factor(jnp.eye(6), 2.5)
