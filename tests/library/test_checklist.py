"""optax's shared optimizer checklist (optax/contrib/_common_test.py), for each public alias: extra arguments
accepted, a parabola (least squares through a conditioned kernel) and Rosenbrock (plain leaves) solved,
inject_hyperparams equal to the plain call, MultiSteps, bf16 kept, the state stable under lax.cond, schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scsgd_jax as sk

# each alias at a rate on its own scale (SGD's, Adam's), a small rank with the dense C so that the sketch is
# exercised on the small kernel (the memory rule would leave it unconditioned)
ALIASES = {
    "scsgd": (lambda lr, **kw: sk.scsgd(
        lr, sk.Conditioning.from_flat(rank=2, statistics="dense", conditioner="sketched", **kw)), 0.05),
    "scsgd_eigen": (lambda lr, **kw: sk.scsgd_eigen(
        lr, sk.Conditioning.from_flat(rank=2, statistics="dense", conditioner="sketched", **kw)), 0.05),
    # the gradients' two-sided basis (SOAP's, sketched)
    "scsgd_eigen_soap": (lambda lr, **kw: sk.scsgd_eigen(lr,
                                                         sk.Conditioning.from_flat(
                                                             rank=2, statistics="dense", conditioner="sketched", **kw),
                                                         basis="gradients",
                                                         sides="both"), 0.05),
    # Muon's orthogonalized step on the kernel (its fixed spectral size sets the rate: the end's jitter), its
    # AdamW part on the plain leaves
    "scsgd_eigen_muon": (lambda lr, **kw: sk.scsgd_eigen_muon(
        lr, sk.Conditioning.from_flat(rank=2, statistics="dense", conditioner="sketched", **kw)), 0.02),
}
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((64, 8)) * np.linspace(0.3, 2.0, 8), jnp.float32)
W_STAR = jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32)


def _parabola_loss(params):
  return 0.5 * jnp.mean(jnp.sum((X @ params["dense"]["kernel"] - X @ W_STAR) ** 2, axis=-1))


def _fit(tx, loss, params, steps, inputs):
  def step(carry, _):
    params, state = carry
    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params, layer_inputs=inputs, loss=loss(params))  # an extra arg
    return (optax.apply_updates(params, updates), state), None

  (params, state), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps))((params, tx.init(params)))
  return params, state


@pytest.mark.parametrize("name", ALIASES)
def test_parabola_solved_with_extra_args(name):
  make, lr = ALIASES[name]
  params = {"dense": {"kernel": jnp.zeros((8, 3))}}
  # the rate decays to 0 (cosine), as Muon and SGD are run: a step of fixed spectral size (Muon's) jitters about
  # the solution at its rate's scale until the rate goes, and the round-off of the jitter's last step is not a test
  params, _ = _fit(make(optax.cosine_decay_schedule(lr, 1000)), _parabola_loss, params, 1000, {"dense": {"kernel": X}})
  np.testing.assert_allclose(params["dense"]["kernel"], W_STAR, atol=1e-3)


@pytest.mark.parametrize("name", ALIASES)
def test_rosenbrock_solved_on_plain_leaves(name):
  make, _ = ALIASES[name]
  loss = lambda p: (1.0 - p["w"][0]) ** 2 + 100.0 * (p["w"][1] - p["w"][0] ** 2) ** 2
  lr = 1e-3 if name == "scsgd" else 1e-2
  params, _ = _fit(make(lr), loss, {"w": jnp.zeros(2)}, 10_000, {})
  np.testing.assert_allclose(params["w"], [1.0, 1.0], atol=2e-2)


@pytest.mark.parametrize("name", ALIASES)
def test_inject_hyperparams_equals_the_plain_call(name):
  make, lr = ALIASES[name]
  fn = ALIASES[name][0]
  injected = optax.inject_hyperparams(lambda learning_rate: fn(learning_rate))(learning_rate=lr)
  params = {"dense": {"kernel": jnp.zeros((8, 3))}}
  want, _ = _fit(make(lr), _parabola_loss, params, 20, {"dense": {"kernel": X}})
  got, state = _fit(injected, _parabola_loss, params, 20, {"dense": {"kernel": X}})
  # Adam in an eigenbasis divides by small rotated second moments: XLA's other fusion of the injected program (the
  # rate an input, not a constant) moves its float32 round-off to ~1e-5 relative over 20 steps (3.5e-5 on two of
  # scsgd_eigen's 24 entries under the tests' compile flags, 1.3e-4 on one of scsgd_eigen_muon's with its step
  # batched over a bank); a rate not passed through would differ by O(1)
  rtol = 2e-4 if name in ("scsgd_eigen", "scsgd_eigen_soap", "scsgd_eigen_muon") else 1e-5
  np.testing.assert_allclose(got["dense"]["kernel"], want["dense"]["kernel"], rtol=rtol, atol=1e-6)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(lr)


@pytest.mark.parametrize("name", ALIASES)
def test_multisteps_and_schedule(name):
  make, lr = ALIASES[name]
  tx = optax.MultiSteps(make(optax.linear_schedule(lr, 0.5 * lr, 100)), every_k_schedule=2)
  params = {"dense": {"kernel": jnp.zeros((8, 3))}}
  params, state = _fit(tx, _parabola_loss, params, 400, {"dense": {"kernel": X}})
  assert int(state.gradient_step) == 200
  assert float(_parabola_loss(params)) < 0.05 * float(_parabola_loss({"dense": {"kernel": jnp.zeros((8, 3))}}))


@pytest.mark.parametrize("name", ALIASES)
def test_bf16_parameters_keep_their_dtype(name):
  make, lr = ALIASES[name]
  params = {"dense": {"kernel": jnp.zeros((8, 3), jnp.bfloat16), "bias": jnp.zeros(3, jnp.bfloat16)}}
  tx = make(lr)
  state = tx.init(params)
  grads = jax.tree.map(lambda a: jnp.ones_like(a), params)
  updates, _ = jax.jit(tx.update)(grads, state, params, layer_inputs={"dense": {"kernel": X.astype(jnp.bfloat16)}})
  assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
  assert all(np.all(np.isfinite(np.asarray(u, np.float32))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", ALIASES)
def test_state_stable_under_lax_cond(name):
  make, lr = ALIASES[name]
  tx = make(lr)
  params = {"dense": {"kernel": jnp.zeros((8, 3))}}
  state = tx.init(params)
  grads = jax.grad(_parabola_loss)(params)

  @jax.jit
  def step(state, take):
    return jax.lax.cond(take, lambda s: tx.update(grads, s, params, layer_inputs={"dense": {"kernel": X}})[1],
                        lambda s: s, state)

  for take in (True, False, True):
    state = step(state, take)
  assert int(state[0].count) == 2
  assert state[0].summary()["dense/kernel"] == "dense C, rank 2, n=8"
