"""``clip_by_relative_norm``, the step bound ``scsgd(max_relative_step=...)`` ends with: each layer's step at most
a share of its weight's norm, against numpy; and, across model kinds at a rate where plain steps break it, every
step of every layer within it."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scsgd_jax as sk

RNG = np.random.default_rng(0)


def _tree():
  return {"w": jnp.asarray(RNG.standard_normal((4, 3)), jnp.float32),
          "zero": jnp.zeros((5, 2), jnp.float32), "b": jnp.asarray(RNG.standard_normal(3), jnp.float32)}


def test_clips_a_step_above_the_bound_to_it_and_passes_the_rest_bit_for_bit():
  params = _tree()
  updates = {"w": 10.0 * params["w"], "zero": jnp.full((5, 2), 0.5), "b": 100.0 * params["b"]}
  small = {"w": 1e-3 * params["w"], "zero": jnp.full((5, 2), 1e-5), "b": params["b"]}
  tx = sk.clip_by_relative_norm(0.1, floor_rms=0.01)
  out, _ = tx.update(updates, tx.init(params), params)
  w = np.asarray(params["w"], np.float64)
  np.testing.assert_allclose(out["w"], np.asarray(updates["w"]) * 0.1 * np.linalg.norm(w) /
                             np.linalg.norm(np.asarray(updates["w"], np.float64)), rtol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(out["zero"]), 0.1 * 0.01 * np.sqrt(10), rtol=1e-6)  # the floor
  np.testing.assert_array_equal(out["b"], updates["b"])  # a vector passes
  same, _ = tx.update(small, tx.init(params), params)
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(small)):
    np.testing.assert_array_equal(a, b)


def test_the_default_floor_is_a_lecun_normal_init_of_the_leafs_shape():
  params = _tree()  # "zero": (5, 2), fan-in 5: a fresh init's norm sqrt(10 / 5) = sqrt(2)
  updates = {"w": params["w"], "zero": jnp.full((5, 2), 0.5), "b": params["b"]}
  tx = sk.clip_by_relative_norm(0.1)
  out, _ = tx.update(updates, tx.init(params), params)
  np.testing.assert_allclose(np.linalg.norm(out["zero"]), 0.1 * np.sqrt(2.0), rtol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(out["w"]), 0.1 * np.linalg.norm(params["w"]), rtol=1e-6)


def test_a_stack_is_bounded_slice_by_slice_and_a_leaf_slices_leaves_out_passes():
  w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 3)), jnp.float32).at[1].multiply(3.0)
  params, updates = {"stack": w, "free": w}, {"stack": 9 * jnp.ones((2, 4, 3)), "free": jnp.ones((2, 4, 3))}
  tx = sk.clip_by_relative_norm(0.1, slices=lambda params: {"stack": 1, "free": None})
  out, _ = tx.update(updates, tx.init(params), params)
  for i in range(2):  # each slice at 0.1 of its own norm (slice 1 three times slice 0's; both below |9 ones|)
    np.testing.assert_allclose(np.linalg.norm(out["stack"][i]), 0.1 * np.linalg.norm(np.asarray(w[i])), rtol=1e-6)
  np.testing.assert_array_equal(out["free"], updates["free"])


def test_a_non_finite_step_passes_as_it_is_and_bad_arguments_are_refused():
  params = _tree()
  tx = sk.clip_by_relative_norm(0.1)
  bad = {"w": jnp.full((4, 3), jnp.inf), "zero": jnp.zeros((5, 2)), "b": jnp.zeros(3)}
  out, _ = tx.update(bad, tx.init(params), params)
  assert np.isinf(out["w"]).all()
  with pytest.raises(ValueError, match="pass params"):
    tx.update(bad, tx.init(params))
  with pytest.raises(ValueError, match="max_ratio"):
    sk.clip_by_relative_norm(0.0)
  with pytest.raises(ValueError, match="floor_rms"):
    sk.clip_by_relative_norm(0.1, floor_rms=-1.0)
  with pytest.raises(ValueError, match="max_relative_step"):  # the alias names its own argument
    sk.scsgd(0.1, max_relative_step=-0.1)


class DeadMLP(nnx.Module):
  """A ReLU MLP whose second layer's units start dead (a large negative bias)."""

  def __init__(self, rngs, tied=False):
    self.l1, self.l2, self.head = nnx.Linear(12, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs), nnx.Linear(
        16, 5, rngs=rngs)
    self.l2.bias[...] = jnp.full(16, -3.0).at[:8].set(0.0)

  def __call__(self, x):
    return self.head(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


class CNN(nnx.Module):
  def __init__(self, rngs, tied=False):
    self.conv, self.head = nnx.Conv(1, 4, (3, 3), rngs=rngs), nnx.Linear(4 * 12, 5, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.conv(x.reshape(x.shape[0], 4, 3, 1)))
    return self.head(y.reshape(x.shape[0], -1))


class TinyLM(nnx.Module):
  """Embedding, one attention block, a head: tied (``embed.attend``) or untied."""

  def __init__(self, rngs, tied=False):
    self.tied, self.embed = tied, nnx.Embed(5, 16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)
    if not tied:
      self.head = nnx.Linear(16, 5, kernel_init=nnx.initializers.zeros, rngs=rngs)  # a zero-initialised head

  def __call__(self, x):
    h = self.embed(jnp.abs(x[:, :6] * 3).astype(jnp.int32) % 5)
    h = h + self.attn(h)
    h = h + self.down(nnx.relu(self.up(h)))
    return (self.embed.attend(h) if self.tied else self.head(h)).mean(1)


class TableLM(nnx.Module):
  """Gemma's ``Embedder``: the tied table a raw ``input_embedding`` (no kernel by Flax's names: stepped plainly,
  bounded all the same)."""

  def __init__(self, rngs, tied=True):
    self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (5, 16)))
    self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

  def __call__(self, x):
    h = self.input_embedding[...][jnp.abs(x[:, :6] * 3).astype(jnp.int32) % 5]
    h = h + self.down(nnx.relu(self.up(h)))
    return (h @ self.input_embedding[...].T).mean(1)


