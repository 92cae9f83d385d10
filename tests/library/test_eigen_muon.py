"""scsgd_eigen_muon: the eigenbasis Adam in front of Muon's orthogonalization, with Muon's unread momentum left out
of the state. Against Newton-Schulz by hand on the eigenbasis Adam's output (itself tested against numpy in
test_eigenbasis.py), AdamW on the other leaves, and the two-transformation chain it replaces, bit for bit."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import scsgd_jax as sk
from tests import helpers

EXACT = dict(statistics="dense", ema_rate=1.0, statistics_every=1, update_every=1, warm_start=False,
             outlier_threshold=float("inf"))
LR, ADAM_LR, BETA, B2 = 0.02, 3e-3, 0.95, 0.99


def _newton_schulz(x):
  """Muon's iteration by hand (optax's eps), then optax's width scale sqrt(max(1, fan_out / fan_in))."""
  return helpers.newton_schulz(x, eps=1e-8) * np.sqrt(max(1.0, x.shape[1] / x.shape[0]))


def _params():
  return {"hidden": {"kernel": jnp.zeros((6, 4)), "bias": jnp.zeros(4)},
          "head": {"kernel": jnp.zeros((4, 3))},
          "embed": {"embedding": jnp.zeros((5, 6))}}


def _steps(rng, steps, m=32):
  scales = np.linspace(0.5, 3.0, 6)
  for _ in range(steps):
    grads = {"hidden": {"kernel": rng.standard_normal((6, 4)), "bias": rng.standard_normal(4)},
             "head": {"kernel": rng.standard_normal((4, 3))},
             "embed": {"embedding": rng.standard_normal((5, 6))}}
    inputs = {"hidden": {"kernel": rng.standard_normal((m, 6)) * scales},
              "head": {"kernel": rng.standard_normal((m, 4))},
              "embed": {"embedding": rng.integers(0, 5, m)}}
    yield jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), grads), jax.tree.map(jnp.asarray, inputs)


def _run(tx, steps=4, seed=0):
  params, outs = _params(), []
  state = tx.init(params)
  for grads, inputs in _steps(np.random.default_rng(seed), steps):
    u, state = jax.jit(tx.update)(grads, state, params, layer_inputs=inputs)
    outs.append(jax.tree.map(np.asarray, u))
  return outs, state


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_hidden_kernel_is_newton_schulz_of_the_eigenbasis_adam_and_the_rest_adamw():
  """The hidden kernel's update is -lr NS(u), u the eigenbasis Adam's output (Nesterov, b1 = Muon's beta) at the
  same settings; the head, the embedding table and the bias take Muon's AdamW part's update (NAdamW, at its rate)."""
  tx = sk.scsgd_eigen_muon(LR,
                           sk.Conditioning.from_flat(conditioner="full", **EXACT),
                           beta=BETA,
                           b2=B2,
                           output_layer="head",
                           adam_learning_rate=ADAM_LR)
  eigen = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(
      kernel_filter=lambda path, leaf: path == "hidden/kernel", conditioner="full", **EXACT),
                                      b1=BETA,
                                      b2=B2,
                                      nesterov=True)
  adamw = optax.adamw(ADAM_LR, weight_decay=0.0, nesterov=True)  # Muon's AdamW part is Nesterov's
  got, _ = _run(tx)
  want, _ = _run(eigen)
  rest, state = [], adamw.init(_params())
  for grads, _ in _steps(np.random.default_rng(0), 4):
    u, state = adamw.update(grads, state, _params())
    rest.append(u)
  for g, w, a in zip(got, want, rest):
    np.testing.assert_allclose(g["hidden"]["kernel"], -LR * _newton_schulz(w["hidden"]["kernel"]),
                               rtol=2e-4, atol=1e-6)
    for path in (("hidden", "bias"), ("head", "kernel"), ("embed", "embedding")):
      np.testing.assert_allclose(g[path[0]][path[1]], a[path[0]][path[1]], rtol=1e-5, atol=1e-8)


_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, LR, 2, 6)


SOAP = dict(basis="gradients", sides="both")  # the gradients' bases on both sides: SOAP's, at full rank


