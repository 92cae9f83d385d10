"""Capturing a Linen model's conditioned-layer inputs in the forward pass that computes the loss
(``nn.intercept_methods`` and ``Module.sow``; the model needs no change), and the ``TrainState`` helper."""

from __future__ import annotations

from typing import Optional

import jax
import optax
from flax import linen as nn
from flax.linen.recurrent import DenseParams

from scsgd_jax._src import captured as captured_lib
from scsgd_jax._src import defaults
from scsgd_jax._src.captured import CapturedInputs
from scsgd_jax._src.layers import LINEN_LAYERS
from scsgd_jax._src.layers import layer_spec
from scsgd_jax._src.layout import Layout
from scsgd_jax._src.layout import Plain

__all__ = ["apply_gradients", "capture_linen", "input_axes_linen", "output_perturbations_linen"]

LINEN_COLLECTION = "layer_inputs"


# why a layer inside a lifted transform that does not pass the captured collection through is left plain
LIFTED = ("it runs inside a Linen lifted transform (nn.scan, nn.vmap, ...) that does not pass the collection "
          f"'{LINEN_COLLECTION}' through: list it next to 'params', nn.scan(..., variable_axes={{'params': 0, "
          f"'{LINEN_COLLECTION}': 0}}) (the rows are then stacked like the kernels), as Flax asks for any collection "
          "sown inside a scan")


def _read(cap: captured_lib.Capture, mod, x, einsum_str, full_ndim) -> Optional[tuple]:
  """Sows what layer ``mod``'s kernel needs from its input ``x``: ``(param path, spec, layout)``, or ``None`` for a
  layer the conditioning cannot read, or whose rows cannot leave the transform it runs in (planned plain, said)."""
  name = "/".join(map(str, mod.path)) or type(mod).__name__
  if x is None:
    cap.plain(captured_lib.param_path("/".join(map(str, mod.path)), "kernel"), f"layer '{name}': {captured_lib.NO_INPUT}")
    return None
  try:
    spec = layer_spec(mod, name, einsum_str)
    rows = spec.rows(jax.lax.stop_gradient(x), cap.max_rows, cap.counter.key())
  except NotImplementedError as e:  # a layer kind the conditioning cannot read: plain updates, said
    cap.plain(captured_lib.param_path("/".join(map(str, mod.path)), "kernel"), str(e))
    return None
  path = "/".join((*map(str, mod.path), spec.param))
  if not mod.sow(LINEN_COLLECTION, spec.param, rows):
    cap.plain(path, f"layer '{name}': {LIFTED}")
    return None
  layout = cap.layouts[path] = captured_lib.layout(spec, mod, full_ndim.get(path))
  if cap.reads is not None:
    cap.reads(path, spec, x)
  return path, spec, layout


def _linen_interceptor(cap: captured_lib.Capture, full_ndim):
  def interceptor(next_fun, a, k, context):
    mod, method = context.module, context.method_name
    if method == "attend" and isinstance(mod, nn.Embed):  # a tied table: plain updates, said
      cap.unconditioned[captured_lib.param_path("/".join(map(str, mod.path)), "embedding")] = captured_lib.TIED
    elif method == "__call__" and isinstance(mod, nn.RNN):
      return _recurrent(cap, mod, next_fun, a, k)
    elif method == "__call__" and isinstance(mod, LINEN_LAYERS):
      x, equation = captured_lib.layer_input(a, k)
      read = _read(cap, mod, x, equation, full_ndim)
      if read is not None and cap.outputs is not None:
        y = next_fun(*a, **k)
        if cap.recurrent or isinstance(mod, DenseParams):  # a recurrent cell's kernel
          cap.outputs.unconditioned[read[0]] = captured_lib.RECURRENT_OUTPUT
          return y
        return cap.outputs(read[0], read[1], y, read[2])
    return next_fun(*a, **k)

  return interceptor


def _recurrent(cap: captured_lib.Capture, mod, next_fun, a, k):
  """``nn.RNN``'s call with its scan also passing the captured collection out, one set of rows per time step
  (stacked along the scan, folded into the kernel's rows by the capture)."""
  saved = mod.variable_axes
  object.__setattr__(mod, "variable_axes", {**saved, LINEN_COLLECTION: 0})
  cap.recurrent += 1
  try:
    return next_fun(*a, **k)
  finally:
    cap.recurrent -= 1
    object.__setattr__(mod, "variable_axes", saved)


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


def _apply(module, variables, args, kwargs, cap: captured_lib.Capture, mutable, dropout_key):
  """``module.apply`` under ``cap``: ``(output, state)``, the state holding the captured collection."""
  cap.sow = lambda mod, param, rows: mod.sow(LINEN_COLLECTION, param, rows)
  cap.path_of = lambda mod: "/".join(map(str, mod.path))
  kwargs = kwargs if dropout_key is None else _with_dropout(kwargs, dropout_key)
  with nn.intercept_methods(_linen_interceptor(cap, _param_ndims(variables))), cap.active():
    return module.apply(variables, *args, mutable=mutable, **kwargs)


def _capture_linen(module, variables, args, kwargs, rng, max_rows, mutable, outputs):
  cap = captured_lib.Capture(captured_lib.LINEN_HELPER, rng, max_rows, outputs)
  out, state = _apply(module, variables, args, kwargs, cap, [LINEN_COLLECTION, *mutable],
                      None if rng is None else jax.random.fold_in(rng, 1))
  state = dict(state)
  captured = cap.captured(dict(state.pop(LINEN_COLLECTION, {})))
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
  cap = captured_lib.Capture(captured_lib.LINEN_HELPER, reads=captured_lib.Reads())
  jax.eval_shape(lambda v, *a: _apply(module, v, a, kwargs, cap, True, jax.random.PRNGKey(0))[0], variables, *args)
  return cap.reads.marked({**cap.layouts, **{path: Plain(why) for path, why in cap.unconditioned.items()}})


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
