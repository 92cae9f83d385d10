"""The defaults the zoo's measurements set: a token table that is also the output projection (``attend``: tied
weights) gets plain updates in NNX and Linen, found by the capture itself; without ``input_axes`` the plans of an
attention's query, key and value are made apart, and ``init`` says so in one line naming the fix."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import scsgd_jax

V, D = 11, 8


class TiedNNX(nnx.Module):
  def __init__(self, rngs, tied=True):
    self.tied = tied
    self.embed, self.mix = nnx.Embed(V, D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)
    if not tied:
      self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, ids):
    h = jax.nn.relu(self.mix(self.embed(ids)))
    return self.embed.attend(h) if self.tied else self.head(h)


class TiedLinen(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(V, D)
    return embed.attend(jax.nn.relu(nn.Dense(D)(embed(ids))))


IDS = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, 6)))


def _loss(logits):
  return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def _first_update(params, grads, inputs, input_axes):
  tx = scsgd_jax.scale_by_sketched_conditioning(scsgd_jax.Conditioning(input_axes=input_axes))
  return tx.update(grads, tx.init(params), params, layer_inputs=inputs)


@pytest.mark.parametrize("with_axes", [True, False])
def test_a_tied_nnx_table_gets_its_gradient_and_the_other_kernels_are_conditioned(with_axes):
  for tied in (True, False):
    model = TiedNNX(nnx.Rngs(0), tied)
    params = nnx.state(model, nnx.Param)

    def loss_fn(params):
      logits, inputs = scsgd_jax.capture_nnx(nnx.merge(nnx.graphdef(model), params), IDS)
      return _loss(logits), inputs

    grads, inputs = jax.grad(loss_fn, has_aux=True)(params)
    axes = scsgd_jax.input_axes_nnx(model, IDS) if with_axes else None
    updates, state = _first_update(params, grads, inputs, axes)
    same = np.array_equal(updates["embed"]["embedding"][...], grads["embed"]["embedding"][...])
    assert same == tied  # the tied table plain; an input-only table conditioned by its token counts
    assert not np.allclose(updates["mix"]["kernel"][...], grads["mix"]["kernel"][...])
    assert ("tied table" in scsgd_jax.plans(state)["embed/embedding"]) == tied


def test_a_tied_linen_table_gets_its_gradient():
  model = TiedLinen()
  params = model.init(jax.random.PRNGKey(0), IDS)["params"]

  def loss_fn(params):
    logits, inputs = scsgd_jax.capture_linen(model, {"params": params}, IDS)
    return _loss(logits), inputs

  grads, inputs = jax.grad(loss_fn, has_aux=True)(params)
  axes = scsgd_jax.input_axes_linen(model, {"params": params}, IDS)
  assert isinstance(axes["Embed_0/embedding"], scsgd_jax.Plain)
  updates, _ = _first_update(params, grads, inputs, axes)
  np.testing.assert_array_equal(updates["Embed_0"]["embedding"], grads["Embed_0"]["embedding"])
  assert not np.allclose(updates["Dense_0"]["kernel"], grads["Dense_0"]["kernel"])


class Attention(nnx.Module):
  def __init__(self, rngs, width=128):
    self.attn = nnx.MultiHeadAttention(4, width, decode=False, rngs=rngs)

  def __call__(self, x):
    return self.attn(x)


def test_without_input_axes_init_says_in_one_line_that_query_key_value_are_planned_apart():
  model = Attention(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  with pytest.warns(UserWarning,
                    match=r"no input_axes given, so the query, key and value of 1 attention layer.*"
                    r"pass scsgd_jax.Conditioning\(input_axes=scsgd_jax.input_axes_nnx\(model, x\)\)"):
    scsgd_jax.scsgd(0.1).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the recipe shares one dense statistic: nothing to say
    plans = scsgd_jax.plans(scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(
        model, jnp.ones((2, 5, 128))))).init(params))
  assert plans["attn/key/kernel"].startswith("dense C, full C^(1/2), n=128, statistics shared with")


class EinsumAttention(nnx.Module):
  def __init__(self, rngs):
    self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (2, 8, 4), rngs=rngs)

  def __call__(self, x):
    return self.q_einsum(x)


def test_without_input_axes_init_says_einsum_kernels_are_read_by_name():
  model = EinsumAttention(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  with pytest.warns(UserWarning, match=r"1 Einsum kernel\(s\) \(e.g. 'q_einsum/kernel'\) are planned by Flax's "
                                       r"name-based axes.*input_axes_nnx\(model, x\)"):
    scsgd_jax.scsgd(0.1).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    axes = scsgd_jax.input_axes_nnx(model, jnp.ones((2, 3, 8)))
    assert scsgd_jax.plans(scsgd_jax.scsgd(
        0.1, scsgd_jax.Conditioning(input_axes=axes)).init(params))["q_einsum/kernel"].endswith("n=8")
