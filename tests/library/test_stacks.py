"""Stacked kernels (a layer inside ``nnx.scan``/``nnx.vmap``/``nn.scan``): each slice is conditioned as the same
layer unstacked would be, with its own statistics and factor (exact, same seed)."""


import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax import serialization

import scsgd_jax as sk

D, L, V, STEPS = 8, 3, 11, 3
IDS = jax.random.randint(jax.random.PRNGKey(1), (4, 6), 0, V)


def _tx(input_axes, **options):
  # dense statistics, one refresh phase: the plans of a stack's slices and of the unstacked layers are equal
  return sk.scsgd(
      0.1,
      sk.Conditioning(statistics=sk.Statistics(kind="dense"), refresh=sk.Refresh(stagger=False), input_axes=input_axes),
      **options)


def _loss(logits):
  return optax.softmax_cross_entropy_with_integer_labels(logits, IDS).mean()


# ------------------------------------------------------------------------------------------------ NNX


class Block(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(2, D, qkv_features=D, decode=False, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class ScannedLM(nnx.Module):
  """A transformer as Flax's NNX docs scan one: blocks made by ``nnx.vmap``, run by ``nnx.scan``."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.blocks = make(rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, ids):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(self.embed(ids), self.blocks))


class UnrolledLM(nnx.Module):
  """The same model with its blocks as separate layers holding the scanned model's slices."""

  def __init__(self, scanned):
    scanned = nnx.clone(scanned)
    self.embed, self.head = scanned.embed, scanned.head
    self.blocks = nnx.List([Block(nnx.Rngs(0)) for _ in range(L)])
    stacked = nnx.state(scanned.blocks, nnx.Param)
    for i, block in enumerate(self.blocks):
      nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stacked))

  def __call__(self, ids):
    x = self.embed(ids)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _train_nnx(model, tx, steps=STEPS):
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(m):
      logits, li = sk.capture_nnx(m, IDS, max_rows=None)
      return _loss(logits), li

    (loss, li), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, layer_inputs=li)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(steps)]
  return optimizer, losses


def _slice_params(stacked, i):
  return jax.tree.map(lambda a: np.asarray(a)[i], stacked)


def test_nnx_scan_transformer_each_slice_updated_as_the_unrolled_model():
  scanned = ScannedLM(nnx.Rngs(0))
  unrolled = UnrolledLM(scanned)
  opt_s, loss_s = _train_nnx(scanned, _tx(sk.input_axes_nnx(scanned)))
  opt_u, loss_u = _train_nnx(unrolled, _tx(sk.input_axes_nnx(unrolled)))
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  stacked = nnx.as_pure(nnx.state(scanned.blocks, nnx.Param))
  for i, block in enumerate(unrolled.blocks):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 _slice_params(stacked, i), nnx.as_pure(nnx.state(block, nnx.Param)))
  summary = nnx.as_pure(opt_s.opt_state)[0].summary()
  assert summary["blocks/up/kernel"] == "dense C, full C^(1/2), n=8, per layer of a stack (3,)"
  assert summary["blocks/attn/out/kernel"] == "dense C, full C^(1/2), n=8, per layer of a stack (3,)"
  # the conditioning did something: the update is not SGD's
  assert summary["head/kernel"].startswith("dense C")


def _functional_steps(model, tx, steps, x=IDS, loss=_loss):
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # plain dicts, as a msgpack checkpoint holds them
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    def loss_fn(p):
      logits, li = sk.capture_nnx(nnx.merge(nnx.graphdef(model), nnx.State(p)), x, max_rows=None)
      return loss(logits), li

    (_, li), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, state = tx.update(grads, state, params, layer_inputs=li)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params, state


def _models():
  from tests.library import test_layers, test_recipes
  images = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)), jnp.float32)
  mean = lambda out: jnp.mean(jnp.square(out))
  return {"scan": (ScannedLM(nnx.Rngs(0)), IDS, _loss),
          "einsum": (test_recipes.GemmaStyle(nnx.Rngs(0)), IDS, mean),
          "grouped_conv": (test_layers._Mixed(nnx.Rngs(0)), images, mean)}


