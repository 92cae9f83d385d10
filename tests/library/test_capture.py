"""Captured layer inputs against the layers' actual inputs and an explicit im2col."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import scsgd_jax as sk
from tests import helpers


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(3, 4, (3, 3), padding="VALID", rngs=rngs)
    self.conv2 = nnx.Conv(4, 5, (2, 3), strides=(2, 1), padding="SAME", kernel_dilation=(1, 2), rngs=rngs)
    self.head = nnx.Linear(5, 2, rngs=rngs)

  def __call__(self, x):
    h1 = nnx.relu(self.conv1(x))
    h2 = nnx.relu(self.conv2(h1))
    pooled = h2.mean(axis=(1, 2))
    return self.head(pooled), (h1, pooled)


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h1 = nn.relu(nn.Conv(4, (3, 3), padding="VALID")(x))
    h2 = nn.relu(nn.Conv(5, (2, 3), strides=(2, 1), padding="SAME", kernel_dilation=(1, 2))(h1))
    pooled = h2.mean(axis=(1, 2))
    return nn.Dense(2)(pooled), (h1, pooled)


def _same_pads(size, k, s, d):
  eff = (k - 1) * d + 1
  out = -(-size // s)
  total = max((out - 1) * s + eff - size, 0)
  return (total // 2, total - total // 2)


def _check(li, conv1, conv2, dense, x, h1, pooled):
  x, h1 = np.asarray(x), np.asarray(h1)
  np.testing.assert_allclose(li[conv1]["kernel"], helpers.im2col(x, (3, 3), (1, 1), (1, 1), [(0, 0), (0, 0)]), rtol=1e-6)
  pads = [_same_pads(h1.shape[1], 2, 2, 1), _same_pads(h1.shape[2], 3, 1, 2)]
  np.testing.assert_allclose(li[conv2]["kernel"], helpers.im2col(h1, (2, 3), (2, 1), (1, 2), pads), rtol=1e-6)
  np.testing.assert_allclose(li[dense]["kernel"], np.asarray(pooled), rtol=1e-6)


def test_nnx_capture_matches_actual_layer_inputs():
  model = NnxNet(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, 8, 3)), jnp.float32)
  (out, (h1, pooled)), li = sk.capture_nnx(model, x, max_rows=None)
  _check(li, "conv1", "conv2", "head", x, h1, pooled)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert {k for k in li} == {k for k in params}
  for name in li:
    n = int(np.prod(params[name]["kernel"].shape[:-1]))
    assert li[name]["kernel"].shape[-1] == n
  np.testing.assert_allclose(out, model(x)[0], rtol=1e-6)  # capture does not change the forward pass


def test_linen_capture_matches_actual_layer_inputs():
  model = LinenNet()
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 7, 8, 3)), jnp.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  (out, (h1, pooled)), li = sk.capture_linen(model, variables, x, max_rows=None)
  _check(li, "Conv_0", "Conv_1", "Dense_0", x, h1, pooled)
  assert set(li) == set(variables["params"])
  np.testing.assert_allclose(out, model.apply(variables, x)[0], rtol=1e-6)


def test_sampled_rows_are_rows_of_the_full_im2col():
  model = NnxNet(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 9, 9, 3)), jnp.float32)
  _, full = sk.capture_nnx(model, x, max_rows=None)
  _, sampled = nnx.jit(lambda m, x, k: sk.capture_nnx(m, x, rng=k, max_rows=10))(model, x, jax.random.PRNGKey(0))
  for name in ("conv1", "conv2"):
    f, s = np.asarray(full[name]["kernel"]), np.asarray(sampled[name]["kernel"])
    assert s.shape == (10, f.shape[1])
    d = np.abs(s[:, None, :] - f[None, :, :]).max(-1).min(-1)
    assert np.all(d < 1e-6)
  assert sampled["head"]["kernel"].shape == (3, 5)  # fewer rows than max_rows: kept whole


def test_shared_layer_rows_are_concatenated():
  class Shared(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
      return self.lin(self.lin(x))

  m = Shared(nnx.Rngs(0))
  x = jnp.ones((2, 3))
  _, li = sk.capture_nnx(m, x)
  np.testing.assert_allclose(li["lin"]["kernel"], np.concatenate([np.asarray(x), np.asarray(m.lin(x))]), rtol=1e-6)


def test_sampling_without_rng_is_a_clear_error_and_circular_padding_is_named():
  model = NnxNet(nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs a PRNG key"):
    sk.capture_nnx(model, jnp.ones((2, 9, 9, 3)), max_rows=4)
  # a layer kind the conditioning cannot read is left unconditioned, and the capture says why
  circ = nnx.Conv(4, 4, (3, 3), padding="CIRCULAR", rngs=nnx.Rngs(0))
  _, li = sk.capture_nnx(circ, jnp.ones((1, 5, 5, 4)))
  assert "CIRCULAR" in li.unconditioned["kernel"]


def test_linen_capture_feeds_scsgd_end_to_end():
  import optax

  model = LinenNet()
  x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 7, 8, 3)), jnp.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  params = variables["params"]
  tx = sk.scsgd(0.05, sk.Conditioning(rank=4, refresh=sk.Refresh(every=2),
                                      statistics=sk.Statistics(kind="dense")))  # every kernel, whatever its memory
  state = tx.init(params)

  @jax.jit
  def step(params, state, key):
    def loss_fn(p):
      (out, _), li = sk.capture_linen(model, {"params": p}, x, rng=key, max_rows=32)
      return jnp.mean(out ** 2), li

    (loss, li), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    u, state = tx.update(g, state, params, layer_inputs=li)
    return optax.apply_updates(params, u), state, loss

  losses = []
  for i in range(15):
    params, state, loss = step(params, state, jax.random.PRNGKey(i))
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert set(state[0].factors) == {"Conv_0/kernel", "Conv_1/kernel", "Dense_0/kernel"}
