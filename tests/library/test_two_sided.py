"""Output-side and two-sided conditioning (issue 20, direction 1) against dense numpy oracles.

The output side's rows are the back-propagated ``delta`` of each layer, the gradient of the loss with respect to
zero perturbations added to the layer's output; the two-sided update is ``C^{-1/2} G Delta^{-1/2}``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scsgd_jax as sk
from scsgd_jax._src import defaults
from tests.library.test_layers import CASES, X3, _kernel_matrix

LR = 0.1
RNG = np.random.default_rng(1)
KERNEL_CASES = [c for c in CASES if c[0] != "embed"]
IDS = [c[0] for c in KERNEL_CASES]


def floored_power(c, power, floor=defaults.EIGENVALUE_FLOOR):
  """``C^power`` with the eigenvalues raised to ``floor * tr(C) / n`` first (the optimizer's damping)."""
  c = np.asarray(c, np.float64)
  w, v = np.linalg.eigh(c)
  w = np.maximum(w, floor * np.trace(c) / c.shape[0])
  return (v * w ** power) @ v.T


def _nnx_grads(layer, x, target):
  """``(layer_inputs, grads, output_grads)`` of ``sum(layer(x) * target)`` under the README's recipe."""
  perturbations = sk.contrib.output_perturbations_nnx(layer, x)

  def loss(m, perturbations):
    out, li = sk.capture_nnx(m, x, max_rows=None, output_perturbations=perturbations)
    return jnp.sum(out * target), li

  (_, li), (grads, output_grads) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, perturbations)
  return li, nnx.as_pure(grads), output_grads


@pytest.mark.parametrize("name,make,_,x,axes", KERNEL_CASES, ids=IDS)
def test_nnx_output_rows_are_the_deltas_of_the_kernel_gradient(name, make, _, x, axes):
  """rows^T delta is the kernel's gradient read as (inputs, outputs): the deltas are exact and in the kernel's
  output-axis order; the zero perturbations leave the output unchanged."""
  layer = make(nnx.Rngs(0))
  target = jnp.asarray(RNG.standard_normal(layer(x).shape), jnp.float32)
  perturbations = sk.contrib.output_perturbations_nnx(layer, x)
  out, _ = sk.capture_nnx(layer, x, output_perturbations=perturbations)
  np.testing.assert_array_equal(out, layer(x))
  li, grads, deltas = _nnx_grads(layer, x, target)
  out_axes = tuple(a for a in range(grads["kernel"].ndim) if a not in axes)
  assert isinstance(deltas, sk.CapturedInputs) and deltas.input_axes == {"kernel": out_axes}
  g_mat, _ = _kernel_matrix(grads["kernel"], axes)
  rows, delta = np.asarray(li["kernel"], np.float64), np.asarray(deltas["kernel"], np.float64)
  assert delta.shape == (rows.shape[0], g_mat.shape[1])
  np.testing.assert_allclose(rows.T @ delta, g_mat, rtol=1e-5, atol=1e-5)


def test_output_rows_by_hand():
  """Einsum 'btd,dnh->btnh' (output axes n, h): delta is the target with (n, h) flattened, row per (b, t)."""
  layer = nnx.Einsum("btd,dnh->btnh", (8, 2, 3), rngs=nnx.Rngs(0))
  target = jnp.asarray(RNG.standard_normal((2, 5, 2, 3)), jnp.float32)
  _, _, deltas = _nnx_grads(layer, X3, target)
  np.testing.assert_array_equal(deltas["kernel"], np.asarray(target).reshape(10, 6))