@pytest.mark.parametrize("kind", ["scan", "einsum", "grouped_conv"])
def test_state_planned_at_init_never_changes_shape_and_restores_into_a_fresh_optimizer(kind):
  """With the layouts read from the model (``input_axes_nnx``), init plans every kernel as its layer reads it:
  the state after training has init's shapes and summary, so the ordinary restore into a freshly built
  optimizer works (msgpack here; orbax restores by the same template)."""
  model, x, loss = _models()[kind]
  tx = sk.scsgd(0.1, sk.Conditioning(input_axes=sk.input_axes_nnx(model)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  fresh = tx.init(params)
  _, trained = _functional_steps(model, tx, 2, x, loss)
  shapes = lambda state: [(jax.tree_util.keystr(k), np.shape(v)) for k, v in jax.tree_util.tree_leaves_with_path(state)]
  assert shapes(trained) == shapes(fresh)
  restored = serialization.from_bytes(sk.scsgd(0.1, sk.Conditioning(input_axes=sk.input_axes_nnx(model))).init(params),
                                      serialization.to_bytes(trained))
  jax.tree.map(np.testing.assert_array_equal, restored, trained)
  conditioned = {p: why for p, why in trained[0].summary().items() if not why.startswith("not conditioned")}
  assert conditioned and conditioned == {p: fresh[0].summary()[p] for p in conditioned}  # the plan in use is init's


def test_stack_without_input_axes_is_stepped_plainly_naming_the_fix():
  """init reads a stacked kernel by the default axes (one matrix); the capture says a stack of layers: plans are
  fixed at init, so the first update steps it plainly (Nesterov SGD's first step), naming the kernel and
  input_axes_nnx."""
  model = ScannedLM(nnx.Rngs(0))
  tx = sk.scsgd(0.1, max_relative_step=None)  # the plain step itself (the step bound aside: test_bound)
  params = nnx.as_pure(nnx.state(model, nnx.Param))

  def loss_fn(p):
    logits, li = sk.capture_nnx(nnx.merge(nnx.graphdef(model), p), IDS, max_rows=None)
    return _loss(logits), li

  (_, li), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  with pytest.warns(UserWarning, match=r"plain updates.*blocks/up/kernel .*\(3, 8, 16\) read as Layout\("
                    r"input_axes=\(0,\), stack=1, groups=1\) \(n=8\).*input_axes_nnx"):
    updates, _ = tx.update(grads, tx.init(params), params, layer_inputs=li)
  np.testing.assert_allclose(updates["blocks"]["up"]["kernel"], -0.1 * 1.9 * grads["blocks"]["up"]["kernel"],
                             rtol=1e-6)


class Member(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(D, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, V, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


class Ensemble(nnx.Module):
  """An ensemble as NNX writes it: members made and run by ``nnx.vmap``."""

  def __init__(self, rngs, members=4):
    @nnx.split_rngs(splits=members)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Member(rngs)

    self.members = make(rngs)

  def __call__(self, x):
    return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(self.members, x)


def test_nnx_vmap_ensemble_each_member_updated_as_if_trained_alone():
  x = jax.random.normal(jax.random.PRNGKey(2), (32, D))
  y = jax.random.randint(jax.random.PRNGKey(3), (32,), 0, V)
  ens = Ensemble(nnx.Rngs(0))
  stacked0 = nnx.as_pure(nnx.state(ens.members, nnx.Param))

  def train(model, sum_members):
    opt = nnx.Optimizer(model, _tx(sk.input_axes_nnx(model)), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      def loss_fn(m):
        logits, li = sk.capture_nnx(m, x, max_rows=None)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.broadcast_to(y, logits.shape[:-1])).mean(-1)
        return (jnp.sum(losses) if sum_members else losses), li

      (_, li), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      opt.update(model, grads, layer_inputs=li)

    for _ in range(STEPS):
      step(model, opt)
    return opt

  opt = train(ens, True)
  assert nnx.as_pure(opt.opt_state)[0].summary()["members/l1/kernel"].endswith("per layer of a stack (4,)")
  stacked = nnx.as_pure(nnx.state(ens.members, nnx.Param))
  for i in range(4):
    alone = Member(nnx.Rngs(0))
    nnx.update(alone, _slice_params(stacked0, i))
    train(alone, False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 _slice_params(stacked, i), nnx.as_pure(nnx.state(alone, nnx.Param)))


# ---------------------------------------------------------------------------------------------- Linen


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    x = x + nn.MultiHeadDotProductAttention(2, qkv_features=D, name="attn")(x)
    h = nn.Dense(2 * D, name="up")(nn.LayerNorm(name="norm")(x))
    return x + nn.Dense(D, name="down")(jax.nn.gelu(h)), None


class LinenScanned(nn.Module):
  """A Linen transformer scanning its blocks as Flax's docs do, the captured collection listed next to params."""
  collections: tuple = ("params", "layer_inputs")

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(V, D, name="embed")(ids)
    stack = nn.scan(LinenBlock, variable_axes={c: 0 for c in self.collections}, split_rngs={"params": True},
                    length=L)
    x, _ = stack(name="blocks")(x, None)
    return nn.Dense(V, name="head")(x)


class LinenUnrolled(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(V, D, name="embed")(ids)
    for i in range(L):
      x, _ = LinenBlock(name=f"block_{i}")(x)
    return nn.Dense(V, name="head")(x)


def _train_linen(model, params, steps=STEPS):
  tx = _tx(sk.input_axes_linen(model, {"params": params}, IDS))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    def loss_fn(p):
      logits, li = sk.capture_linen(model, {"params": p}, IDS, max_rows=None)
      return _loss(logits), li

    (loss, li), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, state = tx.update(grads, state, params, layer_inputs=li)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return params, state, losses


def test_linen_scan_transformer_each_slice_updated_as_the_unrolled_model():
  scanned = LinenScanned()
  params = scanned.init(jax.random.PRNGKey(0), IDS)["params"]
  unrolled_params = {"embed": params["embed"], "head": params["head"],
                     **{f"block_{i}": _slice_params(params["blocks"], i) for i in range(L)}}
  p_s, state, loss_s = _train_linen(scanned, params)
  p_u, _, loss_u = _train_linen(LinenUnrolled(), unrolled_params)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  for i in range(L):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 _slice_params(p_s["blocks"], i), p_u[f"block_{i}"])
  assert state[0].summary()["blocks/up/kernel"] == "dense C, full C^(1/2), n=8, per layer of a stack (3,)"


def test_linen_scan_without_the_collection_is_planned_plain_naming_the_fix_and_trains_zero_config_too():
  """A stack whose nn.scan drops the captured collection: input_axes_linen and capture_linen agree that its kernels
  are plain (the fix named), the recipe plans them plain, and zero-config (which planned them) steps them plainly
  with a warning at the first update: never a crash."""
  model = LinenScanned(collections=("params",))
  params = model.init(jax.random.PRNGKey(0), IDS)["params"]
  axes = sk.input_axes_linen(model, {"params": params}, IDS)
  _, li = sk.capture_linen(model, {"params": params}, IDS)
  fix = r"nn.scan.*'layer_inputs': 0"
  for path in ("blocks/up/kernel", "blocks/down/kernel"):
    assert isinstance(axes[path], sk.Plain) and re.search(fix, axes[path].why), axes[path]
    assert re.search(fix, li.unconditioned[path]) and "up" not in li.get("blocks", {})
  assert isinstance(axes["head/kernel"], sk.Layout)
  recipe = sk.plans(jax.eval_shape(_tx(axes).init, params))
  assert "not conditioned" in recipe["blocks/up/kernel"] and "n=" in recipe["head/kernel"]
  for given in (axes, None):
    tx = _tx(given, max_relative_step=None)  # the plain step itself (the step bound aside: test_bound)
    state = tx.init(params)
    (loss, li), grads = jax.value_and_grad(
        lambda p: (lambda out: (_loss(out[0]), out[1]))(sk.capture_linen(model, {"params": p}, IDS)),
        has_aux=True)(params)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      updates, state = tx.update(grads, state, params, layer_inputs=li)
    assert all(np.isfinite(u).all() for u in jax.tree.leaves(updates))
    # plain Nesterov SGD's first step: -lr (1 + momentum) g
    np.testing.assert_allclose(updates["blocks"]["up"]["kernel"], -0.19 * grads["blocks"]["up"]["kernel"], rtol=1e-5)
    said = [str(w.message) for w in caught if "blocks/up/kernel" in str(w.message)]
    assert len(said) == (1 if given is None else 0), said  # zero-config planned it: the first update says so
