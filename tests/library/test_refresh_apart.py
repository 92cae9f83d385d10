"""``Refresh(apart=True)``: the refresh as a program apart from the step (``scsgd_jax.refresh_conditioners``).

The oracle is the refresh in the step: after each update and ``refresh_conditioners``, the factors are the ones the
step would have rebuilt, bit for bit in float32 up to the two programs' rounding, on its schedule (staggered,
warm); an update conditions with the factors rebuilt after the update before it (``A_{t-1}^{-1} G_t``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scsgd_jax as sk
from scsgd_jax import sketch
from tests.helpers import kernel_lines

STEPS = 7


def _params():
  """Kernels of three plans: dense C with the full C^(1/2) (n=6), streaming rank 2 (n=400), a stack of 3 (n=5)
  with dense C."""
  return {"small": {"kernel": jnp.ones((6, 5)), "bias": jnp.zeros(5)},
          "wide": {"kernel": jnp.ones((400, 64))},
          "stack": {"kernel": jnp.ones((3, 5, 16))}}


AXES = {"stack/kernel": sk.Layout(input_axes=(0,), stack=1)}


def _batches(seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(STEPS):
    rows = {"small": {"kernel": rng.standard_normal((16, 6))}, "wide": {"kernel": rng.standard_normal((16, 400))},
            "stack": {"kernel": rng.standard_normal((3, 16, 5))}}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), _params())
    yield grads, jax.tree.map(lambda r: jnp.asarray(r, jnp.float32), rows)


def _conditioning(apart, **refresh):
  return sk.scale_by_sketched_conditioning(
      sk.Conditioning(rank=2,
                      refresh=sk.Refresh(every=3, apart=apart, **refresh),
                      statistics=sk.Statistics(kind="auto"),
                      input_axes=AXES))


def _run(tx, apart):
  state, out = tx.init(_params()), []
  update = jax.jit(lambda g, s, x: tx.update(g, s, _params(), layer_inputs=x))
  for grads, rows in _batches():
    updates, state = update(grads, state, rows)
    if apart:
      state = sk.refresh_conditioners(state)
    out.append((updates, state))
  return out


def _close(a, b, tol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("stagger,warm_start", [(True, True), (False, False)])
def test_the_factors_apart_are_the_steps_and_an_update_uses_those_of_the_update_before(stagger, warm_start):
  inline = _run(_conditioning(False, stagger=stagger, warm_start=warm_start), apart=False)
  apart = _run(_conditioning(True, stagger=stagger, warm_start=warm_start), apart=True)
  state = apart[0][1]
  assert kernel_lines(state.summary()) == {"small/kernel": "dense C, full C^(1/2), n=6",
                             "stack/kernel": "dense C, full C^(1/2), n=5, per layer of a stack (3,)",
                             "wide/kernel": "streaming C Omega, rank 2, n=400"}
  for (_, s_in), (_, s_ap) in zip(inline, apart):
    # one computation in two programs: XLA fuses them apart, and the streaming kernel's SVD moves rounding by 1e-6
    _close(s_in.factors, s_ap.factors, 1e-5)
    _close(s_in.statistics, s_ap.statistics)
    np.testing.assert_array_equal(s_in.key, s_ap.key)
  first = sk.scale_by_sketched_conditioning(sk.Conditioning(rank=2, input_axes=AXES)).init(
      _params()).factors  # A = I before any refresh
  grads = [g for g, _ in _batches()]
  for t, (updates, _) in enumerate(apart):
    factors = first if t == 0 else inline[t - 1][1].factors
    assert jnp.array_equal(updates["small"]["bias"], grads[t]["small"]["bias"])  # no kernel: plain
    expect_small = sketch.precondition_kernel(factors["small/kernel"], grads[t]["small"]["kernel"], (0,))
    expect_wide = sketch.precondition_kernel(factors["wide/kernel"], grads[t]["wide"]["kernel"], (0,))
    expect_stack = jax.vmap(lambda f, g: sketch.precondition_kernel(f, g, (0,)))(factors["stack/kernel"],
                                                                                grads[t]["stack"]["kernel"])
    _close(updates["small"]["kernel"], expect_small, 1e-5)
    _close(updates["wide"]["kernel"], expect_wide, 1e-5)
    _close(updates["stack"]["kernel"], expect_stack, 1e-5)


def test_the_step_apart_never_rebuilds_a_factor():
  tx = _conditioning(True)
  state = tx.init(_params())
  for grads, rows in _batches():
    _, state = tx.update(grads, state, _params(), layer_inputs=rows)
  _close(state.factors, tx.init(_params()).factors, 0.0)


def test_refresh_apart_through_optax_wrappers_and_under_jit():
  """In front of AdamW, under inject_hyperparams, and with refresh_conditioners inside a jitted function."""
  def build(apart):
    inner = optax.inject_hyperparams(lambda learning_rate: optax.chain(
        _conditioning(apart), optax.adamw(learning_rate)))(learning_rate=0.01)
    return inner

  def run(apart):
    tx = build(apart)
    state, params = tx.init(_params()), _params()

    @jax.jit
    def step(params, state, grads, rows):
      updates, state = tx.update(grads, state, params, layer_inputs=rows)
      return optax.apply_updates(params, updates), (sk.refresh_conditioners(state) if apart else state)

    for grads, rows in _batches():
      params, state = step(params, state, grads, rows)
    return state

  inline, apart = run(False), run(True)
  _close(inline.inner_state[0].factors, apart.inner_state[0].factors)


def test_a_state_restored_into_a_fresh_build_refreshes_as_the_original():
  """A checkpoint restores into the template of a freshly built optimizer (its own refresher: two builds' states
  differ in their static refresher, whose statistics are each build's own functions, as a jitted step's static
  optimizer would); restored, it refreshes as the original, and the template of one build is its init's."""
  a, b = (sk.scsgd(0.1, sk.Conditioning(refresh=sk.Refresh(apart=True), input_axes=AXES)) for _ in range(2))
  state = a.init(_params())
  for grads, rows in _batches():
    _, state = a.update(grads, state, _params(), layer_inputs=rows)
  assert jax.tree.structure(state) == jax.tree.structure(jax.eval_shape(a.init, _params()))
  restored = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(b.init, _params())), jax.tree.leaves(state))
  _close(sk.refresh_conditioners(restored), sk.refresh_conditioners(state), 0.0)
  assert jax.tree.structure(state) != jax.tree.structure(sk.scsgd(0.1).init(_params()))


