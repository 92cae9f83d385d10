"""Fit with optax and Flax: inject_hyperparams, MultiSteps, chaining in front of AdamW, Linen TrainState; and a
small transformer language model (NNX and Linen) trained with scsgd at its defaults."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import scsgd_jax as sk

PARAMS = {"dense": {"kernel": jnp.zeros((40, 64)), "bias": jnp.zeros(64)}}


def _steps(tx, steps=4, seed=0):
  rng = np.random.default_rng(seed)
  params, state = PARAMS, tx.init(PARAMS)

  @jax.jit
  def step(params, state, x):
    g = jax.grad(lambda p: jnp.mean((x @ p["dense"]["kernel"] + p["dense"]["bias"][None, :] - 1.0) ** 2))(params)
    u, state = tx.update(g, state, params, layer_inputs={"dense": {"kernel": x}})
    return optax.apply_updates(params, u), state

  for _ in range(steps):
    params, state = step(params, state, jnp.asarray(rng.standard_normal((16, 40)), jnp.float32))
  return params, state


def test_inject_hyperparams_without_static_args_and_sketched():
  tx = optax.inject_hyperparams(sk.scsgd)(learning_rate=0.01, conditioning=sk.Conditioning(
      conditioner=sk.Conditioner(kind="sketched"), statistics=sk.Statistics(kind="dense")))
  params, state = _steps(tx)
  assert np.all(np.isfinite(np.asarray(params["dense"]["kernel"])))
  assert state.inner_state[0].factors["dense/kernel"].q.shape == (40, 32)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.01)


def test_inject_hyperparams_leaves_the_conditioning_as_given():
  """The settings that decide shapes (the rank, the options' integers) are fields of one object, which
  inject_hyperparams leaves alone: no static_args needed, and the rank acts as given."""
  c = sk.Conditioning(rank=4, statistics=sk.Statistics(oversample=3, kind="dense"), refresh=sk.Refresh(every=2),
                      conditioner=sk.Conditioner(kind="sketched"))
  tx = optax.inject_hyperparams(sk.scsgd)(learning_rate=0.01, conditioning=c)
  _, state = _steps(tx)
  assert state.inner_state[0].factors["dense/kernel"].q.shape == (40, 4)


def test_an_array_as_the_rank_is_refused_naming_it():
  with pytest.raises(ValueError, match=r"Conditioning.rank decides shapes.*must be a Python int"):
    sk.Conditioning(rank=jnp.int32(4))


def test_multisteps_conditions_with_the_last_micro_batch_only():
  """optax.MultiSteps calls the inner update once per k micro-batches, with that call's layer_inputs:
  the statistics see 1/k of the rows (pinned here; README documents it)."""
  k = 3
  inner = sk.scale_by_sketched_conditioning(
      sk.Conditioning(statistics=sk.Statistics(kind="dense", ema_rate=1.0), conditioner=sk.Conditioner(kind="full")))
  tx = optax.MultiSteps(inner, every_k_schedule=k)
  state = tx.init(PARAMS)
  rng = np.random.default_rng(1)
  xs = [jnp.asarray(rng.standard_normal((8, 40)), jnp.float32) for _ in range(k)]
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  for x in xs:
    _, state = tx.update(grads, state, PARAMS, layer_inputs={"dense": {"kernel": x}})
  c = sk.sketch.ema_correlation().correlation(state.inner_opt_state.statistics["dense/kernel"])
  np.testing.assert_allclose(c, xs[-1].T @ xs[-1] / 8, rtol=1e-5, atol=1e-6)


def test_conditioning_chained_in_front_of_adamw():
  """chain(conditioning, adamw): Adam's moments are taken of A^{-1} G, so its per-coordinate scaling
  acts in the conditioned coordinates; it runs, stays finite and differs from AdamW alone."""
  cond = optax.chain(sk.scale_by_sketched_conditioning(), optax.adamw(1e-2))
  plain = optax.adamw(1e-2)
  p_cond, _ = _steps(cond)
  p_plain, state = _steps(optax.chain(optax.identity(), plain))
  assert np.all(np.isfinite(np.asarray(p_cond["dense"]["kernel"])))
  assert not np.allclose(p_cond["dense"]["kernel"], p_plain["dense"]["kernel"], atol=1e-4)


def test_linen_train_state_recipe():
  model = nn.Dense(3)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((32, 5)), jnp.float32)
  y = x @ jnp.asarray(np.random.default_rng(3).standard_normal((5, 3)), jnp.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=variables["params"],
                                        tx=sk.scsgd(0.05, sk.Conditioning(statistics=sk.Statistics(kind="dense"))))

  @jax.jit
  def step(state):
    def loss_fn(params):
      out, li = sk.capture_linen(model, {"params": params}, x)
      return jnp.mean((out - y) ** 2), li

    (loss, li), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return sk.apply_gradients(state, grads=grads, layer_inputs=li), loss

  losses = []
  for _ in range(60):  # the step bound moves the kernel at most 2% of its norm a step: its target is 2x its norm away
    state, loss = step(state)
    losses.append(float(loss))
  assert int(state.step) == 60
  assert losses[-1] < 0.5 * losses[0]
  assert "kernel" in state.opt_state[0].factors


# ---------------------------------------------------------------- a small transformer LM

VOCAB, D, HEADS, CTX, BATCH = 16, 32, 4, 16, 16


def _markov_batches(seed, steps):
  """Sequences from a fixed sparse random Markov chain: next-token loss can fall far below log(VOCAB)."""
  rng = np.random.default_rng(123)
  trans = rng.dirichlet(np.full(VOCAB, 0.1), size=VOCAB)
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    seq = np.zeros((BATCH, CTX + 1), np.int32)
    seq[:, 0] = rng.integers(0, VOCAB, BATCH)
    for t in range(CTX):
      u = rng.random(BATCH)[:, None]
      seq[:, t + 1] = (np.cumsum(trans[seq[:, t]], axis=1) < u).sum(1).clip(0, VOCAB - 1)
    out.append((jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])))
  return out


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    x = x + nn.MultiHeadDotProductAttention(HEADS, dropout_rate=0.1, deterministic=False)(nn.LayerNorm()(x), mask=mask)
    return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, D)(ids) + self.param("pos", nn.initializers.normal(0.02), (CTX, D))[None, : ids.shape[-1]]
    mask = nn.make_causal_mask(ids)
    for _ in range(2):
      x = LinenBlock()(x, mask)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


EXPECTED_KERNELS = 2 * 6 + 2  # per block q, k, v, out, fc1, fc2; embedding; head


class NNXBlock(nnx.Module):
  """Pre-LayerNorm block: causal attention (dropout), a 4x GELU MLP; LinenBlock's layers in NNX."""

  def __init__(self, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, dropout_rate=0.1, rngs=rngs)
    self.fc1, self.fc2 = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask, deterministic=False)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class NNXLM(nnx.Module):
  """LinenLM in NNX: token embedding and learned positions, two blocks, a LayerNorm and the head."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (CTX, D)))
    self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])
    self.ln, self.head = nnx.LayerNorm(D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids) + self.pos[...][None, : ids.shape[-1]]
    mask = nnx.make_causal_mask(ids)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln(x))


def _train_nnx(tx, capture, data):
  model = NNXLM(nnx.Rngs(0, dropout=1))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, y, key):
    def loss_fn(m):
      logits, li = sk.capture_nnx(m, x, rng=key) if capture else (m(x), None)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), li

    (loss, li), g = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, g, **({"layer_inputs": li} if capture else {}))
    return loss

  step = nnx.cached_partial(step, model, opt)  # Flax's recipe for a loop of steps: the graph traversed once
  losses = [float(step(x, y, jax.random.PRNGKey(i))) for i, (x, y) in enumerate(data)]
  return np.array(losses), opt


def _train_linen(tx, capture, data):
  model = LinenLM()
  params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, data[0][0])["params"]
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y, key):
    def loss_fn(p):
      rngs = {"dropout": key}
      if capture:
        logits, li = sk.capture_linen(model, {"params": p}, x, rng=key, rngs=rngs)
      else:
        logits, li = model.apply({"params": p}, x, rngs=rngs), None
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), li

    (loss, li), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    u, state = tx.update(g, state, params, **({"layer_inputs": li} if capture else {}))
    return optax.apply_updates(params, u), state, loss

  losses = []
  for i, (x, y) in enumerate(data):
    params, state, loss = step(params, state, x, y, jax.random.PRNGKey(i))
    losses.append(float(loss))
  return np.array(losses), state


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_transformer_lm_trains_faster_than_nesterov_sgd_at_defaults(api):
  data = _markov_batches(0, 120)
  train = _train_nnx if api == "nnx" else _train_linen
  lr = 0.1
  sgd_losses, _ = train(optax.sgd(lr, momentum=0.9, nesterov=True), False, data)
  sc_losses, opt = train(sk.scsgd(lr), True, data)
  state = opt.opt_state[0] if api == "nnx" else opt[0]
  assert len(state.factors) == EXPECTED_KERNELS
  assert any(p.endswith("embedding") for p in state.factors)
  assert sum("query/kernel" in p for p in state.factors) == 2
  assert np.isfinite(sc_losses).all()
  # (Both approach the chain's entropy.) In every 10-step window from the fourth on scsgd's mean loss is below
  # SGD's (the step bound holds its first steps, where the two run level), and scsgd reaches SGD's final loss (mean
  # of its last 20 steps) within 90 of the 120 steps.
  sc_windows = sc_losses.reshape(12, 10).mean(1)
  sgd_windows = sgd_losses.reshape(12, 10).mean(1)
  assert np.all(sc_windows[3:] < sgd_windows[3:]), (sc_windows, sgd_windows)
  reached = np.flatnonzero(sc_windows <= sgd_losses[-20:].mean())
  assert reached.size and 10 * (reached[0] + 1) <= 90, (sc_windows, sgd_losses[-20:].mean())


@pytest.mark.parametrize("statistics", ["dense", "streaming", "diagonal"])
def test_state_round_trips_through_flax_serialization(statistics):
  """``flax.serialization.to_bytes`` (a Linen TrainState's msgpack save) of a trained state, restored into a
  freshly built optimizer's ``init``: every array equal, the plan summary the target's."""
  from flax import serialization

  tx = sk.scsgd(0.01, sk.Conditioning(rank=8, statistics=sk.Statistics(kind=statistics), refresh=sk.Refresh(every=2)))
  _, state = _steps(tx, steps=5)
  restored = serialization.from_bytes(tx.init(PARAMS), serialization.to_bytes(state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  assert restored[0].summary() == state[0].summary() and int(restored[0].count) == 5