@pytest.mark.parametrize("name,_,module,x,axes", KERNEL_CASES, ids=IDS)
def test_linen_output_rows_are_the_deltas_of_the_kernel_gradient(name, _, module, x, axes):
  if hasattr(module, "use_bias"):
    module = module.clone(use_bias=False)
  variables = module.init(jax.random.PRNGKey(0), x)
  target = jnp.asarray(RNG.standard_normal(module.apply(variables, x).shape), jnp.float32)
  perturbations = sk.contrib.output_perturbations_linen(module, variables, x)

  def loss(params, perturbations):
    out, li = sk.capture_linen(module, {"params": params}, x, max_rows=None, output_perturbations=perturbations)
    return jnp.sum(out * target), li

  (_, li), (grads, deltas) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      variables["params"], perturbations)
  out_axes = tuple(a for a in range(grads["kernel"].ndim) if a not in axes)
  assert deltas.input_axes == {"kernel": out_axes}
  g_mat, _ = _kernel_matrix(grads["kernel"], axes)
  np.testing.assert_allclose(np.asarray(li["kernel"]).T @ np.asarray(deltas["kernel"]), g_mat,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,make,_,x,axes", KERNEL_CASES, ids=IDS)
def test_one_two_sided_step_equals_dense_oracle(name, make, _, x, axes):
  """C and Delta from this batch (ema_rate = 1), full conditioners: the update is -lr C^{-1/2} G Delta^{-1/2}."""
  layer = make(nnx.Rngs(0))
  target = jnp.asarray(RNG.standard_normal(layer(x).shape), jnp.float32)
  li, grads, deltas = _nnx_grads(layer, x, target)
  args = dict(conditioner="full", statistics="dense", ema_rate=1.0, update_every=1, statistics_every=1)
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  out_axes = tuple(a for a in range(params["kernel"].ndim) if a not in axes)  # plans are fixed at init: told
  tx = optax.chain(
      sk.scale_by_sketched_conditioning(sk.Conditioning.from_flat(input_axes={"kernel": sk.Layout(axes)}, **args)),
      sk.contrib.scale_by_output_conditioning(sk.Conditioning.from_flat(**args),
                                              output_axes={"kernel": sk.Layout(out_axes)}), optax.sgd(LR))
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params, layer_inputs=li, output_grads=deltas)
  rows, delta = np.asarray(li["kernel"], np.float64), np.asarray(deltas["kernel"], np.float64)
  c, d = rows.T @ rows / rows.shape[0], delta.T @ delta / delta.shape[0]
  g_mat, _ = _kernel_matrix(grads["kernel"], axes)
  expected = floored_power(c, -0.5) @ g_mat @ floored_power(d, -0.5)
  got, _ = _kernel_matrix(updates["kernel"], axes)
  np.testing.assert_allclose(got, -LR * expected, rtol=2e-3, atol=1e-4)
  assert state[1].summary() == {"kernel": f"dense C, full C^(1/2), n={g_mat.shape[1]}"}


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1, self.fc2 = nnx.Linear(5, 7, use_bias=False, rngs=rngs), nnx.Linear(7, 3, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))


def test_two_sided_step_does_not_depend_on_the_loss_scale():
  """Grafted, the step is invariant to multiplying the loss by 1e4 (both sides' floors are relative)."""
  layer = nnx.Linear(8, 6, use_bias=False, rngs=nnx.Rngs(0))
  target = jnp.asarray(RNG.standard_normal((2, 5, 6)), jnp.float32)
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  tx = sk.contrib.scsgd_two_sided(LR)
  steps = []
  for scale in (1.0, 1e4):
    li, grads, deltas = _nnx_grads(layer, X3, scale * target)
    steps.append(tx.update(grads, tx.init(params), params, layer_inputs=li, output_grads=deltas)[0]["kernel"])
  np.testing.assert_allclose(steps[0], steps[1], rtol=1e-4, atol=1e-7)
  assert np.all(np.isfinite(steps[0]))