def test_a_state_without_a_refresh_apart_is_refused():
  with pytest.raises(ValueError, match=r"holds no conditioning whose refreshes run apart.*Refresh\(apart=True\)"):
    sk.refresh_conditioners(sk.scsgd(0.1).init(_params()))
  with pytest.raises(ValueError, match="holds no conditioning"):
    sk.refresh_conditioners(optax.adamw(0.1).init(_params()))


@pytest.mark.parametrize("build", [
    lambda r: sk.scsgd_eigen(0.1, sk.Conditioning(refresh=r)),
    lambda r: sk.scsgd_eigen_muon(0.1, sk.Conditioning(refresh=r)),
    lambda r: sk.scale_by_eigenbasis_adam(sk.Conditioning(refresh=r)),
    lambda r: sk.contrib.scsgd_two_sided(0.1, sk.Conditioning(refresh=r)),
    lambda r: sk.contrib.scale_by_output_conditioning(sk.Conditioning(refresh=r)),
], ids=["scsgd_eigen", "scsgd_eigen_muon", "scale_by_eigenbasis_adam", "scsgd_two_sided", "output_side"])
def test_transformations_that_refresh_inside_their_update_refuse_apart(build):
  with pytest.raises(ValueError, match=r"Refresh\(apart=True\) is for the input side's conditioning only"):
    build(sk.Refresh(apart=True))


def test_apart_must_be_a_bool():
  with pytest.raises((TypeError, ValueError), match="Refresh.apart"):
    sk.Refresh(apart=1)