MODELS = {"relu_mlp_dead_units": (DeadMLP, False), "cnn": (CNN, False), "transformer_untied_zero_head": (TinyLM, False),
          "transformer_tied": (TinyLM, True), "transformer_tied_raw_table": (TableLM, True)}
RATIO = inspect.signature(sk.scsgd).parameters["max_relative_step"].default  # scsgd's default bound


def _steps(model, tx, steps=6):
  """The relative steps ``|U| / max(|W|, sqrt(shape[-1]))`` (the floor: a lecun-normal init's norm) of every leaf
  of two or more axes (kernels, tables, attention's per-head biases) at every step, and whether the parameters end
  finite."""
  x = jnp.asarray(RNG.standard_normal((8, 12)), jnp.float32)
  y = jnp.asarray(RNG.integers(0, 5, 8))
  graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state, out = tx.init(params), []

  def loss_fn(p):
    logits, inputs = sk.capture_nnx(nnx.merge(graphdef, nnx.State(p)), x, max_rows=None)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), inputs

  for _ in range(steps):
    (_, inputs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, state = tx.update(grads, state, params, layer_inputs=inputs)
    out += [float(jnp.linalg.norm(u) / jnp.maximum(jnp.linalg.norm(w), np.sqrt(w.shape[-1])))
            for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(params)) if u.ndim >= 2]
    params = optax.apply_updates(params, updates)
  return out, all(np.isfinite(a).all() for a in jax.tree.leaves(params))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_layers_step_is_within_the_bound_at_a_rate_where_plain_steps_break_it(kind):
  make, tied = MODELS[kind]
  bounded, finite = _steps(make(nnx.Rngs(0), tied=tied), sk.scsgd(5.0))  # at its defaults
  plain, _ = _steps(make(nnx.Rngs(0), tied=tied), sk.scsgd(5.0, max_relative_step=None))
  assert max(bounded) <= RATIO * (1 + 1e-5) and finite, max(bounded)
  assert max(plain) > RATIO  # the invariant fails without the bound

