"""Small models of each kind a user trains (a ReLU MLP with dead units, a CNN, a transformer block, a scanned
stack), each with its batches and its loss, and one NNX training loop for any optimizer: what the robustness
tests run every alias on."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import scsgd_jax as sk

V, D, T, CLASSES = 11, 16, 6, 5


class DeadMLP(nnx.Module):
  """ReLU MLP 16 -> 32 -> 32 -> 5 whose first layer has a quarter of its units dead (bias -10): the second
  layer's inputs have zero rows and columns, a rank-deficient C."""

  def __init__(self, rngs):
    self.l1, self.l2, self.head = (nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs),
                                 nnx.Linear(32, CLASSES, rngs=rngs))
    self.l1.bias[...] = jnp.where(jnp.arange(32) % 4 == 0, -10.0, 0.0)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


class CNN(nnx.Module):
  def __init__(self, rngs):
    self.c1 = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(4, 8, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(8 * 4 * 4, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.c2(jax.nn.relu(self.c1(x))))
    return self.head(x.reshape(x.shape[0], -1))


class Block(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(2, D, qkv_features=D, decode=False, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TransformerBlock(nnx.Module):
  def __init__(self, rngs):
    self.embed, self.block, self.head = nnx.Embed(V, D, rngs=rngs), Block(rngs), nnx.Linear(D, V, rngs=rngs)

  def __call__(self, ids):
    return self.head(self.block(self.embed(ids)))


class ScannedStack(nnx.Module):
  """Two blocks made by ``nnx.vmap`` and run by ``nnx.scan``, as Flax's docs scan a transformer."""

  def __init__(self, rngs):
    self.embed, self.head = nnx.Embed(V, D, rngs=rngs), nnx.Linear(D, V, rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.blocks = make(rngs)

  def __call__(self, ids):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(self.embed(ids), self.blocks))


def batches(kind: str, steps: int, seed: int = 0, batch: int = 32):
  """``steps`` batches ``(x, labels)`` for a model of ``kind``: ill-conditioned Gaussian inputs labelled by a fixed
  random teacher (MLP, CNN), or token sequences whose next token is the current one plus one (the LMs)."""
  rng = np.random.default_rng(seed)
  if kind == "mlp":
    teacher, scale = rng.standard_normal((16, CLASSES)), np.logspace(0, -2, 16)
    for _ in range(steps):
      x = rng.standard_normal((batch, 16)) * scale
      yield jnp.asarray(x, jnp.float32), jnp.asarray(np.argmax(x @ teacher, 1))
  elif kind == "cnn":
    teacher = rng.standard_normal((64, CLASSES))
    for _ in range(steps):
      x = rng.standard_normal((batch, 8, 8, 1))
      yield jnp.asarray(x, jnp.float32), jnp.asarray(np.argmax(x.reshape(batch, -1) @ teacher, 1))
  else:
    for _ in range(steps):
      ids = rng.integers(0, V, (batch // 4, T))
      yield jnp.asarray(ids), jnp.asarray((ids + 1) % V)


MODELS = {"mlp": DeadMLP, "cnn": CNN, "transformer": TransformerBlock, "scanned": ScannedStack}


def input_axes(model) -> dict:
  """``input_axes_nnx`` of ``model`` given its first batch's inputs: the layouts, and the kernels that read one array
  (an attention's query, key and value) sharing its statistics."""
  kind = next(k for k, cls in MODELS.items() if isinstance(model, cls))
  return sk.input_axes_nnx(model, next(batches(kind, 1))[0])


def scaled_by_rate() -> optax.GradientTransformationExtraArgs:
  """The updates times the ``rate=`` extra argument of ``update``: a rate chosen per call, so one compiled step
  serves a whole grid of rates (an alias linear in its rate; scsgd's step bound reads the step before this scale, so
  a run that needs the bound at its rate builds scsgd at that rate and scales by 1)."""

  def update(updates, state, params=None, *, rate=1.0, **extra):
    del params, extra
    return jax.tree.map(lambda u: u * rate, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def build(kind: str, make_tx):
  """A fresh ``MODELS[kind]`` and its ``nnx.Optimizer`` under ``make_tx(model)`` chained with
  :func:`scaled_by_rate`."""
  model = MODELS[kind](nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.chain(make_tx(model), scaled_by_rate()), wrt=nnx.Param)


def fit(kind, model, optimizer, rate, steps, *, start=0, capture=True, two_sided=False, on_update=None):
  """Losses of ``steps`` NNX steps (the README's step) on batches ``start, start + 1, ...`` of ``kind``;
  ``on_update(step, updates, model)`` sees each update."""
  losses = []
  # Flax's cached_partial: the graph of model and optimizer traversed once, not at every call (nnx.jit's per-call
  # overhead is half a step of the tests' transformer)
  stepped = nnx.cached_partial(step, model, optimizer)
  for i, (x, y) in enumerate(batches(kind, start + steps)):
    if i < start:
      continue
    loss, updates = stepped(x, y, jnp.float32(rate), jax.random.PRNGKey(i), capture, two_sided)
    losses.append(float(loss))
    if on_update is not None:
      on_update(i, updates, model)
  return losses


def train(kind: str, make_tx, rate: float, steps: int, **kwargs):
  """Losses of ``steps`` steps of a fresh model of ``kind`` under ``make_tx`` (:func:`build`, :func:`fit`)."""
  return train_rates(kind, make_tx, (rate,), steps, **kwargs)[rate]


def train_rates(kind: str, make_tx, rates, steps: int, **kwargs) -> dict[float, list]:
  """:func:`train` at each of ``rates``, every run from the same fresh model and optimizer state, on one compiled
  step (a fresh optimizer is a new static argument of the jitted step: it would compile again)."""
  model, optimizer = build(kind, make_tx)
  start = jax.tree.map(jnp.copy, (nnx.state(model), nnx.state(optimizer)))
  out = {}
  for rate in rates:
    nnx.update(model, jax.tree.map(jnp.copy, start[0]))
    nnx.update(optimizer, jax.tree.map(jnp.copy, start[1]))
    out[rate] = fit(kind, model, optimizer, rate, steps, **kwargs)
  return out


@nnx.jit(static_argnums=(6, 7))
def step(model, optimizer, x, y, rate, key, capture, two_sided):
  """The README's NNX step, at ``rate`` (:func:`scaled_by_rate`): ``(loss, updates)``."""
  def loss_fn(model, perturbations):
    if capture:
      logits, inputs = sk.capture_nnx(model, x, rng=key, output_perturbations=perturbations)
    else:
      logits, inputs = model(x), None
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), inputs

  perturbations = sk.contrib.output_perturbations_nnx(model, x) if two_sided else None
  (loss, inputs), (grads, deltas) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(model, perturbations)
  extra = {"layer_inputs": inputs} if capture else {}
  if two_sided:
    extra["output_grads"] = deltas
  return loss, optimizer.update(model, grads, rate=rate, **extra)
