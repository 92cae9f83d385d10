"""Capturing a Linen model's conditioned-layer inputs in the forward pass that computes the loss
(``nn.intercept_methods`` and ``Module.sow``; the model needs no change), and the ``TrainState`` helper."""

from __future__ import annotations

from typing import Optional

import jax
import optax
from flax import linen as nn

from scsgd_jax._src import captured as captured_lib
from scsgd_jax._src import defaults
from scsgd_jax._src.captured import CapturedInputs
from scsgd_jax._src.layers import LINEN_LAYERS
from scsgd_jax._src.layers import einsum_arg
from scsgd_jax._src.layers import layer_spec
from scsgd_jax._src.layout import Layout
from scsgd_jax._src.layout import Plain

__all__ = ["apply_gradients", "capture_linen", "input_axes_linen", "output_perturbations_linen"]

LINEN_COLLECTION = "layer_inputs"


def _linen_interceptor(max_rows, counter, record, unconditioned, full_ndim, sow=True, outputs=None, reads=None):
  def interceptor(next_fun, a, k, context):
    mod = context.module
    if context.method_name == "attend" and isinstance(mod, nn.Embed):  # a tied table: plain updates, said
      unconditioned[captured_lib.param_path("/".join(map(str, mod.path)), "embedding")] = captured_lib.TIED
      return next_fun(*a, **k)
    if context.method_name == "__call__" and isinstance(mod, LINEN_LAYERS) and a:
      name = "/".join(map(str, mod.path)) or type(mod).__name__
      try:
        spec = layer_spec(mod, name, einsum_arg(mod, a[1:], k))
        rows = spec.rows(jax.lax.stop_gradient(a[0]), max_rows, counter.key()) if sow else None
      except NotImplementedError as e:  # a layer kind the conditioning cannot read: plain updates, said
        for where in (unconditioned, outputs.unconditioned if outputs is not None else {}):
          where[captured_lib.param_path("/".join(map(str, mod.path)), "kernel")] = str(e)
        return next_fun(*a, **k)
      param_path = "/".join((*map(str, mod.path), spec.param))
      layout = captured_lib.layout(spec, mod, full_ndim.get(param_path))
      record[param_path] = layout
      if reads is not None:
        reads(param_path, spec, a[0])
      if sow and not mod.sow(LINEN_COLLECTION, spec.param, rows):
        raise ValueError(
            f"layer '{name}' runs inside a Linen lifted transform (nn.scan, nn.vmap, ...) that does not pass "
            f"the collection '{LINEN_COLLECTION}' through, so its inputs cannot be captured. List it next to "
            f"'params': nn.scan(..., variable_axes={{'params': 0, '{LINEN_COLLECTION}': 0}}) (the rows are then "
            "stacked like the kernels), as Flax asks for any collection sown inside a scan.")
      if outputs is not None:
        return outputs(param_path, spec, next_fun(*a, **k), layout)
    return next_fun(*a, **k)

  return interceptor


def _with_dropout(kwargs: dict, key) -> dict:
  """``kwargs`` for ``module.apply`` with a ``'dropout'`` stream from ``key`` unless ``rngs`` is given (Dropout in
  training mode needs one; a model without Dropout ignores it)."""
  return kwargs if "rngs" in kwargs else {**kwargs, "rngs": {"dropout": key}}


def _param_ndims(variables) -> dict[str, int]:
  """``{'layer/kernel': ndim}`` of the parameters (a stacked kernel has more axes than its layer declares)."""
  params = variables.get("params", {}) if hasattr(variables, "get") else {}
  return {path: getattr(leaf, "ndim", 0) for path, leaf in captured_lib.flat(params).items()}