@pytest.mark.parametrize("rate,conditioning,basis", [(LR, {}, {}), (_SCHEDULE, {}, {}),
                                                     (_SCHEDULE, dict(conditioner="full", **EXACT), {}),
                                                     (LR, dict(conditioner="full", **EXACT), SOAP)],
                         ids=["defaults", "schedule", "schedule_conditioned", "soap_both_sides"])
def test_equals_the_chain_with_muon_at_momentum_zero_without_its_buffer(rate, conditioning, basis):
  """The alias equals chain(eigenbasis Adam, optax.contrib.muon(beta=0)) bit for bit (at the sketch's defaults,
  which leave the small hidden kernel to Adam; with it conditioned; rotated on both sides by the gradients' bases,
  SOAP's, to float32 rounding), a schedule's rate included, and its state
  is that chain's less Muon's momentum buffer (the hidden kernel's size), never read at beta=0."""
  hidden = sk.muon_kernel_filter("head")
  adam_rate = (lambda step: ADAM_LR * rate(step) / LR) if callable(rate) else ADAM_LR
  chain = optax.chain(
      sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(kernel_filter=hidden, **conditioning),
                                  b1=BETA,
                                  b2=B2,
                                  nesterov=True,
                                  others="identity",
                                  **basis),
      optax.contrib.muon(rate,
                         beta=0.0,
                         adam_learning_rate=adam_rate,
                         adam_b2=B2,
                         muon_weight_dimension_numbers={
                             "hidden": {
                                 "kernel": optax.contrib.MuonDimensionNumbers(0, 1),
                                 "bias": None
                             },
                             "head": {
                                 "kernel": None
                             },
                             "embed": {
                                 "embedding": None
                             }
                         }))
  tx = sk.scsgd_eigen_muon(rate,
                           sk.Conditioning.from_flat(**conditioning),
                           beta=BETA,
                           b2=B2,
                           output_layer="head",
                           adam_learning_rate=adam_rate,
                           muon={"adam_b2": B2},
                           **basis)
  got, got_state = _run(tx, steps=6)
  if basis:  # the hidden kernel is rotated on both sides: the output side's basis is in the state
    assert set(got_state[0].output_rotations) == {"hidden/kernel"}
  want, want_state = _run(chain, steps=6)
  # bit for bit, but on both sides: there, under these tests' fast-compile flags, XLA:CPU rounds the chain's AdamW
  # part (a bias's step) apart by an ulp; under its default flags, as users compile, the two are equal bit for bit,
  # and the alias's updates are the record's (test_updates_record)
  same = np.testing.assert_array_equal if not basis else partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-9)
  for g, w in zip(got, want):
    jax.tree.map(same, g, w)
  counters = [x for x in jax.tree.leaves(got_state[0]) if x.dtype == jnp.int32]
  clipped = got_state[0].conditioning.clipped_rows  # the clipped-row counts, in the statistics' banks
  sides = [got_state[0].conditioning] + ([got_state[0].output] if basis else [])  # each side's count, then its clips
  assert [c.tolist() for c in counters] == [x for side in sides for x in [6] + [b.tolist() for b in
                                                                                side.clipped_rows.banks]]
  assert [int(clipped[p]) for p in clipped] == [0] * len(clipped)
  schedules = 2 if callable(rate) else 0  # Muon's and its AdamW part's scale_by_learning_rate
  muon_counters = [int(x) for x in jax.tree.leaves(got_state[1]) if x.dtype == jnp.int32]
  assert muon_counters == [6] * (2 + schedules)  # Muon's own, its AdamW part's and the schedules'
  assert _nbytes(want_state) - _nbytes(got_state) == 6 * 4 * 4  # Muon's momentum buffer, the hidden kernel's size


