"""The README's recipes as written, on models with BatchNorm (a mutable collection): a Linen ResNet with
``TrainState`` and an NNX CNN. The first step is checked against a hand-computed conditioned update."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import scsgd_jax


class ResBlock(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
    y = nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(y))
    return nn.relu(x + y)


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
    x = ResBlock()(x, train)
    return nn.Dense(4)(jnp.mean(x, axis=(1, 2)))


class TrainState(train_state.TrainState):
  batch_stats: Any


def _data(seed, n=16):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, 8, 8, 3)).astype(np.float32)
  y = (x[..., 0].mean(axis=(1, 2)) > 0).astype(np.int32) + 2 * (x[..., 1].mean(axis=(1, 2)) > 0)
  return jnp.asarray(x), jnp.asarray(y)


def test_linen_resnet_with_batchnorm_trains_with_the_readme_recipe():
  model = ResNet()
  x0, _ = _data(0)
  variables = model.init(jax.random.PRNGKey(0), x0)
  state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=scsgd_jax.scsgd(0.05),
                            batch_stats=variables["batch_stats"])

  @jax.jit
  def train_step(state, x, y, key):  # the README's Linen recipe
    def loss_fn(params):
      logits, layer_inputs, updates = scsgd_jax.capture_linen(
          model, {"params": params, "batch_stats": state.batch_stats}, x, train=True, rng=key,
          mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, (layer_inputs, updates)
    (loss, (layer_inputs, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = scsgd_jax.apply_gradients(state, grads=grads, layer_inputs=layer_inputs,
                                      batch_stats=updates["batch_stats"])
    return state, loss, grads, layer_inputs

  kernels = jax.eval_shape(state.tx.init, state.params)[0].summary()
  assert len(kernels) == 4  # three convs and the head, all conditioned
  first = state
  state, loss0, grads, rows = train_step(state, *_data(0), jax.random.PRNGKey(1))
  # the head's first update by hand: Nesterov SGD (lr 0.05, momentum 0.9: 1.9 g at step 0) on A^{-1} G, with
  # A = C^{1/2} (n = 8) of the warm start's first fold: the batch's C, the weight not yet filled (1 - nu)
  # by the isotropic tr(C)/n I, eigenvalues floored at 1e-2 tr(C)/n
  x_head = np.asarray(rows["Dense_0"]["kernel"], np.float64)
  c = x_head.T @ x_head / x_head.shape[0]
  c = c + (1 - 0.05) * np.trace(c) / 8 * np.eye(8)
  w, v = np.linalg.eigh(c)
  w = np.maximum(w, 1e-2 * np.trace(c) / 8)
  a_inv = (v / np.sqrt(w)) @ v.T
  expected = np.asarray(first.params["Dense_0"]["kernel"]) - 0.05 * 1.9 * a_inv @ np.asarray(grads["Dense_0"]["kernel"])
  np.testing.assert_allclose(state.params["Dense_0"]["kernel"], expected, rtol=2e-4, atol=2e-5)
  assert not np.allclose(state.batch_stats["BatchNorm_0"]["mean"], first.batch_stats["BatchNorm_0"]["mean"])
  losses = [float(loss0)]
  for i in range(1, 40):
    state, loss, _, _ = train_step(state, *_data(i % 4), jax.random.PRNGKey(i))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.mean(nnx.relu(self.bn(self.conv(x))), axis=(1, 2)))


def test_nnx_model_with_batchnorm_trains_with_the_readme_recipe():
  model = NNXNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, scsgd_jax.scsgd(0.05), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y, key):  # the README's NNX recipe
    def loss_fn(model):
      logits, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), layer_inputs
    (loss, layer_inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, layer_inputs=layer_inputs)
    return loss

  mean0 = np.asarray(model.bn.mean[...])
  losses = [float(train_step(model, optimizer, *_data(i % 4), jax.random.PRNGKey(i))) for i in range(40)]
  assert not np.allclose(model.bn.mean[...], mean0)  # the batch statistics were updated in place
  assert len(optimizer.opt_state[0].factors) == 2  # conv and head conditioned
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
