"""The experiments' models: shapes, the paper's LeNet dimensions, Xavier (Caffe) initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.run import models


@pytest.mark.parametrize("name,shape", [("lenet", (3, 28, 28, 1)), ("svhn_net", (3, 32, 32, 3))])
def test_forward_shapes_and_xavier_init(name, shape):
  model = models.create_model(name, seed=0, num_classes=10, input_shape=shape[1:])
  assert model(jnp.zeros(shape)).shape == (3, 10)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for layer, p in params.items():
    kernel = np.asarray(p["kernel"])
    fan_in = int(np.prod(kernel.shape[:-1]))
    bound = np.sqrt(3.0 / fan_in)
    assert np.abs(kernel).max() <= bound, layer
    if kernel.size >= 500:  # uniform on the whole interval, not a narrower one
      assert np.abs(kernel).max() > 0.95 * bound, layer
      np.testing.assert_allclose(kernel.std(), bound / np.sqrt(3), rtol=0.15)
    np.testing.assert_array_equal(p["bias"], 0.0)


def test_lenet_layer_dims_match_the_paper():
  model = models.LeNet(rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert params["conv1"]["kernel"].shape == (5, 5, 1, 20)
  assert params["conv2"]["kernel"].shape == (5, 5, 20, 50)
  assert params["dense1"]["kernel"].shape == (800, 500)
  assert params["dense2"]["kernel"].shape == (500, 10)


def test_logistic_regression_starts_at_zero_and_is_linear():
  model = models.create_model("logreg", seed=0, num_classes=10, input_shape=(28, 28, 1))
  x = np.random.default_rng(0).random((3, 28, 28, 1)).astype(np.float32)
  np.testing.assert_array_equal(model(jnp.asarray(x)), 0.0)
  model.dense.kernel[...] = jnp.ones((784, 10))
  np.testing.assert_allclose(model(jnp.asarray(x)), np.repeat(x.reshape(3, -1).sum(1, keepdims=True), 10, 1), rtol=1e-5)


def test_char_transformer_is_causal_and_sized_for_the_benchmark():
  model = models.create_model("char_transformer", seed=0, num_classes=65, input_shape=(64,))
  params = nnx.state(model, nnx.Param)
  count = sum(x.size for x in jax.tree.leaves(params))
  assert 500_000 <= count <= 1_000_000, count
  ids = np.random.default_rng(0).integers(0, 65, (2, 64))
  out = np.asarray(model(jnp.asarray(ids)))
  changed = ids.copy()
  changed[:, 40:] = (changed[:, 40:] + 1) % 65  # the future must not change the past's logits
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(changed)))[:, :40], out[:, :40], rtol=1e-5, atol=1e-5)


def test_two_d_attention_is_causal_softmax_attention_head_by_head():
  """CausalSelfAttention against numpy: per head, softmax(q k^T / sqrt(dh) + causal mask) v, then out."""
  attn = models.CausalSelfAttention(8, 2, nnx.Rngs(0))
  x = np.random.default_rng(1).normal(size=(2, 5, 8)).astype(np.float32)
  mask = nnx.make_causal_mask(jnp.zeros((2, 5)))
  got = np.asarray(attn(jnp.asarray(x), mask))
  wqkv, bqkv = np.asarray(attn.qkv.kernel[...]), np.asarray(attn.qkv.bias[...])
  q, k, v = np.split(x @ wqkv + bqkv, 3, axis=-1)
  heads = []
  for h in range(2):
    s = q[..., 4 * h:4 * h + 4] @ np.swapaxes(k[..., 4 * h:4 * h + 4], 1, 2) / 2.0
    s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    heads.append((p / p.sum(-1, keepdims=True)) @ v[..., 4 * h:4 * h + 4])
  want = np.concatenate(heads, -1) @ np.asarray(attn.out.kernel[...]) + np.asarray(attn.out.bias[...])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
