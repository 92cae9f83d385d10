"""Output-side and two-sided conditioning (issue 20, direction 1) against dense numpy oracles.

The output side's rows are the back-propagated ``delta`` of each layer, the gradient of the loss with respect to
zero perturbations added to the layer's output; the two-sided update is ``C^{-1/2} G Delta^{-1/2}``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import scsgd_jax as sk
from scsgd_jax._src import defaults
from tests import helpers
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
  perturbations = sk.output_perturbations_nnx(layer, x)

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
  perturbations = sk.output_perturbations_nnx(layer, x)
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
  perturbations = sk.output_perturbations_linen(module, variables, x)

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
  tx = optax.chain(sk.scale_by_sketched_conditioning(**args), sk.scale_by_output_conditioning(**args),
                   optax.sgd(LR))
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
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


def test_scsgd_two_sided_first_step_by_hand():
  """A 2-layer MLP: fc1's delta back-propagated by hand, its first step is the grafted, momentum-scaled
  C^{-1/2} G Delta^{-1/2} at the norm of normalized RMSprop's first step (sign(g): sqrt(size))."""
  model = MLP(nnx.Rngs(0))
  x = jnp.asarray(RNG.standard_normal((32, 5)), jnp.float32)
  target = jnp.asarray(RNG.standard_normal((32, 3)), jnp.float32)
  tx = sk.scsgd_two_sided(LR, conditioner="full", statistics="dense", ema_rate=1.0, update_every=1,
                          statistics_every=1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  w1, w2 = np.asarray(model.fc1.kernel[...], np.float64), np.asarray(model.fc2.kernel[...], np.float64)

  @nnx.jit
  def step(model, optimizer):
    perturbations = sk.output_perturbations_nnx(model, x)

    def loss_fn(model, perturbations):
      out, li = sk.capture_nnx(model, x, output_perturbations=perturbations)
      return 0.5 * jnp.mean(jnp.sum((out - target) ** 2, axis=-1)), li

    (loss, li), (grads, output_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        model, perturbations)
    optimizer.update(model, grads, layer_inputs=li, output_grads=output_grads)
    return loss

  step(model, optimizer)
  xs, ts = np.asarray(x, np.float64), np.asarray(target, np.float64)
  h = xs @ w1
  delta2 = (np.maximum(h, 0) @ w2 - ts) / 32
  delta1 = (delta2 @ w2.T) * (h > 0)
  g1 = xs.T @ delta1
  direction = floored_power(xs.T @ xs / 32, -0.5) @ g1 @ floored_power(delta1.T @ delta1 / 32, -0.5)
  expected = -LR * (1 + defaults.MOMENTUM) * direction * np.sqrt(g1.size) / np.linalg.norm(direction)
  np.testing.assert_allclose(np.asarray(model.fc1.kernel[...]) - w1, expected, rtol=2e-3, atol=1e-5)


def test_two_sided_step_does_not_depend_on_the_loss_scale():
  """Grafted, the step is invariant to multiplying the loss by 1e4 (both sides' floors are relative)."""
  layer = nnx.Linear(8, 6, use_bias=False, rngs=nnx.Rngs(0))
  target = jnp.asarray(RNG.standard_normal((2, 5, 6)), jnp.float32)
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  tx = sk.scsgd_two_sided(LR)
  steps = []
  for scale in (1.0, 1e4):
    li, grads, deltas = _nnx_grads(layer, X3, scale * target)
    steps.append(tx.update(grads, tx.init(params), params, layer_inputs=li, output_grads=deltas)[0]["kernel"])
  np.testing.assert_allclose(steps[0], steps[1], rtol=1e-4, atol=1e-7)
  assert np.all(np.isfinite(steps[0]))


def test_output_side_errors_name_the_culprit():
  layer = nnx.Linear(8, 6, use_bias=False, rngs=nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  tx = sk.scale_by_output_conditioning()
  with pytest.raises(ValueError, match="needs the keyword argument `output_grads`"):
    tx.update(params, tx.init(params), params, layer_inputs={})
  with pytest.raises(TypeError, match="output_axes="):
    sk.scale_by_output_conditioning(input_axes={"kernel": (0,)})
  wrong = sk.output_perturbations_nnx(layer, X3[:1])
  with pytest.raises(ValueError, match=r"output_perturbations\['kernel'\] has shape \(5, 6\), expected \(10, 6\)"):
    sk.capture_nnx(layer, X3, output_perturbations=wrong)

  class Twice(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.fc(self.fc(x))

  with pytest.raises(NotImplementedError, match="'fc/kernel' is called more than once"):
    sk.output_perturbations_nnx(Twice(), X3)