def test_output_side_errors_name_the_culprit():
  layer = nnx.Linear(8, 6, use_bias=False, rngs=nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  tx = sk.contrib.scale_by_output_conditioning()
  with pytest.raises(ValueError, match="needs the keyword argument `output_grads`"):
    tx.update(params, tx.init(params), params, layer_inputs={})
  with pytest.raises(TypeError, match=re.escape("takes no rank: the conditioning's settings are one argument, rank is "
                                                "scsgd_jax.Conditioning(rank=...)")):
    sk.contrib.scale_by_output_conditioning(rank=2)
  wrong = sk.contrib.output_perturbations_nnx(layer, X3[:1])
  with pytest.raises(ValueError, match=r"output_perturbations\['kernel'\] has shape \(5, 6\), expected \(10, 6\)"):
    sk.capture_nnx(layer, X3, output_perturbations=wrong)

  class Twice(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.fc(self.fc(x))

  with pytest.raises(NotImplementedError, match="'fc/kernel' is called more than once"):
    sk.contrib.output_perturbations_nnx(Twice(), X3)


def _mlp_two_sided_direction(xs, w1, w2, ts):
  """Both layers' ``C^{-1/2} G Delta^{-1/2}`` (floored, this batch's statistics) and the loss's gradients."""
  m = xs.shape[0]
  h = xs @ w1
  r = np.maximum(h, 0)
  delta2 = (r @ w2 - ts) / m
  delta1 = (delta2 @ w2.T) * (h > 0)
  out = []
  for x, d in ((xs, delta1), (r, delta2)):
    g = x.T @ d
    out.append((floored_power(x.T @ x / m, -0.5) @ g @ floored_power(d.T @ d / m, -0.5), g))
  return out


@pytest.mark.parametrize("magnitude", ["rms", "sign"])
def test_scsgd_two_sided_two_steps_by_hand(magnitude):
  """Two steps of the 2-layer MLP: each layer's direction at the norm of the base step (``sign``:
  ``sqrt(size)`` every step; ``rms``: normalized RMSprop's second step from its bias-corrected second
  moment), then Nesterov momentum; the sides' statistics are each step's batch (ema_rate=1)."""
  model = MLP(nnx.Rngs(0))
  rng = np.random.default_rng(3)
  batches = [(rng.standard_normal((32, 5)), rng.standard_normal((32, 3))) for _ in range(2)]
  tx = sk.contrib.scsgd_two_sided(LR,
                                  sk.Conditioning(conditioner=sk.Conditioner(kind="full"),
                                                  statistics=sk.Statistics(kind="dense", ema_rate=1.0, fold_every=1),
                                                  refresh=sk.Refresh(every=1)),
                                  magnitude=magnitude)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, target):
    perturbations = sk.contrib.output_perturbations_nnx(model, x)

    def loss_fn(model, perturbations):
      out, li = sk.capture_nnx(model, x, output_perturbations=perturbations)
      return 0.5 * jnp.mean(jnp.sum((out - target) ** 2, axis=-1)), li

    (_, li), (grads, output_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(model, perturbations)
    optimizer.update(model, grads, layer_inputs=li, output_grads=output_grads)

  w = [np.asarray(model.fc1.kernel[...], np.float64), np.asarray(model.fc2.kernel[...], np.float64)]
  trace, nu = [0.0, 0.0], [0.0, 0.0]
  decay = defaults.GRAFT_DECAY
  for t, (x, target) in enumerate(batches, start=1):
    step(model, optimizer, jnp.asarray(x, jnp.float32), jnp.asarray(target, jnp.float32))
    for i, (d, g) in enumerate(_mlp_two_sided_direction(x, *w, target)):
      if magnitude == "sign":
        norm = np.sqrt(g.size)
      else:
        unit = g / np.linalg.norm(g)
        nu[i] = decay * nu[i] + (1 - decay) * unit ** 2
        norm = np.linalg.norm(unit / (np.sqrt(nu[i] / (1 - decay ** t)) + defaults.GRAFT_EPS))
      grafted = d * norm / np.linalg.norm(d)
      trace[i] = grafted + defaults.MOMENTUM * trace[i]
      w[i] = w[i] - LR * (grafted + defaults.MOMENTUM * trace[i])
    np.testing.assert_allclose(np.asarray(model.fc1.kernel[...]), w[0], rtol=2e-3, atol=2e-5)
    np.testing.assert_allclose(np.asarray(model.fc2.kernel[...]), w[1], rtol=2e-3, atol=2e-5)


def test_factored_magnitude_is_adafactors_moments_of_the_normalized_gradient():
  """Three steps by hand: each leaf divided by its norm; a (130, 140) leaf and a (2, 3, 150, 129) conv kernel keep
  Adafactor's row and column moments over their two largest axes (EMAs at the graft's decay, bias-corrected,
  eps^2 in each square), read as r c^T / mean(r); a (4, 5) leaf, under 128 to factor, is
  scale_by_normalized_rms'."""
  decay, eps = 0.9, 1e-3
  tx = sk.contrib.scale_by_normalized_factored_rms(decay, eps)
  gs = [{"big": RNG.standard_normal((130, 140)) * np.linspace(0.1, 3, 140), "small": RNG.standard_normal((4, 5)),
         "conv": RNG.standard_normal((2, 3, 150, 129))} for _ in range(3)]
  rms = sk.contrib.scale_by_normalized_rms(decay, eps)
  rms_state = rms.init(jax.tree.map(jnp.zeros_like, gs[0]))
  state = tx.init(jax.tree.map(jnp.zeros_like, gs[0]))
  row = col = crow = ccol = 0.0
  for t, g in enumerate(gs, start=1):
    g32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), g)
    out, state = jax.jit(tx.update)(g32, state)
    want_rms, rms_state = jax.jit(rms.update)(g32, rms_state)
    big, conv = (g[k] / np.linalg.norm(g[k]) for k in ("big", "conv"))
    corrected = lambda m, x: (decay * m * (1 - decay ** (t - 1)) + (1 - decay) * x) / (1 - decay ** t)
    row, col = corrected(row, (big ** 2 + eps ** 2).mean(1)), corrected(col, (big ** 2 + eps ** 2).mean(0))
    crow, ccol = corrected(crow, (conv ** 2 + eps ** 2).mean(3)), corrected(ccol, (conv ** 2 + eps ** 2).mean(2))
    np.testing.assert_allclose(out["big"], big / np.sqrt(np.outer(row, col) / row.mean()), rtol=2e-4)
    v_conv = (crow / crow.mean(2, keepdims=True))[..., None] * ccol[:, :, None, :]  # axes 2 and 3 factored
    np.testing.assert_allclose(out["conv"], conv / np.sqrt(v_conv), rtol=2e-4)
    np.testing.assert_allclose(out["small"], want_rms["small"], rtol=1e-6)  # RMSprop's, to rounding
  _, rms_part, factored_part = (getattr(s, "inner_state", s) for s in state)
  assert [np.shape(a) for a in (factored_part.rows["big"], factored_part.cols["big"])] == [(130,), (140,)]
  assert isinstance(rms_part.nu["big"], optax.MaskedNode) and rms_part.nu["small"].shape == (4, 5)