def test_an_nnx_optimizer_refreshes_apart_in_place_as_in_its_step():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = nnx.Linear(6, 32, rngs=rngs), nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  def run(apart):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model,
                              sk.scsgd(0.1, sk.Conditioning(refresh=sk.Refresh(every=2, apart=apart))),
                              wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
      def loss_fn(model):
        out, layer_inputs = sk.capture_nnx(model, x)
        return jnp.mean(out**2), layer_inputs

      (_, layer_inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      optimizer.update(model, grads, layer_inputs=layer_inputs)
      if apart:
        sk.refresh_conditioners(optimizer.opt_state)

    for t in range(4):
      step(model, optimizer, jax.random.normal(jax.random.PRNGKey(t), (8, 6)))
    return optimizer.opt_state[0]

  # the first layer reads the data alone, so its statistics and factors are the same in both runs (the second
  # layer's inputs differ from the first step on: the step's first update conditions with the factor before)
  inline, apart = run(False), run(True)
  assert inline.summary()["l1/kernel"] == "dense C, full C^(1/2), n=6"
  factor = lambda s: [np.asarray(v[...]) for v in jax.tree.leaves(s.factors["l1/kernel"])]
  assert not np.allclose(factor(inline)[0], np.eye(6), atol=1e-3)  # refreshed from the data
  _close(factor(inline), factor(apart))


@pytest.mark.parametrize("kind,keyed", [("auto", False), ("dense", True)])
def test_a_refresh_draws_keys_only_for_factors_that_read_them(kind, keyed):
  """The sketch of a dense C (``kind='dense'`` at rank 2) draws its test matrix: each update splits the state's key,
  one per kernel; the full conditioner, the streaming sketch and the diagonal (``'auto'`` here) draw nothing, and
  the key stays as it is."""
  tx = sk.scale_by_sketched_conditioning(sk.Conditioning(rank=2, statistics=sk.Statistics(kind=kind), input_axes=AXES))
  state = tx.init(_params())
  assert any(s.startswith("dense C, rank") for s in state.summary().values()) == keyed
  grads, rows = next(_batches())
  _, new = tx.update(grads, state, _params(), layer_inputs=rows)
  np.testing.assert_array_equal(new.key, jax.random.split(state.key, 4)[0] if keyed else state.key)


def test_a_priming_call_conditions_the_first_update_as_the_step_would():
  """``refresh_conditioners(state, layer_inputs=first)`` before the first update builds the factors that update's own
  refresh would (from the statistics with its rows folded in, the statistics left to the update): the first update
  is the default's, where without it the first update is plain (the identity conditioner). The sketched kernel
  draws the same sketch (the same key), the others are exact."""
  batches = list(_batches())
  default = _run(_conditioning(False), apart=False)
  tx = _conditioning(True)
  state = sk.refresh_conditioners(tx.init(_params()), layer_inputs=batches[0][1])
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(_params()))
  np.testing.assert_array_equal(state.statistics["small/kernel"].moments,
                                tx.init(_params()).statistics["small/kernel"].moments)  # left to the update
  updates, state = tx.update(batches[0][0], state, _params(), layer_inputs=batches[0][1])
  _close(updates, default[0][0], tol=1e-5)
  _close(state.statistics, default[0][1].statistics)
  plain, _ = tx.update(batches[0][0], tx.init(_params()), _params(), layer_inputs=batches[0][1])
  assert not np.allclose(plain["small"]["kernel"], default[0][0]["small"]["kernel"], atol=1e-3)


def test_priming_refuses_rows_that_do_not_fit_the_plans():
  tx = _conditioning(True)
  rows = {"small": {"kernel": jnp.ones((4, 7))}, "wide": {"kernel": jnp.ones((4, 400))},
          "stack": {"kernel": jnp.ones((3, 4, 5))}}
  with pytest.raises(ValueError, match=r"layer_inputs\['small/kernel'\] has shape \(4, 7\)"):
    sk.refresh_conditioners(tx.init(_params()), layer_inputs=rows)
