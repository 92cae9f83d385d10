"""Layer-wise grafting against hand-derived updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scsgd_jax as sk
from tests import helpers


def _fixed(matrix):
  """A transformation multiplying every leaf's flattened update by ``matrix`` (a direction oracle)."""
  return optax.GradientTransformation(lambda p: optax.EmptyState(),
                                      lambda u, s, p=None: (jax.tree.map(lambda g: (matrix @ g.ravel()).reshape(g.shape), u), s))


def test_grafted_update_has_the_direction_of_one_and_the_norm_of_the_other():
  rng = np.random.default_rng(0)
  g = {"a": jnp.asarray(rng.standard_normal(4), jnp.float32), "b": jnp.asarray(rng.standard_normal(4), jnp.float32)}
  matrix = jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)
  tx = sk.contrib.scale_by_grafting(optax.scale(3.0), _fixed(matrix))
  u, _ = tx.update(g, tx.init(g))
  for k in g:
    d = np.asarray(matrix) @ np.asarray(g[k])
    np.testing.assert_allclose(u[k], d * 3 * np.linalg.norm(g[k]) / np.linalg.norm(d), rtol=1e-5)


def test_a_zero_direction_stays_zero_and_finite():
  g = {"a": jnp.ones(3)}
  tx = sk.contrib.scale_by_grafting(optax.scale(1.0), optax.scale(0.0))
  u, _ = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(u["a"], np.zeros(3))


def test_conditioned_sgd_grafted_onto_normalized_rmsprop_first_two_steps():
  """Steps 1 and 2 of chain(graft(normalized RMSprop, full conditioning), Nesterov SGD) by hand:
  d = C^{-1/2} G (C the paper's EMA from I), m = n / (sqrt(v_hat) + eps) for n = G / |G|, the update
  d |m| / |d| per leaf, then Nesterov momentum; the bias takes its raw gradient's direction."""
  rng = np.random.default_rng(1)
  nu, lr, mom, decay, eps = 0.3, 0.1, 0.9, 0.99, 1e-8
  params = {"dense": {"kernel": jnp.zeros((5, 2)), "bias": jnp.zeros(2)}}
  tx = optax.chain(
      sk.contrib.scale_by_grafting(
          sk.contrib.scale_by_normalized_rms(decay, eps),
          sk.scale_by_sketched_conditioning(
              sk.Conditioning(conditioner=sk.Conditioner(kind="full"),
                              statistics=sk.Statistics(kind="dense", ema_rate=nu, fold_every=1),
                              refresh=sk.Refresh(warm_start=False, every=1)))),
      optax.sgd(lr, momentum=mom, nesterov=True))
  state = tx.init(params)
  c, v, trace = np.eye(5), {"kernel": np.zeros((5, 2)), "bias": np.zeros(2)}, {"kernel": 0.0, "bias": 0.0}
  for t in (1, 2):
    x = rng.standard_normal((16, 5))
    grads = {"kernel": rng.standard_normal((5, 2)), "bias": rng.standard_normal(2)}
    updates, state = tx.update(jax.tree.map(jnp.asarray, {"dense": grads}), state, params,
                               layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
    c = (1 - nu) * c + nu * x.T @ x / 16
    for name, g in grads.items():
      d = helpers.psd_power(c, -0.5) @ g if name == "kernel" else g
      n = g / np.linalg.norm(g)
      v[name] = decay * v[name] + (1 - decay) * n ** 2
      m = n / (np.sqrt(v[name] / (1 - decay ** t)) + eps)
      grafted = d * np.linalg.norm(m) / np.linalg.norm(d)
      trace[name] = grafted + mom * trace[name]
      expected = -lr * (grafted + mom * trace[name])
      np.testing.assert_allclose(updates["dense"][name], expected, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: sk.contrib.scale_by_grafting(optax.scale(1.0), optax.scale(1.0), eps=0.0),
                                  lambda: sk.contrib.scale_by_normalized_rms(decay=1.0),
                                  lambda: sk.contrib.scale_by_normalized_rms(eps=-1.0)])
def test_bad_arguments_are_named(make):
  with pytest.raises(ValueError, match="eps|decay"):
    make()
