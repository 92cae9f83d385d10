"""The one training step of the experiments: the training loop, the step-cost benchmark and the development
task all run it, for every optimizer, with the capture its registry entry names.

It is the README's NNX recipe on pure state (``tests/experiments/test_step.py`` checks the two give the
same parameters): one forward pass gives the loss and the captured layer inputs, then ``tx.update``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import scsgd_jax
from experiments.optim import registry

# registry.CAPTURES, and 'rows' (the step-cost benchmark's probe: the rows computed, summed, not used)
CAPTURES = (*registry.CAPTURES, "rows")


def split(model: nnx.Module):
  """``(graphdef, params, rest)`` of ``model`` as pure trees: ``rest`` its other state (BatchNorm's)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.as_pure(params), nnx.as_pure(rest)


def make_train_step(graphdef, tx: optax.GradientTransformation, capture: str, max_rows, *, donate: bool = True):
  """``step(params, rest, opt_state, inputs, labels, key) -> (params, rest, opt_state, loss, error)``, jitted.

  ``capture`` (:data:`CAPTURES`) says what ``tx.update`` is given: ``'inputs'``, ``layer_inputs=`` from
  :func:`scsgd_jax.capture_nnx`; ``'two_sided'``, also ``output_grads=``, the loss's gradient with respect to
  zero perturbations of the layers' outputs; ``'model'``, ``batch=(inputs, labels)`` and ``key=`` (K-FAC runs
  the model itself); ``'none'``, nothing. The loss is the mean softmax cross-entropy over every prediction,
  ``error`` the fraction of wrong argmaxes. ``donate``: the step reuses the buffers of its first three
  arguments.
  """
  if capture not in CAPTURES:
    raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}.")

  def loss_fn(params, perturbations, rest, inputs, labels, key):
    model = nnx.merge(graphdef, params, rest)
    if capture in ("none", "model"):
      logits, rows = model(inputs), None
    else:
      logits, rows = scsgd_jax.capture_nnx(model, inputs, rng=key, max_rows=max_rows,
                                           output_perturbations=perturbations)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    error = jnp.mean(jnp.argmax(logits, -1) != labels)
    return loss, (error, rows, nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param))))

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2) if donate else ())
  def step(params, rest, opt_state, inputs, labels, key):
    perturbations = None
    if capture == "two_sided":
      perturbations = scsgd_jax.contrib.output_perturbations_nnx(nnx.merge(graphdef, params, rest), inputs)
    (loss, (error, rows, rest)), (grads, output_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, perturbations, rest, inputs, labels, key)
    extra = {}
    if capture in ("inputs", "two_sided"):
      extra["layer_inputs"] = rows
    if capture == "two_sided":
      extra["output_grads"] = output_grads
    if capture == "model":
      extra.update(batch=(inputs, labels), key=jax.random.fold_in(key, 1))
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    if capture == "rows":  # the rows' cost without their use (a sum keeps them from being dropped)
      loss = loss + 0.0 * sum(jnp.sum(r) for r in jax.tree.leaves(rows))
    return optax.apply_updates(params, updates), rest, opt_state, loss, error

  return step