class TinyLM(nnx.Module):
  """An embedding, an attention-shaped and an MLP-shaped block and a head (two-sided's memory test)."""

  def __init__(self, rngs, v=65, d=32):
    self.embed = nnx.Embed(v, d, rngs=rngs)
    self.qkv, self.out = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
    self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
    self.norm, self.head = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, v, rngs=rngs)


@pytest.mark.parametrize("magnitude,share,within_adam", [("sign", 0.5, True), ("rms", 0.5, False), ("sign", 1.0, False)])
def test_two_sided_state_is_within_adams_with_sign_magnitude_and_half_shares(magnitude, share, within_adam):
  """``magnitude='sign', memory_share=0.5``: momentum plus both sides' statistics fit in Adam's two floats per
  parameter (the sides take half the memory rule's budget each); the base step's state or a side each do not."""
  params = nnx.as_pure(nnx.state(TinyLM(nnx.Rngs(0)), nnx.Param))
  floats = lambda state: sum(np.size(x) for x in jax.tree.leaves(state))
  adam = floats(optax.adam(0.1).init(params))
  state = sk.contrib.scsgd_two_sided(LR, magnitude=magnitude, memory_share=share).init(params)
  assert (floats(state) <= adam) == within_adam, (floats(state), adam)
  if within_adam:  # and the sides spend the budget: every kernel (but the embedding's output) on both sides
    sides = state[0].direction
    assert set(sides[1].factors) == {"qkv/kernel", "out/kernel", "up/kernel", "down/kernel", "head/kernel"}
    assert set(sides[0].factors) == set(sides[1].factors) | {"embed/embedding"}
    assert floats(state) >= 0.95 * adam


