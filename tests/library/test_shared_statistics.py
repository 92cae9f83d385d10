"""Kernels whose layers read the same rows share one statistic: ``Layout(reads=...)`` against a dense oracle, the
same updates as each kernel keeping its own copy, what ``input_axes_nnx`` / ``input_axes_linen`` mark given inputs,
and the refusals naming both kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import scsgd_jax as sk
from tests import helpers

NU = 0.3
PAPER = dict(statistics=sk.Statistics(kind="dense", ema_rate=NU, fold_every=1),
             refresh=sk.Refresh(every=1, warm_start=False), conditioner=sk.Conditioner(kind="full"))
SHARED = {"b/kernel": sk.Layout((0,), reads="a/kernel")}


def _params(rng, n=6):
  return {"a": {"kernel": jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)},
          "b": {"kernel": jnp.asarray(rng.standard_normal((n, 2)), jnp.float32), "bias": jnp.zeros(2)}}


def test_a_kernel_reading_anothers_statistics_is_conditioned_by_its_factor():
  """b reads a's statistics: one C = (1 - nu) I + nu X^T X / m folded from a's rows alone (b needs none), and both
  gradients conditioned by its C^{-1/2}; the state keeps one statistic and one factor."""
  rng = np.random.default_rng(0)
  params = _params(rng)
  x = rng.standard_normal((16, 6))
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
  tx = sk.scale_by_sketched_conditioning(sk.Conditioning(input_axes=SHARED, **PAPER))
  state = tx.init(params)
  assert [len(jax.tree.leaves(b)) for b in state.statistics.banks] == [2]  # one C (and its weight)
  assert jax.tree.leaves(state.statistics.banks)[0].shape == (1, 6, 6)
  assert state.summary()["b/kernel"] == "dense C, full C^(1/2), n=6, statistics shared with a/kernel"
  updates, state = jax.jit(tx.update)(grads, state, params, layer_inputs={"a": {"kernel": jnp.asarray(x, jnp.float32)}})
  c = (1 - NU) * np.eye(6) + NU * x.T @ x / 16
  a_inv = helpers.psd_power(c, -0.5)
  np.testing.assert_allclose(state.statistics["b/kernel"].moments, c, rtol=1e-5, atol=1e-6)
  for name in ("a", "b"):
    np.testing.assert_allclose(updates[name]["kernel"], a_inv @ np.asarray(grads[name]["kernel"]), rtol=1e-4,
                               atol=1e-5)
  np.testing.assert_array_equal(updates["b"]["bias"], grads["b"]["bias"])
  assert set(state.clipped_rows) == {"a/kernel"}
  assert set(sk.kernel_diagnostics(state)) == {"a/kernel", "b/kernel"}


@pytest.mark.parametrize("alias", ["scsgd", "scsgd_eigen", "scsgd_eigen_muon"])
def test_sharing_gives_the_updates_of_kernels_each_keeping_its_own_copy(alias):
  """Fed the same rows, a kernel keeping its own statistics keeps a copy of the shared ones: three updates of every
  alias are the same with the statistics shared as without (the eigenbasis' moments stay per kernel)."""
  rng = np.random.default_rng(1)
  params = _params(rng, n=8)
  make = getattr(sk, alias)

  def run(input_axes):
    tx = make(1e-2, sk.Conditioning(**PAPER, input_axes=input_axes))
    state, p, out = tx.init(params), params, []
    for step in range(3):
      x = jnp.asarray(np.random.default_rng(step).standard_normal((16, 8)), jnp.float32)
      grads = jax.tree.map(lambda q: jnp.sin(q * (step + 1)), p)
      updates, state = tx.update(grads, state, p, layer_inputs={"a": {"kernel": x}, "b": {"kernel": x}})
      p = optax.apply_updates(p, updates)
      out.append(updates)
    return out

  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7), run(SHARED), run(None))


class Gated(nnx.Module):
  """Self-attention (query, key and value read one array), a gated MLP (gate and up read one array), and a
  cross-attention whose key and value read the memory, its query the stream."""

  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=rngs)
    self.gate, self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8,
                                                                                                           rngs=rngs)
    self.cross = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=rngs)

  def __call__(self, x, memory):
    x = x + self.attn(x)
    x = x + self.down(nnx.silu(self.gate(x)) * self.up(x))
    return x + self.cross(x, memory)


