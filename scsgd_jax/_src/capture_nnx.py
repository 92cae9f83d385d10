"""Capturing an NNX model's conditioned-layer inputs in the forward pass that computes the loss.

The layers' ``__call__`` are intercepted for the duration of one call (the model needs no change) and
each sows its :class:`~scsgd_jax._src.layers.LayerSpec` rows into a :class:`LayerInput` variable.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import jax
from flax import nnx

from scsgd_jax._src import captured as captured_lib
from scsgd_jax._src import defaults
from scsgd_jax._src.captured import CapturedInputs
from scsgd_jax._src.layers import NNX_LAYERS
from scsgd_jax._src.layers import layer_spec
from scsgd_jax._src.layout import Layout
from scsgd_jax._src.layout import Plain

__all__ = ["LayerInput", "capture_nnx", "input_axes_nnx", "output_perturbations_nnx"]



class LayerInput(nnx.Intermediate):
  """NNX variable type of the captured input rows (a subtype of ``nnx.Intermediate``)."""


_PATH_ATTR = "_scsgd_jax_path"  # set on each module for one call: its path, inside nnx.scan/vmap too

def _layer_path(layer, default: str) -> str:
  return getattr(layer, _PATH_ATTR, None) or default


def _read(cap: captured_lib.Capture, layer, name: str, inputs, einsum_str, full) -> Optional[tuple]:
  """Sows what ``layer``'s kernel needs from ``inputs`` (``name``: its path, ``full``: the model's own copy of the
  layer, whose parameter says its stack axes): ``(param path, spec, layout)``, or ``None`` for a layer the
  conditioning cannot read (planned plain, said)."""
  try:
    spec = layer_spec(layer, name, einsum_str if isinstance(layer, nnx.Einsum) else None)
    rows = spec.rows(jax.lax.stop_gradient(inputs), cap.max_rows, cap.counter.key())
  except NotImplementedError as e:
    cap.plain(captured_lib.param_path(name, "kernel"), str(e))
    return None
  path = captured_lib.param_path(name, spec.param)
  layout = cap.layouts[path] = captured_lib.layout(spec, layer, getattr(getattr(full, spec.param, None), "ndim", None))
  if cap.reads is not None:
    cap.reads(path, spec, inputs)
  layer.sow(LayerInput, spec.param, rows)
  return path, spec, layout


def _layer_stand_in(orig, cap: captured_lib.Capture, nodes: dict):
  """``orig`` (a layer's ``__call__``) that first reads the layer's input for ``cap``; every argument forwarded."""

  @functools.wraps(orig)
  def call(self, *args, **kwargs):
    inputs, equation = captured_lib.layer_input(args, kwargs)
    path = _layer_path(self, type(self).__name__)
    name = path if path in nodes else ""  # a layer outside the model's graph: the model itself
    read = _read(cap, self, name, inputs, equation, nodes.get(path))
    y = orig(self, *args, **kwargs)
    if read is None or cap.outputs is None:
      return y
    if cap.recurrent:
      cap.outputs.unconditioned[read[0]] = captured_lib.RECURRENT_OUTPUT
      return y
    return cap.outputs(*read[:2], y, read[2])

  return call


def _rnn_stand_in(orig, cap: captured_lib.Capture):
  """``nnx.RNN.__call__`` whose scan also carries the sown rows out, one set per time step (stacked along the scan,
  folded into the kernel's rows by the capture); every argument forwarded."""

  @functools.wraps(orig)
  def call(self, *args, **kwargs):
    saved = self.state_axes
    object.__setattr__(self, "state_axes", nnx.StateAxes({LayerInput: 0, **saved}))
    cap.recurrent += 1
    try:
      return orig(self, *args, **kwargs)
    finally:
      cap.recurrent -= 1
      object.__setattr__(self, "state_axes", saved)

  return call


def _tied_stand_in(orig, cap: captured_lib.Capture, nodes: dict):
  """``nnx.Embed.attend`` that notes the table as tied (plain updates, said); every argument forwarded."""

  @functools.wraps(orig)
  def attend(self, *args, **kwargs):
    path = _layer_path(self, "")
    cap.unconditioned[captured_lib.param_path(path if path in nodes else "", "embedding")] = captured_lib.TIED
    return orig(self, *args, **kwargs)

  return attend


def stand_ins(cap: captured_lib.Capture, nodes: dict) -> dict:
  """``{(class, method name): stand-in}``: every method the NNX capture stands in for, from the originals of now."""
  out = {(cls, "__call__"): _layer_stand_in(cls.__call__, cap, nodes) for cls in NNX_LAYERS}
  out[nnx.RNN, "__call__"] = _rnn_stand_in(nnx.RNN.__call__, cap)
  out[nnx.Embed, "attend"] = _tied_stand_in(nnx.Embed.attend, cap, nodes)
  return out


@contextlib.contextmanager
def _patched_nnx(model, cap: captured_lib.Capture):
  # a layer inside nnx.scan/nnx.vmap runs as a copy holding one slice of each parameter: it finds its path in
  # an attribute (kept by the transforms' graph copy), and its stack axes from its original's full parameter
  nodes = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
  cap.sow = lambda module, param, rows: module.sow(LayerInput, param, rows)
  cap.path_of = lambda module: (lambda p: p if p in nodes else "")(_layer_path(module, ""))
  try:
    for node_name, node in nodes.items():
      object.__setattr__(node, _PATH_ATTR, node_name)
    with captured_lib.patched(stand_ins(cap, nodes)), cap.active():
      yield
  finally:
    for node in nodes.values():
      if _PATH_ATTR in vars(node):
        object.__delattr__(node, _PATH_ATTR)


def _run(model, cap: captured_lib.Capture, args, kwargs):
  """``(output, sown rows)`` of ``model(*args, **kwargs)`` under ``cap``; a layer that runs inside a transform that
  drops what it sows (a user's ``nnx.scan`` carrying the module) is refused, naming the fix."""
  try:
    with _patched_nnx(model, cap):
      return nnx.capture(lambda m, *a, **k: m(*a, **k), LayerInput)(model, *args, **kwargs)
  except TypeError as e:
    if "__captures__" not in str(e):
      raise
    raise ValueError(
        "a conditioned layer runs inside an nnx.scan (or another transform) that carries the module's state, so "
        "what the capture sows there cannot leave it. Scan the captured rows out along the loop: pass "
        "nnx.StateAxes({nnx.Intermediate: 0, ...: nnx.Carry}) (or your state axes with nnx.Intermediate: 0 "
        "first) as the module's in_axes; nnx.RNN and nnx.Bidirectional need nothing. Or exclude the kernels "
        f"with kernel_filter. ({str(e).splitlines()[0]})") from None


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
  cap = captured_lib.Capture(captured_lib.NNX_HELPER, rng, max_rows, outputs)
  out, captured = _run(model, cap, args, kwargs)
  return out, cap.captured(nnx.to_pure_dict(captured))


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
  as ``scsgd(..., Conditioning(input_axes=input_axes_nnx(model)))`` to fix every plan at ``init``, so that the state never
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
  graphdef, state = nnx.split(model)

  cap = captured_lib.Capture(captured_lib.NNX_HELPER, reads=captured_lib.Reads())
  jax.eval_shape(lambda state: _run(nnx.merge(graphdef, state), cap, args, kwargs)[0], state)
  return cap.reads.marked({**layouts, **cap.layouts, **{path: Plain(why) for path, why in cap.unconditioned.items()}})
