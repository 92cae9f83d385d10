"""docs/how_it_works.md's recipes for a recurrent model and a mixture of experts run as written: each block is
executed, its model trained a few steps by the README's NNX step, and its plans are what the block says."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scsgd_jax

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "how_it_works.md"


def _block(marker: str) -> str:
  blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
  return next(b for b in blocks if marker in b)


@nnx.jit
def _step(model, optimizer, x, y, key):  # the README's NNX step
  def loss_fn(model):
    out, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key)
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), layer_inputs
  (loss, layer_inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads, layer_inputs=layer_inputs)
  return loss


def _train(scope, x, y):
  losses = [float(_step(scope["model"], scope["optimizer"], x, y, jax.random.PRNGKey(i))) for i in range(25)]
  assert np.isfinite(losses).all() and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  return scsgd_jax.plans(scope["optimizer"].opt_state)


def _scope(**data):
  return {"jax": jax, "jnp": jnp, "nnx": nnx, "optax": optax, "scsgd_jax": scsgd_jax, **data}


def test_the_recurrent_recipe_runs_as_written_and_conditions_every_gate_kernel():
  ids = jnp.arange(4 * 12).reshape(4, 12) % 7
  scope = _scope(vocab=7, ids=ids)
  exec(_block("class CharLSTM"), scope)
  plans = _train(scope, ids, jnp.roll(ids, -1, axis=1))
  for path in ("rnn/cell/dense_i/kernel", "rnn/cell/dense_h/kernel", "head/kernel"):
    assert plans[path].startswith("dense C"), plans
  assert plans["embed/embedding"].startswith("token frequencies"), plans


@pytest.mark.parametrize("experts", [4])
def test_the_mixture_of_experts_recipe_runs_as_written_and_conditions_each_expert(experts):
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 8))
  scope = _scope(x=x)
  exec(_block("class MoE"), scope)
  plans = _train(scope, x, (x[:, 0] > 0).astype(jnp.int32))
  for path in ("w_in", "w_out"):
    assert f"per layer of a stack ({experts},)" in plans[path] and not plans[path].startswith("not"), plans
  assert not plans["router/kernel"].startswith("not"), plans
