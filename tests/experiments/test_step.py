"""The experiments' one training step is the README's NNX recipe: for each capture, three steps of
``step.make_train_step`` on pure state give the parameters that ``nnx.Optimizer`` with ``nnx.jit`` gives
(the README's code, written out here), on a model with BatchNorm (state besides the parameters)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scsgd_jax
from experiments.optim import registry
from experiments.run import step as step_lib


class Net(nnx.Module):
  def __init__(self, rngs):
    # no bias before BatchNorm: its gradient would be float32 round-off alone, which every normalized step (Adam's,
    # the graft's) scales to a step of the rate, so two programs that round apart would differ there by the rate
    self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.dense = nnx.Linear(4 * 8 * 8, 5, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.norm(self.conv(x)))
    return self.dense(y.reshape(y.shape[0], -1))


TXS = {
    "none":
        lambda: optax.sgd(0.05, 0.9, nesterov=True),
    "inputs":
        lambda: scsgd_jax.scsgd(0.05, scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(every=2))),
    "two_sided":
        lambda: scsgd_jax.contrib.scsgd_two_sided(1e-2, scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(every=2)))
}


def _readme_nnx(model, tx, capture, batches):
  """The README's NNX quickstart (and its two-sided variant) as a user writes it."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y, key):
    perturbations = scsgd_jax.contrib.output_perturbations_nnx(model, x) if capture == "two_sided" else None

    def loss_fn(model, perturbations):
      if capture == "none":
        logits, layer_inputs = model(x), None
      else:
        logits, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key, output_perturbations=perturbations)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), layer_inputs

    (loss, layer_inputs), (grads, output_grads) = nnx.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(model, perturbations)
    extra = {} if capture == "none" else {"layer_inputs": layer_inputs}
    if capture == "two_sided":
      extra["output_grads"] = output_grads
    optimizer.update(model, grads, **extra)
    return loss

  for i, (x, y) in enumerate(batches):
    train_step(model, optimizer, x, y, jax.random.PRNGKey(i))
  return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("capture", sorted(TXS))
def test_the_training_step_is_the_readme_nnx_recipe(capture):
  rng = np.random.default_rng(0)
  batches = [(jnp.asarray(rng.standard_normal((8, 8, 8, 1)), jnp.float32), jnp.asarray(rng.integers(0, 5, 8)))
             for _ in range(3)]
  want = _readme_nnx(Net(nnx.Rngs(0)), TXS[capture](), capture, batches)
  graphdef, params, rest = step_lib.split(Net(nnx.Rngs(0)))
  tx = TXS[capture]()
  step, opt_state = step_lib.make_train_step(graphdef, tx, capture, max_rows=256), tx.init(params)
  for i, (x, y) in enumerate(batches):
    params, rest, opt_state, loss, error = step(params, rest, opt_state, x, y, jax.random.PRNGKey(i))
    assert np.isfinite(loss) and 0 <= error <= 1
  assert np.abs(np.asarray(rest["norm"]["mean"])).max() > 0  # BatchNorm's statistics moved
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), nnx.as_pure(want), params)


def test_every_registered_optimizer_names_a_capture_and_a_recipe_for_every_kind():
  for name, entry in registry.REGISTRY.items():
    assert entry.capture in registry.CAPTURES, name
    for kind in registry.KINDS:
      r = registry.recipe(name, kind)
      assert r.learning_rate > 0 and r.source, (name, kind)
  with pytest.raises(ValueError, match="capture must be one of"):
    step_lib.make_train_step(None, optax.sgd(0.1), "use", None)
  with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
    registry.entry("lion")
