"""The README's recipes as written, on models with BatchNorm (a mutable collection): a Linen ResNet with
``TrainState`` and an NNX CNN. The first step is checked against a hand-computed conditioned update."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import scsgd_jax
from tests.helpers import kernel_lines


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
  tx = scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_linen(model, variables, x0)))
  state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
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

  kernels = kernel_lines(jax.eval_shape(state.tx.init, state.params)[0].summary())
  assert len(kernels) == 4  # three convs and the head, all conditioned
  first = state
  state, loss0, grads, rows = train_step(state, *_data(0), jax.random.PRNGKey(1))
  # the head's first update by hand: Nesterov SGD (lr 0.05, momentum 0.9: 1.9 g at step 0) on A^{-1} G, with
  # A = C^{1/2} (n = 8) of the warm start's first fold: the batch's C, the weight not yet filled (the fold's
  # weight is 1 - (1 - nu)^2, folding every other step) by the isotropic tr(C)/n I, eigenvalues floored at
  # 1e-2 tr(C)/n
  x_head = np.asarray(rows["Dense_0"]["kernel"], np.float64)
  c = x_head.T @ x_head / x_head.shape[0]
  c = c + (1 - 0.05) ** 2 * np.trace(c) / 8 * np.eye(8)
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


@nnx.jit
def _nnx_train_step(model, optimizer, x, y, key):  # the README's NNX recipe (also returns grads and rows)
  def loss_fn(model):
    logits, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), layer_inputs
  (loss, layer_inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads, layer_inputs=layer_inputs)
  return loss, grads, layer_inputs


def test_nnx_model_with_batchnorm_trains_with_the_readme_recipe():
  model = NNXNet(nnx.Rngs(0))
  tx = scsgd_jax.scsgd(
      0.05, scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(model,
                                                                       _data(0)[0])))  # the README's, given a batch
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train_step = lambda *a: _nnx_train_step(*a)[0]

  mean0 = np.asarray(model.bn.mean[...])
  losses = [float(train_step(model, optimizer, *_data(i % 4), jax.random.PRNGKey(i))) for i in range(40)]
  assert not np.allclose(model.bn.mean[...], mean0)  # the batch statistics were updated in place
  assert len(optimizer.opt_state[0].factors) == 2  # conv and head conditioned
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


# --- models with Einsum/DenseGeneral kernels of non-default layouts: the recipes as written, no input_axes=

D, N, H, F, V = 8, 2, 3, 12, 11  # features, heads, head dim, hidden, vocabulary


class GemmaStyle(nnx.Module):
  """A Gemma-style block (its Einsum layouts): q (N, D, H) and out (N, H, D) Einsums, a gated MLP whose
  down-projection kernel is (F, D) read by axis 0 and up-projection (2, D, F) by axis 1, and a
  LinearGeneral with two output axes: none of these input axes is the name-based default."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.q = nnx.Einsum("BTD,NDH->BTNH", (N, D, H), rngs=rngs)
    self.kv = nnx.LinearGeneral(D, (2, N, H), use_bias=False, rngs=rngs)
    self.out = nnx.Einsum("BTNH,NHD->BTD", (N, H, D), rngs=rngs)
    self.up = nnx.Einsum("BTD,GDF->GBTF", (2, D, F), rngs=rngs)
    self.down = nnx.Einsum("BTF,FD->BTD", (F, D), rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    q, (k, v) = self.q(x), jnp.moveaxis(self.kv(x), -3, 0)
    weights = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H), axis=-1)
    x = x + self.out(jnp.einsum("bnts,bsnh->btnh", weights, v))
    gate, up = self.up(x)
    return self.head(x + self.down(jax.nn.gelu(gate) * up))


# the true input axes, as a reader of the equations above gives them (the defaults: all but the last axis)
GEMMA_AXES = {p: scsgd_jax.Layout(a) for p, a in
              {"q/kernel": (1,), "kv/kernel": (0,), "out/kernel": (0, 1), "up/kernel": (1,), "down/kernel": (0,)}.items()}


def _tokens(seed):
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(0, V, (4, 6)), jnp.int32)
  return ids, jnp.roll(ids, -1, axis=1)


