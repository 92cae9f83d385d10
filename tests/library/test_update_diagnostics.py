"""update_diagnostics: each kernel's gradient, step and weight norms against numpy, under jit; the leaves it skips."""

import jax
import jax.numpy as jnp
import numpy as np

import scsgd_jax as sk


def test_norms_and_relative_step_equal_numpy_for_every_kernel_and_skip_the_rest():
  rng = np.random.default_rng(0)
  shapes = {"embed": {"embedding": (7, 4)}, "blocks": {"kernel": (2, 4, 3)}, "dense": {"kernel": (3, 2), "bias": (2,)},
            "zero": {"kernel": (2, 2)}}
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  params["zero"]["kernel"] = jnp.zeros((2, 2))
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  updates = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32) * 1e-2, params)
  got = jax.jit(sk.update_diagnostics)(grads, updates, params)
  assert set(got) == {"embed/embedding", "blocks/kernel", "dense/kernel", "zero/kernel"}
  for path, d in got.items():
    a, b = path.split("/")
    g, u, w = (np.asarray(t[a][b], np.float64) for t in (grads, updates, params))
    np.testing.assert_allclose(d["grad_norm"], np.linalg.norm(g), rtol=1e-5)
    np.testing.assert_allclose(d["update_norm"], np.linalg.norm(u), rtol=1e-5)
    np.testing.assert_allclose(d["param_norm"], np.linalg.norm(w), rtol=1e-5)
    want = np.linalg.norm(u) / np.linalg.norm(w) if np.linalg.norm(w) > 0 else 0.0
    np.testing.assert_allclose(d["relative_step"], want, rtol=1e-5)
  assert float(got["zero/kernel"]["relative_step"]) == 0.0


def test_kernel_filter_chooses_the_leaves():
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
  got = sk.update_diagnostics(params, params, params, kernel_filter=lambda path, leaf: path.endswith("bias"))
  assert set(got) == {"dense/bias"}
  np.testing.assert_allclose(got["dense/bias"]["relative_step"], 1.0)