def test_input_axes_nnx_given_inputs_marks_the_kernels_that_read_one_array():
  model = Gated(nnx.Rngs(0))
  x, memory = jnp.ones((2, 5, 8)), jnp.ones((2, 3, 8))
  reads = {p: layout.reads for p, layout in sk.input_axes_nnx(model, x, memory).items() if layout.reads}
  assert reads == {"attn/key/kernel": "attn/query/kernel", "attn/value/kernel": "attn/query/kernel",
                   "up/kernel": "gate/kernel", "cross/value/kernel": "cross/key/kernel"}
  assert not any(layout.reads for layout in sk.input_axes_nnx(model).values())  # without inputs: nothing traced
  # and the step of the README trains with them: one statistic per array read
  tx = sk.scsgd(0.05, sk.Conditioning(input_axes=sk.input_axes_nnx(model, x, memory)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  plans = optimizer.opt_state[0].summary()
  assert plans["attn/value/kernel"].endswith("statistics shared with attn/query/kernel")
  loss_fn = lambda m: (lambda out, li: (jnp.mean(jnp.square(out - 1.0)), li))(*sk.capture_nnx(m, x, memory,
                                                                                              max_rows=None))
  losses = []
  for _ in range(5):
    (loss, inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, layer_inputs=inputs)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, name="attn")(x)
    return nn.Dense(4, name="head")(x)


def test_input_axes_linen_marks_the_kernels_that_read_one_array():
  module, x = LinenBlock(), jnp.ones((2, 5, 8))
  variables = module.init(jax.random.PRNGKey(0), x)
  reads = {p: layout.reads for p, layout in sk.input_axes_linen(module, variables, x).items() if layout.reads}
  assert reads == {"attn/key/kernel": "attn/query/kernel", "attn/value/kernel": "attn/query/kernel"}


@pytest.mark.parametrize("axes,match", [
    ({"b/kernel": sk.Layout((0,), reads="c/kernel")},
     r"kernel 'b/kernel' reads the statistics of 'c/kernel'.*not a conditioned kernel.*\['a/kernel', 'b/kernel'\]"),
    ({"b/kernel": sk.Layout((0,), reads="b/kernel")}, r"kernel 'b/kernel': Layout\(reads='b/kernel'\) must name "
     "another kernel"),
    ({"b/kernel": sk.Layout((0,), reads="a/kernel"), "a/kernel": sk.Layout((0,), reads="b/kernel")},
     r"cannot read the statistics of .*itself reading"),
])
def test_a_kernel_that_cannot_read_the_statistics_named_is_refused_at_init(axes, match):
  params = _params(np.random.default_rng(2))
  with pytest.raises(ValueError, match=match):
    sk.scsgd(0.1, sk.Conditioning(input_axes=axes)).init(params)


def test_reading_a_kernel_of_another_input_dimension_is_refused_naming_both():
  params = {"a": {"kernel": jnp.ones((6, 3))}, "b": {"kernel": jnp.ones((5, 2))}}
  with pytest.raises(ValueError, match=r"kernel 'b/kernel' \(n=5, stack \(\), 1 groups\) cannot read the statistics "
                     r"of 'a/kernel' \(n=6"):
    sk.scsgd(0.1, sk.Conditioning(input_axes=SHARED)).init(params)


def test_state_shardings_and_refreshes_apart_take_the_shared_state():
  """``state_shardings`` gives the shared state its structure (one statistic for the kernels reading one array,
  placed along its kernel's axes), under every alias; with the refreshes apart, ``refresh_conditioners`` refreshes
  it in place of the step."""
  from jax.sharding import PartitionSpec as P
  model = Gated(nnx.Rngs(0))
  axes = sk.input_axes_nnx(model, jnp.ones((2, 5, 8)), jnp.ones((2, 3, 8)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  specs = jax.tree.map(lambda a: P(*([None] * (a.ndim - 1) + ["tp"])) if a.ndim >= 2 else P(), params)
  is_spec = lambda s: isinstance(s, P)
  for tx in (sk.scsgd(0.1, sk.Conditioning(input_axes=axes)), sk.scsgd_eigen(1e-3, sk.Conditioning(input_axes=axes)),
             sk.scsgd_eigen_muon(1e-3, sk.Conditioning(input_axes=axes)),
             sk.contrib.scsgd_two_sided(1e-3, sk.Conditioning(input_axes=axes))):
    state, got = tx.init(params), sk.state_shardings(tx, params, specs)
    assert jax.tree.structure(got, is_leaf=is_spec) == jax.tree.structure(state)
  tx = sk.scsgd(0.1, sk.Conditioning(input_axes=axes, refresh=sk.Refresh(apart=True)))
  state = tx.init(params)
  inner = sk.state_shardings(tx, params, specs)[0]
  assert inner.statistics["attn/value/kernel"] == inner.statistics["attn/query/kernel"]
  assert jax.tree.structure(sk.refresh_conditioners(state)) == jax.tree.structure(state)