def _train_gemma(tx, steps):
  model = GemmaStyle(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  first = jax.tree.map(np.asarray, nnx.as_pure(nnx.state(model, nnx.Param)))
  out = [_nnx_train_step(model, optimizer, *_tokens(i), jax.random.PRNGKey(i)) for i in range(steps)]
  return model, optimizer, first, out


def test_gemma_style_nnx_model_trains_with_the_layouts_read_from_the_model():
  # input_axes_nnx reads each kernel's axes from the model's layers; init plans them (fixed from then on)
  assert scsgd_jax.input_axes_nnx(GemmaStyle(nnx.Rngs(0))) | GEMMA_AXES == scsgd_jax.input_axes_nnx(
      GemmaStyle(nnx.Rngs(0)))
  dense = dict(statistics=scsgd_jax.Statistics(kind="dense"), conditioner=scsgd_jax.Conditioner(kind="full"))
  # without them init reads the defaults, which the equations contradict: those kernels are stepped plainly, named
  with pytest.warns(UserWarning, match=r"plain updates.*kv/kernel .*q/kernel .*input_axes_nnx"):
    _train_gemma(scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning(**dense)), 1)
  tx = scsgd_jax.scsgd(0.05,
                       scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(GemmaStyle(nnx.Rngs(0))), **dense))
  model, optimizer, first, out = _train_gemma(tx, 3)
  state = nnx.as_pure(optimizer.opt_state)[0]
  dims = {p: f.dim for p, f in state.factors.items() if p != "embed/embedding"}
  assert dims == {"q/kernel": D, "kv/kernel": D, "out/kernel": N * H, "up/kernel": D, "down/kernel": F,
                  "head/kernel": D}
  # the first update of q by hand: Nesterov SGD (1.9 g at step 0) on C^{-1/2} G over q's input axis 1 (n = D),
  # C the first fold's warm-started batch correlation (isotropic fill of the missing weight, floored)
  _, grads, rows = out[0]
  x = np.asarray(rows["q"]["kernel"], np.float64)
  c = x.T @ x / x.shape[0]
  c = c + (1 - 0.05) ** 2 * np.trace(c) / D * np.eye(D)  # the first fold weighs 1 - (1 - nu)^2 (every 2nd step)
  w, v = np.linalg.eigh(c)
  a_inv = (v / np.sqrt(np.maximum(w, 1e-2 * np.trace(c) / D))) @ v.T
  g = np.moveaxis(np.asarray(grads["q"]["kernel"]), 1, 0).reshape(D, -1)
  expected = np.moveaxis(-0.05 * 1.9 * (a_inv @ g).reshape(D, N, H), 0, 1)  # the update, in q's layout
  got = np.asarray(_train_gemma(tx, 1)[0].q.kernel[...], np.float64) - first["q"]["kernel"]
  np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
  # and the whole run equals one told the axes by hand (bitwise)
  explicit, _, _, _ = _train_gemma(
      scsgd_jax.scsgd(
          0.05,
          scsgd_jax.Conditioning(statistics=scsgd_jax.Statistics(kind="dense"),
                                 conditioner=scsgd_jax.Conditioner(kind="full"),
                                 input_axes=GEMMA_AXES)), 3)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(explicit, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_gemma_style_at_the_defaults_plans_true_n_within_adams_memory_under_nnx_optimizer():
  """At the defaults (statistics chosen by memory at init) with the model's layouts: the kernels are planned by
  their true n, nnx.Optimizer's state keeps init's structure and shapes, and the state stays within Adam's."""
  tx = scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(GemmaStyle(nnx.Rngs(0)))))
  model, optimizer, _, _ = _train_gemma(tx, 3)
  params = nnx.as_pure(nnx.state(GemmaStyle(nnx.Rngs(0)), nnx.Param))
  init = tx.init(params)[0]
  after = nnx.as_pure(optimizer.opt_state)[0]
  assert jax.tree.map(np.shape, after.statistics) == jax.tree.map(np.shape, init.statistics)
  assert jax.tree.map(np.shape, after.factors) == jax.tree.map(np.shape, init.factors)
  for path, n in {"q/kernel": D, "kv/kernel": D, "up/kernel": D, "out/kernel": N * H, "down/kernel": F}.items():
    assert after.summary()[path].endswith(f"n={n}") or f"n={n}," in after.summary()[path], after.summary()
  adam = sum(x.size for x in jax.tree.leaves(optax.adam(0.1).init(params)))
  state_floats = sum(np.size(x) for x in jax.tree.leaves(init)) + sum(
      x.size for x in jax.tree.leaves(optax.sgd(0.1, 0.9).init(params)))
  assert state_floats <= adam
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


class LinenGemmaStyle(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(V, D)(ids)
    q = nn.Einsum((N, D, H), "BTD,NDH->BTNH", name="q")(x)
    k, v = jnp.moveaxis(nn.DenseGeneral((2, N, H), use_bias=False, name="kv")(x), -3, 0)
    weights = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H), axis=-1)
    x = x + nn.Einsum((N, H, D), "BTNH,NHD->BTD", name="out")(jnp.einsum("bnts,bsnh->btnh", weights, v))
    return nn.Dense(V, name="head")(x)


def test_linen_einsum_model_trains_with_the_layouts_read_from_the_model():
  model = LinenGemmaStyle()
  ids, _ = _tokens(0)
  params = model.init(jax.random.PRNGKey(0), ids)["params"]
  axes = {p: scsgd_jax.Layout(a) for p, a in {"q/kernel": (1,), "kv/kernel": (0,), "out/kernel": (0, 1)}.items()}
  assert scsgd_jax.input_axes_linen(model, {"params": params}, ids) | axes == scsgd_jax.input_axes_linen(
      model, {"params": params}, ids)

  def run(tx):
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state, x, y, key):  # the README's Linen recipe, no mutable collections
      def loss_fn(params):
        logits, layer_inputs = scsgd_jax.capture_linen(model, {"params": params}, x, rng=key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), layer_inputs
      (loss, layer_inputs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
      return scsgd_jax.apply_gradients(state, grads=grads, layer_inputs=layer_inputs), loss

    for i in range(3):
      state, _ = train_step(state, *_tokens(i), jax.random.PRNGKey(i))
    return state

  dense = dict(statistics="dense", conditioner="full")
  with pytest.warns(UserWarning, match=r"plain updates.*q/kernel .*input_axes_linen"):  # init alone reads the
    run(scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning.from_flat(**dense)))  # defaults: stepped plainly, named
  read = scsgd_jax.input_axes_linen(model, {"params": params}, ids)  # the recipe: the same run as told by hand
  recipe, explicit = run(scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning.from_flat(input_axes=read, **dense))), run(
      scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning.from_flat(input_axes=axes, **dense)))
  assert jax.tree.map(np.shape, recipe.opt_state) == jax.tree.map(np.shape, explicit.opt_state)
  for a, b in zip(jax.tree.leaves(recipe.params), jax.tree.leaves(explicit.params)):
    np.testing.assert_array_equal(a, b)
  assert recipe.opt_state[0].summary() == explicit.opt_state[0].summary()