def capture_linen(
    module: nn.Module,
    variables,
    *args,
    rng: Optional[jax.Array] = None,
    max_rows: Optional[int] = defaults.MAX_ROWS,
    mutable=(),
    output_perturbations=None,
    **kwargs,
):
  """``module.apply(variables, *args, **kwargs)`` capturing the inputs of its conditioned layers.

  Layers captured: ``nn.Dense``, ``nn.Conv``, ``nn.DenseGeneral`` (so every projection
  of ``nn.MultiHeadDotProductAttention``), ``nn.Einsum`` and ``nn.Embed``. Uses
  ``nn.intercept_methods`` and ``Module.sow`` into the collection
  ``'layer_inputs'``; the model needs no change.

  Args:
    module, variables, *args, **kwargs: as for ``module.apply``.
    rng, max_rows: as for :func:`capture_nnx`; ``rng`` also seeds Dropout's ``'dropout'`` stream (a key folded
      from it) unless ``rngs=`` is given.
    mutable: further mutable collections (e.g. ``['batch_stats']``); their new
      values are returned as a third output when given.
    output_perturbations: as for :func:`capture_nnx`, from :func:`output_perturbations_linen`.

  Returns:
    ``(output, layer_inputs)`` (``(output, layer_inputs, updated_collections)`` if
    ``mutable``), ``layer_inputs`` a :class:`CapturedInputs` mirroring ``variables['params']``.
  """
  outputs = None if output_perturbations is None else captured_lib.Outputs(output_perturbations)
  return _capture_linen(module, variables, args, kwargs, rng, max_rows, mutable, outputs)


def _capture_linen(module, variables, args, kwargs, rng, max_rows, mutable, outputs):
  captured_lib.check_max_rows(max_rows)
  axes, unconditioned = {}, {}
  with nn.intercept_methods(_linen_interceptor(max_rows, captured_lib.Counter(rng), axes, unconditioned,
                                               _param_ndims(variables), outputs=outputs)):
    out, state = module.apply(variables, *args, mutable=[LINEN_COLLECTION, *mutable],
                              **(kwargs if rng is None else _with_dropout(kwargs, jax.random.fold_in(rng, 1))))
  state = dict(state)
  captured = state.pop(LINEN_COLLECTION, {})
  captured = CapturedInputs(jax.tree.map(captured_lib.merge, dict(captured), is_leaf=lambda v: isinstance(v, tuple)),
                            axes, unconditioned)
  if mutable:
    return out, captured, state
  return out, captured


def output_perturbations_linen(module: nn.Module, variables, *args, **kwargs) -> CapturedInputs:
  """:func:`output_perturbations_nnx` for a Linen model (``module.apply(variables, *args, **kwargs)``);
  pass them to :func:`capture_linen`."""
  outputs = captured_lib.Outputs()
  jax.eval_shape(lambda v: _capture_linen(module, v, args, kwargs, None, None, (), outputs)[0], variables)
  return outputs.zeros()


def input_axes_linen(module: nn.Module, variables, *args, **kwargs) -> dict[str, Layout]:
  """``{param path: Layout}`` of every captured layer of a Linen model (see :func:`input_axes_nnx`), traced
  once (no compute) on ``args``: pass it as ``input_axes=`` to fix every plan at ``init``. The kernels whose
  layers read the same rows (an attention's query, key and value) are marked as :func:`input_axes_nnx` marks
  them given inputs."""
  record, plain, reads = {}, {}, captured_lib.Reads()

  def run(variables, *a):
    with nn.intercept_methods(_linen_interceptor(None, captured_lib.Counter(None), record, plain,
                                                 _param_ndims(variables), sow=False, reads=reads)):
      return module.apply(variables, *a, mutable=True, **_with_dropout(kwargs, jax.random.PRNGKey(0)))

  jax.eval_shape(run, variables, *args)
  return reads.marked({**record, **{path: Plain(why) for path, why in plain.items()}})


def apply_gradients(state, *, grads, layer_inputs, **kwargs):
  """``flax.training.train_state.TrainState.apply_gradients`` that forwards ``layer_inputs`` to ``tx.update``.

  ``TrainState.apply_gradients(grads=...)`` calls ``tx.update(grads, opt_state, params)``
  and has no way to pass extra arguments; use this instead::

    (loss, layer_inputs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = scsgd_jax.apply_gradients(state, grads=grads, layer_inputs=layer_inputs)

  Args:
    state: a ``TrainState`` (or any struct with ``step``, ``params``, ``tx``,
      ``opt_state`` and ``replace``) whose ``tx`` contains the conditioning.
    grads: gradients with the structure of ``state.params``.
    layer_inputs: from :func:`capture_linen` (or :func:`capture_nnx`).
    **kwargs: further fields to replace, as ``TrainState.apply_gradients`` allows.

  Returns:
    The new state, ``step`` incremented.
  """
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params, layer_inputs=layer_inputs)
  return state.replace(
      step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state, **kwargs)