@pytest.mark.parametrize("magnitude,most", [("factored", 1.0), ("rms", 1.5)])
def test_default_two_sided_state_on_wide_kernels_is_within_adams(magnitude, most):
  """Kernels of n = 256 and 1,024 (the sharding study's): the default factored base step keeps n + p floats per
  kernel, so momentum, the base step and both sides' statistics stay within Adam's two floats per parameter
  (0.87x); normalized RMSprop's float per parameter takes 1.37x."""
  params = {"up": {"kernel": jnp.zeros((256, 1024)), "bias": jnp.zeros(1024)},
            "down": {"kernel": jnp.zeros((1024, 256)), "bias": jnp.zeros(256)}}
  floats = lambda state: sum(np.size(x) for x in jax.tree.leaves(state))
  kw = {} if magnitude == "factored" else {"magnitude": magnitude}
  ratio = floats(sk.contrib.scsgd_two_sided(LR, **kw).init(params)) / floats(optax.adam(0.1).init(params))
  assert most - 0.5 < ratio <= most, ratio


def test_sign_magnitude_gives_an_unconditioned_leaf_its_normalized_gradient():
  """A bias (neither side conditions it) gets ``g sqrt(size) / |g|`` at the first step, times the rate and momentum."""
  layer = nnx.Linear(8, 6, rngs=nnx.Rngs(0))
  target = jnp.asarray(RNG.standard_normal((2, 5, 6)), jnp.float32)
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  li, grads, deltas = _nnx_grads(layer, X3, target)
  tx = sk.contrib.scsgd_two_sided(LR, magnitude="sign", memory_share=0.5)
  bias = tx.update(grads, tx.init(params), params, layer_inputs=li, output_grads=deltas)[0]["bias"]
  g = np.asarray(grads["bias"], np.float64)
  np.testing.assert_allclose(bias, -LR * (1 + defaults.MOMENTUM) * g * np.sqrt(g.size) / np.linalg.norm(g),
                             rtol=1e-5)


def test_scsgd_two_sided_refuses_an_argument_one_side_would_take_alone():
  for bad in ({"output_axes": {"kernel": (1,)}}, {"max_rows": 8}, {"budget_share": 0.3}):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(bad))}'"):
      sk.contrib.scsgd_two_sided(LR, **bad)
  # input_axes (the model's layouts) plans both sides at init: the output side along the axes the input side leaves
  tx = sk.contrib.scsgd_two_sided(LR, sk.Conditioning(input_axes={"kernel": sk.Layout((0,), 1)}))
  sides = [s for s in jax.tree.leaves(tx.init({"kernel": jnp.ones((3, 4, 5))}), is_leaf=lambda x: hasattr(x, "summary"))
           if hasattr(s, "summary")]
  assert sides[0].summary()["kernel"].endswith("n=4, per layer of a stack (3,)")
  assert sides[1].summary()["kernel"].endswith("n=5, per layer of a stack (3,)")
  with pytest.raises(ValueError, match="magnitude must be 'rms', 'factored' or 'sign', got 'adam'"):
    sk.contrib.scsgd_two_sided(LR, magnitude="adam")
