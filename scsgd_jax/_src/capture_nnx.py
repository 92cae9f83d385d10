"""Capturing an NNX model's conditioned-layer inputs in the forward pass that computes the loss.

The layers' ``__call__`` are intercepted for the duration of one call (the model needs no change) and
each sows its :class:`~scsgd_jax._src.layers.LayerSpec` rows into a :class:`LayerInput` variable.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import jax
from flax import nnx

from scsgd_jax._src import captured as captured_lib
from scsgd_jax._src import defaults
from scsgd_jax._src.captured import CapturedInputs
from scsgd_jax._src.layers import NNX_LAYERS
from scsgd_jax._src.layers import einsum_arg
from scsgd_jax._src.layers import layer_spec
from scsgd_jax._src.layout import Layout
from scsgd_jax._src.layout import Plain

__all__ = ["LayerInput", "capture_nnx", "input_axes_nnx", "output_perturbations_nnx"]



class LayerInput(nnx.Intermediate):
  """NNX variable type of the captured input rows (a subtype of ``nnx.Intermediate``)."""


_PATH_ATTR = "_scsgd_jax_path"  # set on each captured layer for one call: its path, inside nnx.scan/vmap too


def _layer_path(layer, default: str) -> str:
  return getattr(layer, _PATH_ATTR, None) or default


@contextlib.contextmanager
def _patched_nnx(model, max_rows, counter, layouts, unconditioned, outputs=None, reads=None):
  originals = {cls: cls.__call__ for cls in NNX_LAYERS}
  # a layer inside nnx.scan/nnx.vmap runs as a copy holding one slice of each parameter: it finds its path in
  # an attribute (kept by the transforms' graph copy), and its stack axes from its original's full parameter
  layers = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, NNX_LAYERS)}

  def make(orig):
    def call(self, inputs, *args, **kwargs):
      path = _layer_path(self, type(self).__name__)
      name = path if path in layers else ""  # a layer outside the model's graph: the model itself
      try:
        spec = layer_spec(self, path, einsum_arg(self, args, kwargs))
        rows = spec.rows(jax.lax.stop_gradient(inputs), max_rows, counter.key())
      except NotImplementedError as e:  # a layer kind the conditioning cannot read: plain updates, said
        for where in (unconditioned, outputs.unconditioned if outputs is not None else {}):
          where[captured_lib.param_path(name, "kernel")] = str(e)
        return orig(self, inputs, *args, **kwargs)
      param_path = captured_lib.param_path(name, spec.param)
      layout = captured_lib.layout(spec, self, getattr(getattr(layers.get(path), spec.param, None), "ndim", None))
      layouts[param_path] = layout
      if reads is not None:
        reads(param_path, spec, inputs)
      self.sow(LayerInput, spec.param, rows)
      y = orig(self, inputs, *args, **kwargs)
      return y if outputs is None else outputs(param_path, spec, y, layout)

    return call

  attend = nnx.Embed.attend

  def tied(self, query):  # the table is also the output projection: plain updates, said
    path = _layer_path(self, "")
    unconditioned[captured_lib.param_path(path if path in layers else "", "embedding")] = captured_lib.TIED
    return attend(self, query)

  try:
    for node_name, node in layers.items():
      object.__setattr__(node, _PATH_ATTR, node_name)
    for cls, orig in originals.items():
      cls.__call__ = make(orig)
    nnx.Embed.attend = tied
    yield
  finally:
    nnx.Embed.attend = attend
    for cls, orig in originals.items():
      cls.__call__ = orig
    for node in layers.values():
      if _PATH_ATTR in vars(node):
        object.__delattr__(node, _PATH_ATTR)


def capture_nnx(
    model: nnx.Module,
    *args,
    rng: Optional[jax.Array] = None,
    max_rows: Optional[int] = defaults.MAX_ROWS,
    output_perturbations=None,
    **kwargs,
) -> tuple[Any, dict]:
  """Calls ``model(*args, **kwargs)`` and captures the inputs of its conditioned layers.

  Layers captured: ``nnx.Linear``, ``nnx.Conv``, ``nnx.LinearGeneral`` (so every
  projection of ``nnx.MultiHeadAttention``), ``nnx.Einsum`` and ``nnx.Embed``.
  Uses ``Module.sow`` of a :class:`LayerInput` variable inside
  ``nnx.capture(model, LayerInput)``, with the layers' ``__call__`` intercepted for
  this call only, so the model's code needs no change. Call it inside the loss
  function, so the same forward pass gives the loss and the statistics::

    def loss_fn(model):
      logits, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key)
      return loss(logits, y), layer_inputs
    (loss, layer_inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, layer_inputs=layer_inputs)

  Args:
    model: an NNX module.
    *args, **kwargs: the call's arguments.
    rng: key for sampling rows; needed when a layer has more than ``max_rows`` rows.
    max_rows: rows kept per layer call, a positive int (``None``: all). Conv rows
      are sampled output positions, gathered without materialising all patches.
      An embedding always keeps all its ids.
    output_perturbations: for output-side conditioning (:func:`scale_by_output_conditioning`), the zeros of
      :func:`output_perturbations_nnx`, added to the conditioned layers' outputs; pass them as an argument
      of the loss function and differentiate it with respect to them too: that gradient is each layer's
      back-propagated output rows, the transformation's ``output_grads=``.

  Returns:
    ``(output, layer_inputs)``, ``layer_inputs`` a :class:`CapturedInputs`: a nested dict mirroring the
    model's ``nnx.Param`` state, ``{..., 'layer': {'kernel': rows}}``, that also holds each kernel's
    input axes as read from its layer. A layer called several times gets its rows concatenated.
  """
  outputs = None if output_perturbations is None else captured_lib.Outputs(output_perturbations)
  return _capture_nnx(model, args, kwargs, rng, max_rows, outputs)


def _capture_nnx(model, args, kwargs, rng, max_rows, outputs):
  captured_lib.check_max_rows(max_rows)
  counter, axes, unconditioned = captured_lib.Counter(rng), {}, {}
  with _patched_nnx(model, max_rows, counter, axes, unconditioned, outputs):
    out, captured = nnx.capture(lambda m, *a, **k: m(*a, **k), LayerInput)(model, *args, **kwargs)
  pure = nnx.to_pure_dict(captured)
  return out, CapturedInputs(jax.tree.map(captured_lib.merge, pure, is_leaf=lambda v: isinstance(v, tuple)), axes,
                             unconditioned)


def output_perturbations_nnx(model: nnx.Module, *args, **kwargs) -> CapturedInputs:
  """Zeros to add to the outputs of an NNX model's conditioned layers, for output-side conditioning.

  One ``(rows, p)`` array per conditioned kernel but embeddings, ``p`` the product of the kernel's output
  axes (in the kernel's order) and ``rows`` all the other output positions of ``model(*args, **kwargs)``
  (traced once, no compute; their shapes follow the batch's). Pass them to :func:`capture_nnx` inside the
  loss and take the loss's gradient with respect to them: it is a :class:`CapturedInputs` of each layer's
  back-propagated rows ``delta`` (which also says the kernel's output axes), the ``output_grads=`` of
  :func:`scale_by_output_conditioning`::

    perturbations = scsgd_jax.contrib.output_perturbations_nnx(model, x)
    def loss_fn(model, perturbations):
      logits, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key, output_perturbations=perturbations)
      return loss(logits, y), layer_inputs
    (loss, layer_inputs), (grads, output_grads) = nnx.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(model, perturbations)
    optimizer.update(model, grads, layer_inputs=layer_inputs, output_grads=output_grads)
  """
  graphdef, state = nnx.split(model)
  outputs = captured_lib.Outputs()
  jax.eval_shape(lambda s: _capture_nnx(nnx.merge(graphdef, s), args, kwargs, None, None, outputs)[0], state)
  return outputs.zeros()


def input_axes_nnx(model: nnx.Module, *args, **kwargs) -> dict[str, Layout]:
  """``{param path: Layout}`` of every captured layer of an NNX model, read from the layers themselves: the
  kernel's input axes, its stack axes (a layer inside ``nnx.scan``/``nnx.vmap``) and feature groups; a layer
  the conditioning cannot read (a transposed conv, ...) maps to ``Plain(why)``, planned plain at ``init``.

  The captured :class:`CapturedInputs` already carry these layouts (the transformation reads them); pass this
  as ``scsgd(..., input_axes=input_axes_nnx(model))`` to fix every plan at ``init``, so that the state never
  changes shape (see :func:`~scsgd_jax.scale_by_sketched_conditioning`), or for rows captured by other means.

  Given the model's inputs (``*args, **kwargs``, as a call of the model takes them; traced once, no compute), it
  also finds the kernels whose layers read the same rows (an attention's query, key and value; a gated MLP's
  gate and up: Linear and LinearGeneral layers called on one array over the same axes) and marks each after the
  first ``Layout(reads=<the first>)``: one statistic and factor serves them all, folded and refreshed once.
  """
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, NNX_LAYERS):
      name = "/".join(map(str, path))
      try:
        spec = layer_spec(node, name)
      except NotImplementedError as e:  # a layer kind left unconditioned: init plans it plain, saying why
        out[captured_lib.param_path(name, "kernel")] = Plain(str(e))
        continue
      if spec.input_axes is None:
        raise ValueError(
            f"layer '{name}' is an Einsum whose equation is given only at call time; name its kernel's "
            f"input axes yourself, e.g. input_axes={{'{name}/kernel': (0,)}}.")
      full = getattr(getattr(node, spec.param), "ndim", None)
      out[captured_lib.param_path(name, spec.param)] = captured_lib.layout(spec, node, full)
  return _marked_reads(model, out, args, kwargs) if args or kwargs else out


def _marked_reads(model: nnx.Module, layouts: dict, args, kwargs) -> dict:
  """``layouts`` with the kernels that read another's rows in a call of ``model`` marked (:class:`Reads`)."""
  reads, plain, (graphdef, state) = captured_lib.Reads(), {}, nnx.split(model)

  def run(state):
    copy = nnx.merge(graphdef, state)
    with _patched_nnx(copy, None, captured_lib.Counter(None), {}, plain, reads=reads):
      return nnx.capture(lambda m, *a, **k: m(*a, **k), LayerInput)(copy, *args, **kwargs)[0]

  jax.eval_shape(run, state)
  return reads.marked({**layouts, **{path: Plain(why) for path, why in plain.items()}})