def test_stacked_and_attention_kernels_orthogonalized_as_the_eigenbasis_reads_them():
  """A layer stack (Layout stack=1) is orthogonalized slice by slice; an attention q/k/v kernel (in, heads, dim)
  as the (in, heads * dim) matrix of its input axis (the default's view of it); a conv kernel as its patches'."""
  numbers = sk.muon_kernel_filter("head")
  from scsgd_jax._src import muon as muon_lib

  params = {"blocks": {"kernel": jnp.zeros((3, 6, 4))}, "attn": {"query": {"kernel": jnp.zeros((6, 2, 4))}},
            "head": {"kernel": jnp.zeros((4, 3))}}
  dims = muon_lib.muon_dimension_numbers(numbers, {"blocks/kernel": sk.Layout((0,), stack=1)})(params)
  assert dims["blocks"]["kernel"] == optax.contrib.MuonDimensionNumbers((1,), (2,))
  assert dims["attn"]["query"]["kernel"] == optax.contrib.MuonDimensionNumbers((0,), (1, 2))
  assert dims["head"]["kernel"] is None
  conv = muon_lib.muon_dimension_numbers(numbers)({"conv": {"kernel": jnp.zeros((5, 5, 3, 8))}})
  assert conv["conv"]["kernel"] == optax.contrib.MuonDimensionNumbers((0, 1, 2), (3,))  # im2col's (kh kw cin, cout)
  args = dict(input_axes={"blocks/kernel": sk.Layout((0,), stack=1)}, update_every=1, warm_start=False)
  tx = sk.scsgd_eigen_muon(LR, sk.Conditioning.from_flat(**args), output_layer="head")
  eigen = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(kernel_filter=numbers, **args), b1=0.95, nesterov=True)
  rng = np.random.default_rng(2)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  inputs = {"blocks": {"kernel": jnp.asarray(rng.standard_normal((3, 16, 6)), jnp.float32)},
            "attn": {"query": {"kernel": jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)}},
            "head": {"kernel": jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)}}
  u, _ = tx.update(grads, tx.init(params), params, layer_inputs=inputs)
  w, _ = eigen.update(grads, eigen.init(params), params, layer_inputs=inputs)
  for i in range(3):
    np.testing.assert_allclose(u["blocks"]["kernel"][i], -LR * _newton_schulz(np.asarray(w["blocks"]["kernel"][i])),
                               rtol=2e-4, atol=1e-6)
  want = -LR * _newton_schulz(np.asarray(w["attn"]["query"]["kernel"]).reshape(6, 8)).reshape(6, 2, 4)
  np.testing.assert_allclose(u["attn"]["query"]["kernel"], want, rtol=2e-4, atol=1e-6)


def test_grouped_and_plain_kernels_go_to_the_adamw_part():
  hidden = sk.muon_kernel_filter()
  from scsgd_jax._src import muon as muon_lib

  axes = {"depthwise/kernel": sk.Layout((0, 1, 2), groups=4), "transposed/kernel": sk.Plain("transposed conv")}
  keep = muon_lib.muon_kernels(hidden, axes)
  assert not keep("depthwise/kernel", jnp.zeros((3, 3, 1, 4)))
  assert not keep("transposed/kernel", jnp.zeros((3, 3, 4, 4)))
  assert keep("conv/kernel", jnp.zeros((3, 3, 4, 4)))


@pytest.mark.parametrize("bad", ["beta", "learning_rate", "muon_weight_dimension_numbers", "weight_decay"])
def test_muon_arguments_it_sets_itself_are_refused_by_name(bad):
  with pytest.raises(TypeError, match=bad):
    sk.scsgd_eigen_muon(LR, muon={bad: 0.5})


def test_state_round_trips_through_flax_serialization():
  """The state without Muon's buffer (mu=None) restores from msgpack into a fresh optimizer's state, and training
  goes on from it as from the original."""
  from flax import serialization

  tx = sk.scsgd_eigen_muon(LR, sk.Conditioning(refresh=sk.Refresh(every=1)), output_layer="head")
  outs, state = _run(tx, steps=2)
  restored = serialization.from_bytes(tx.init(_params()), serialization.to_bytes(state))
  grads, inputs = next(_steps(np.random.default_rng(5), 1))
  a, _ = jax.jit(tx.update)(grads, state, _params(), layer_inputs=inputs)
  b, _ = jax.jit(tx.update)(grads, restored, _params(), layer_inputs=inputs)
  jax.tree.map(np.testing.assert_array_equal, a, b)
