"""The convex experiment: conditioners beat SGD on a fast-decaying spectrum; Theorem 1's ordering; end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

import scsgd_jax as sk
from configs.paper import convex_smoke
from experiments.paper.convex import experiment as convex_experiment
from experiments.paper.convex import problem as convex
from experiments.paper.convex import report as convex_report

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies



def _problem(seed=0, n=30, m=3000, p=3):
  """Inputs with a fast-decaying spectrum (scales 3 * 0.7^i) and labels from a noisy linear teacher."""
  rng = np.random.default_rng(seed)
  u, _ = np.linalg.qr(rng.standard_normal((n, n)))
  x = (rng.standard_normal((m, n)) * (3 * 0.7 ** np.arange(n))) @ u.T
  teacher = rng.standard_normal((n, p)) * 2
  scores = x @ teacher + rng.gumbel(size=(m, p))
  return x.astype(np.float32), scores.argmax(1).astype(np.int32)


def test_every_conditioner_beats_sgd_on_fast_spectral_decay():
  x, y = _problem()
  c = x.T @ x / x.shape[0]
  _, l_star, grad_norm = convex.solve_optimum(x, y, 3, 1000)  # 300 steps stop at 4e-4 .. 1.2e-3 by compile flags
  assert grad_norm < 1e-3
  factors = convex.make_conditioners(c, x, [4], jax.random.PRNGKey(0), oversample=6)
  grid = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
  steps = 2000
  evals = convex.eval_steps(steps, 5)
  final = {}
  for name, f in factors.items():
    xc = np.asarray(sk.sketch.apply_inverse(f, jnp.asarray(x).T).T)
    ws = convex.run_sgd(x, xc, y, 3, grid, 1, steps, evals, seed=0)
    final[name] = float(np.min(convex.losses(x, y, ws[-1]))) - l_star
  for name in ("full", "lowrank_4", "sketch_4"):
    assert final[name] < final["sgd"], final


def test_bound_terms_follow_theorems_1_to_3():
  x, _ = _problem(1)
  c = jnp.asarray(x.T @ x / x.shape[0])
  root = float(jnp.sum(jnp.sqrt(jnp.clip(jnp.linalg.eigvalsh(c), 0))))
  factors = convex.make_conditioners(np.asarray(c), x, [2, 4, 8], jax.random.PRNGKey(0), oversample=6)
  products = {}
  for name, f in factors.items():
    t = sk.sketch.bound_terms(f, c)
    products[name] = float(t.trace_a * t.trace_a_inv_c)
  # Theorem 1: A = C^{1/2} minimises tr(A) tr(A^{-1} C), the minimum being tr(C^{1/2})^2.
  # (up to the eigenvalue floor, 1e-5 tr(C)/n, which the smallest eigenvalues here fall below)
  np.testing.assert_allclose(products["full"], root ** 2, rtol=3e-3)
  for name, v in products.items():
    assert v >= root ** 2 * (1 - 1e-4), (name, v, root ** 2)
  # Theorem 2's a makes the rank-k bound shrink toward the optimum as k grows, and beat A = I.
  assert products["lowrank_2"] > products["lowrank_4"] > products["lowrank_8"] > products["full"] * (1 - 1e-4)
  assert products["sgd"] > products["lowrank_2"]


def test_command_runs_end_to_end_on_a_tiny_subset(tmp_path):
  config = convex_smoke.get_config()
  config.download = False
  with tfds.testing.mock_data(num_examples=2000):
    result = convex_experiment.run_experiment(config)
  path = convex_report.write_report(result, str(tmp_path), "python -m experiments.paper.convex --config configs/paper/convex_smoke.py")
  text = open(path).read()
  assert "Lemma 3" in text and "tr(C^(1/2))" in text
  for f in ("results.json", "spectrum.png", "suboptimality_batch1.png", "suboptimality_batch16.png", "timing.png"):
    assert (tmp_path / f).exists(), f
  assert set(result["methods"]) == {"sgd", "full", "lowrank_5", "lowrank_10", "sketch_5", "sketch_10"}
  for r in result["lemmas"].values():
    assert np.isfinite(r["lemma3_mean"]) and r["lemma3_mean"] >= 1 - 1e-3
