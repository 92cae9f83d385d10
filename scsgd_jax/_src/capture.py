"""Capturing each conditioned layer's inputs in the forward pass that computes the loss.

Neither helper needs a change to the model: the layers' ``__call__`` are
intercepted for the duration of one call, and what each layer sows is what its
kernel's statistics need, stored under the layer's path with the parameter's
name (``kernel``, or ``embedding``) so that the result mirrors the parameter tree:

- Dense/Linear ``(n, p)``: input rows ``(m, n)``.
- Conv ``(*window, cin, cout)``: im2col rows of sampled output positions, ``(m, prod(window) * cin)``.
- DenseGeneral/LinearGeneral (and so every attention projection): the contracted
  input axes moved last and flattened, in the kernel's input-axis order.
- Einsum: the input's contracted labels, in the order the kernel holds them.
- Embed: the integer ids (its input is one-hot, so the statistic is their histogram).

:func:`layer_spec` is the one place that knows each layer type.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

from scsgd_jax._src import defaults
from scsgd_jax._src import patches
from scsgd_jax._src import plan as plan_lib

__all__ = [
    "LayerInput",
    "CapturedInputs",
    "apply_gradients",
    "LayerSpec",
    "capture_linen",
    "capture_nnx",
    "input_axes_linen",
    "input_axes_nnx",
    "layer_rows",
    "layer_spec",
    "output_perturbations_linen",
    "output_perturbations_nnx",
]

DEFAULT_MAX_ROWS = defaults.MAX_ROWS
LINEN_COLLECTION = "layer_inputs"
NNX_LAYERS = (nnx.Linear, nnx.Conv, nnx.LinearGeneral, nnx.Einsum, nnx.Embed)
LINEN_LAYERS = (nn.Dense, nn.Conv, nn.DenseGeneral, nn.Einsum, nn.Embed)


class LayerInput(nnx.Intermediate):
  """NNX variable type of the captured input rows (a subtype of ``nnx.Intermediate``)."""


@jax.tree_util.register_pytree_with_keys_class
class CapturedInputs(dict):
  """What :func:`capture_nnx` and :func:`capture_linen` return: a ``dict`` of the captured rows (mirroring the
  parameter tree) that also says how each kernel is read.

  ``input_axes`` (``{param path: input axes}``, e.g. ``{'attn/q_einsum/kernel': (1,)}``) is read from the
  layers themselves at capture, Einsum equations included; it is static pytree metadata (no leaves), so it
  travels through ``jit``, ``pmap``, ``shard_map`` and ``jax.tree.map`` unchanged and costs nothing. The
  transformation reads it, so a DenseGeneral/Einsum model of any layout needs no ``input_axes=`` argument.
  Converted to a plain ``dict``, the rows stay valid and the kernels fall back to the name-based default axes.
  """

  def __init__(self, rows=(), input_axes=None):
    super().__init__(rows)
    self.input_axes = dict(input_axes or {})

  def tree_flatten_with_keys(self):
    keys = tuple(sorted(self))
    return ([(jax.tree_util.DictKey(k), self[k]) for k in keys],
            (keys, tuple(sorted(self.input_axes.items()))))

  def tree_flatten(self):
    children, aux = self.tree_flatten_with_keys()
    return [c for _, c in children], aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    keys, axes = aux
    return cls(zip(keys, children), dict(axes))

  def __repr__(self):
    return f"CapturedInputs({dict.__repr__(self)}, input_axes={self.input_axes})"


class LayerSpec(NamedTuple):
  """What one layer's kernel needs from its input.

  Attributes:
    param: the parameter's name (``'kernel'`` or ``'embedding'``).
    input_axes: the kernel axes contracted with the input (``None`` when the
      equation is only known at call time).
    rows: ``rows(x, max_rows, key) -> (m, n)`` rows (or the ids of an embedding).
  """

  param: str
  input_axes: Optional[tuple[int, ...]]
  rows: Callable[[jax.Array, Optional[int], Optional[jax.Array]], jax.Array]
  output_axes: Optional[Callable[[int], tuple[int, ...]]] = None
  """``output_axes(y.ndim)``: the axes of the layer's output ``y`` that the kernel's output axes make, in the
  kernel's order (``None``: no output side, e.g. an embedding)."""


def _to_tuple(v, d):
  if v is None:
    return (1,) * d
  return (v,) * d if isinstance(v, int) else tuple(v)


def _as_tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _conv_spec(layer, name) -> LayerSpec:
  window = tuple(layer.kernel_size) if not isinstance(layer.kernel_size, int) else (layer.kernel_size,)
  d = len(window)
  groups = getattr(layer, "feature_group_count", 1)
  if groups != 1:
    raise NotImplementedError(
        f"layer '{name}' is a grouped convolution (feature_group_count={groups}); its kernel is not "
        "one (n, cout) matrix over all inputs. Exclude it with kernel_filter or optax.masked.")
  if any(v != 1 for v in _to_tuple(getattr(layer, "input_dilation", 1), d)):
    raise NotImplementedError(f"layer '{name}': input_dilation is not supported by the conv statistics.")

  def rows(x, max_rows, key):
    try:
      return patches.conv_patch_rows(
          x, window, strides=_to_tuple(layer.strides, d), padding=layer.padding,
          dilation=_to_tuple(layer.kernel_dilation, d), max_rows=max_rows, key=key)
    except (ValueError, NotImplementedError) as e:
      raise type(e)(f"layer '{name}': {e}") from None

  return LayerSpec("kernel", tuple(range(d + 1)), rows, _last_axes(1))


def _last_axes(count: int) -> Callable[[int], tuple[int, ...]]:
  return lambda ndim: tuple(range(ndim - count, ndim))


def _contracted_rows(x, axes, max_rows, key):
  """``x`` with ``axes`` (in this order) moved last and flattened into rows."""
  axes = tuple(a % x.ndim for a in axes)
  rest = tuple(a for a in range(x.ndim) if a not in axes)
  moved = jnp.transpose(x, rest + axes)
  return patches.sample_rows(moved.reshape(-1, math.prod(x.shape[a] for a in axes)), max_rows, key)


def _general_spec(layer, name, batch) -> LayerSpec:
  if batch:
    raise NotImplementedError(
        f"layer '{name}' has batch axes {tuple(batch)}: its kernel is one matrix per batch index, not "
        "one (n, p) matrix. Exclude it with kernel_filter or optax.masked.")
  axis = _as_tuple(layer.axis)
  features = _as_tuple(layer.out_features if isinstance(layer, nnx.LinearGeneral) else layer.features)
  return LayerSpec("kernel", tuple(range(len(axis))), lambda x, m, k: _contracted_rows(x, axis, m, k),
                   _last_axes(len(features)))


def _expand_ellipsis(labels: str, ndim: int) -> str:
  if "..." not in labels:
    return labels
  pre, post = labels.split("...")
  return pre + "#" * (ndim - len(pre) - len(post)) + post


def _parse_einsum(equation: str, name: str) -> tuple[tuple[int, ...], Callable, Callable]:
  """Kernel input axes, the input's rows and the output's kernel-output axes of ``'lhs,rhs->out'`` (rhs the
  kernel)."""
  eq = equation.replace(" ", "")
  try:
    ins, out = eq.split("->")
    lhs, rhs = ins.split(",")
  except ValueError:
    raise ValueError(f"layer '{name}': einsum equation {equation!r} is not of the form 'lhs,rhs->out'.") from None
  if "." in rhs:
    raise NotImplementedError(f"layer '{name}': an ellipsis in the kernel's subscripts ({equation!r}) is not supported.")
  shared = [c for c in rhs if c in lhs and c in out]
  if shared:
    raise NotImplementedError(
        f"layer '{name}': einsum {equation!r} shares labels {shared} between input, kernel and output, so "
        "its kernel is one matrix per such index. Exclude it with kernel_filter or optax.masked.")
  contracted = [c for c in rhs if c in lhs]
  if not contracted:
    raise ValueError(f"layer '{name}': einsum {equation!r} contracts no input axis with the kernel.")
  kernel_axes = tuple(rhs.index(c) for c in contracted)

  def rows(x, max_rows, key):
    labels = _expand_ellipsis(lhs, x.ndim)
    return _contracted_rows(x, tuple(labels.index(c) for c in contracted), max_rows, key)

  def output_axes(ndim):
    labels = _expand_ellipsis(out, ndim)
    return tuple(labels.index(c) for c in rhs if c not in contracted)

  return kernel_axes, rows, output_axes


def _einsum_spec(layer, name, equation) -> LayerSpec:
  if equation is None:
    return LayerSpec("kernel", None, None)
  return LayerSpec("kernel", *_parse_einsum(equation, name))


def _embed_rows(x, max_rows, key):
  del max_rows, key  # the histogram of all ids is O(m + vocab): no sampling needed
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"an Embed layer's input must be integer ids, got dtype {x.dtype}.")
  return x.reshape(-1)


def layer_spec(layer: Any, name: str, einsum_str: Optional[str] = None) -> LayerSpec:
  """The :class:`LayerSpec` of an NNX or Linen layer (``einsum_str``: the equation of this Einsum call, if given)."""
  if isinstance(layer, (nnx.Conv, nn.Conv)):
    return _conv_spec(layer, name)
  if isinstance(layer, (nnx.Linear, nn.Dense)):
    return LayerSpec("kernel", (0,), lambda x, m, k: patches.dense_rows(x, m, k), _last_axes(1))
  if isinstance(layer, nnx.LinearGeneral):
    return _general_spec(layer, name, dict(layer.batch_axis))
  if isinstance(layer, nn.DenseGeneral):
    return _general_spec(layer, name, _as_tuple(layer.batch_dims))
  if isinstance(layer, (nnx.Einsum, nn.Einsum)):
    return _einsum_spec(layer, name, einsum_str or layer.einsum_str)
  if isinstance(layer, (nnx.Embed, nn.Embed)):
    return LayerSpec("embedding", (0,), _embed_rows)
  raise TypeError(f"layer '{name}' of type {type(layer).__name__} is not one the capture knows.")


def layer_rows(
    layer: Any,
    x: jax.Array,
    *,
    name: str,
    max_rows: Optional[int],
    key: Optional[jax.Array],
    einsum_str: Optional[str] = None,
) -> jax.Array:
  """What ``layer``'s kernel statistics need from the layer input ``x``: rows ``(m, n)``, or an embedding's ids.

  ``layer`` is any of ``nnx.Linear``, ``nnx.Conv``, ``nnx.LinearGeneral``,
  ``nnx.Einsum``, ``nnx.Embed`` or their Linen twins; ``name`` names it in errors.
  """
  spec = layer_spec(layer, name, einsum_str)
  return spec.rows(jax.lax.stop_gradient(x), max_rows, key)


def _check_max_rows(max_rows) -> None:
  if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
    raise ValueError(
        f"max_rows must be a positive int (rows kept per layer call) or None (all rows), got {max_rows!r}; "
        "with no rows the statistics never change and training is plain SGD.")


class _Counter:
  def __init__(self, rng):
    self.rng = rng
    self.i = itertools.count()

  def key(self):
    return None if self.rng is None else jax.random.fold_in(self.rng, next(self.i))


def _merge(rows_tuple):
  rows = tuple(rows_tuple)
  return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


def _einsum_arg(layer, args, kwargs) -> Optional[str]:
  if isinstance(layer, (nnx.Einsum, nn.Einsum)):
    return kwargs.get("einsum_str") or (args[0] if args and isinstance(args[0], str) else None)
  return None


def _param_path(name: str, spec: LayerSpec) -> str:
  return f"{name}/{spec.param}" if name else spec.param


class _Outputs:
  """What a capture does to each conditioned layer's output ``y``: with ``perturbations`` (``{kernel path:
  (rows, p)}``), adds them, the kernel's output axes of ``y`` moved last and flattened in the kernel's order
  (so their gradient is the rows of the back-propagated ``delta``); without, records their shapes and the
  kernel's output axes (:func:`output_perturbations_nnx`)."""

  def __init__(self, perturbations=None):
    self.perturbations = None if perturbations is None else _flat(perturbations)
    self.shapes, self.axes = {}, {}

  def __call__(self, path: str, spec: LayerSpec, y):
    if spec.output_axes is None or spec.input_axes is None:
      return y
    out_axes = spec.output_axes(y.ndim)
    rest = tuple(a for a in range(y.ndim) if a not in out_axes)
    perm = rest + out_axes
    moved_shape = tuple(y.shape[a] for a in perm)
    p = math.prod(y.shape[a] for a in out_axes)
    shape = (math.prod(moved_shape) // max(p, 1), p)
    if self.perturbations is None:
      if path in self.shapes:
        raise NotImplementedError(
            f"layer of kernel '{path}' is called more than once in one forward pass; output-side conditioning "
            "needs one call per layer. Exclude the kernel with kernel_filter or optax.masked.")
      self.shapes[path] = jax.ShapeDtypeStruct(shape, y.dtype)
      ndim = len(spec.input_axes) + len(out_axes)
      self.axes[path] = tuple(a for a in range(ndim) if a not in spec.input_axes)
      return y
    if path not in self.perturbations:
      return y
    delta = self.perturbations[path]
    if tuple(delta.shape) != shape:
      raise ValueError(
          f"output_perturbations['{path}'] has shape {tuple(delta.shape)}, expected {shape} (the layer's output "
          f"{tuple(y.shape)} as rows of its kernel's output axes): make them with output_perturbations_nnx / "
          "output_perturbations_linen on a batch of this shape.")
    moved = jnp.transpose(y, perm) + delta.reshape(moved_shape).astype(y.dtype)
    return jnp.transpose(moved, tuple(int(i) for i in np.argsort(perm)))

  def zeros(self) -> "CapturedInputs":
    return CapturedInputs({p: jnp.zeros(s.shape, s.dtype) for p, s in self.shapes.items()}, self.axes)


def _flat(tree) -> dict:
  """``{'layer/kernel': leaf}``, named as the transformation names kernels (:func:`plan.path_to_str`)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {plan_lib.path_to_str(p): v for p, v in flat}


@contextlib.contextmanager
def _patched_nnx(names, max_rows, counter, axes, outputs=None):
  originals = {cls: cls.__call__ for cls in NNX_LAYERS}

  def make(orig):
    def call(self, inputs, *args, **kwargs):
      path = names.get(id(self), "")
      spec = layer_spec(self, path or type(self).__name__, _einsum_arg(self, args, kwargs))
      param_path = _param_path(path, spec)
      axes[param_path] = spec.input_axes
      self.sow(LayerInput, spec.param, spec.rows(jax.lax.stop_gradient(inputs), max_rows, counter.key()))
      y = orig(self, inputs, *args, **kwargs)
      return y if outputs is None else outputs(param_path, spec, y)

    return call

  try:
    for cls, orig in originals.items():
      cls.__call__ = make(orig)
    yield
  finally:
    for cls, orig in originals.items():
      cls.__call__ = orig


def capture_nnx(
    model: nnx.Module,
    *args,
    rng: Optional[jax.Array] = None,
    max_rows: Optional[int] = DEFAULT_MAX_ROWS,
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
  outputs = None if output_perturbations is None else _Outputs(output_perturbations)
  return _capture_nnx(model, args, kwargs, rng, max_rows, outputs)


def _capture_nnx(model, args, kwargs, rng, max_rows, outputs):
  _check_max_rows(max_rows)
  names = {id(node): "/".join(map(str, path)) for path, node in nnx.iter_graph(model)
           if isinstance(node, nnx.Module)}
  counter, axes = _Counter(rng), {}
  with _patched_nnx(names, max_rows, counter, axes, outputs):
    out, captured = nnx.capture(lambda m, *a, **k: m(*a, **k), LayerInput)(model, *args, **kwargs)
  pure = nnx.to_pure_dict(captured)
  return out, CapturedInputs(jax.tree.map(_merge, pure, is_leaf=lambda v: isinstance(v, tuple)), axes)


def output_perturbations_nnx(model: nnx.Module, *args, **kwargs) -> CapturedInputs:
  """Zeros to add to the outputs of an NNX model's conditioned layers, for output-side conditioning.

  One ``(rows, p)`` array per conditioned kernel but embeddings, ``p`` the product of the kernel's output
  axes (in the kernel's order) and ``rows`` all the other output positions of ``model(*args, **kwargs)``
  (traced once, no compute; their shapes follow the batch's). Pass them to :func:`capture_nnx` inside the
  loss and take the loss's gradient with respect to them: it is a :class:`CapturedInputs` of each layer's
  back-propagated rows ``delta`` (which also says the kernel's output axes), the ``output_grads=`` of
  :func:`scale_by_output_conditioning`::

    perturbations = scsgd_jax.output_perturbations_nnx(model, x)
    def loss_fn(model, perturbations):
      logits, layer_inputs = scsgd_jax.capture_nnx(model, x, rng=key, output_perturbations=perturbations)
      return loss(logits, y), layer_inputs
    (loss, layer_inputs), (grads, output_grads) = nnx.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(model, perturbations)
    optimizer.update(model, grads, layer_inputs=layer_inputs, output_grads=output_grads)
  """
  graphdef, state = nnx.split(model)
  outputs = _Outputs()
  jax.eval_shape(lambda s: _capture_nnx(nnx.merge(graphdef, s), args, kwargs, None, None, outputs)[0], state)
  return outputs.zeros()


def input_axes_nnx(model: nnx.Module) -> dict[str, tuple[int, ...]]:
  """``{param path: input axes}`` of every captured layer of an NNX model, read from the layers themselves.

  The captured :class:`CapturedInputs` already carry these axes (the transformation reads them); pass this
  as ``scsgd(..., input_axes=input_axes_nnx(model))`` only to fix the plan at ``init`` (see
  :func:`~scsgd_jax.scale_by_sketched_conditioning`) or for rows captured by other means.
  """
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, NNX_LAYERS):
      name = "/".join(map(str, path))
      spec = layer_spec(node, name)
      if spec.input_axes is None:
        raise ValueError(
            f"layer '{name}' is an Einsum whose equation is given only at call time; name its kernel's "
            f"input axes yourself, e.g. input_axes={{'{name}/kernel': (0,)}}.")
      out[_param_path(name, spec)] = spec.input_axes
  return out


def _linen_interceptor(max_rows, counter, record, sow=True, outputs=None):
  def interceptor(next_fun, a, k, context):
    mod = context.module
    if context.method_name == "__call__" and isinstance(mod, LINEN_LAYERS) and a:
      name = "/".join(map(str, mod.path)) or type(mod).__name__
      spec = layer_spec(mod, name, _einsum_arg(mod, a[1:], k))
      param_path = "/".join((*map(str, mod.path), spec.param))
      record[param_path] = spec.input_axes
      if sow:
        mod.sow(LINEN_COLLECTION, spec.param, spec.rows(jax.lax.stop_gradient(a[0]), max_rows, counter.key()))
      if outputs is not None:
        return outputs(param_path, spec, next_fun(*a, **k))
    return next_fun(*a, **k)

  return interceptor


def capture_linen(
    module: nn.Module,
    variables,
    *args,
    rng: Optional[jax.Array] = None,
    max_rows: Optional[int] = DEFAULT_MAX_ROWS,
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
    rng, max_rows: as for :func:`capture_nnx`.
    mutable: further mutable collections (e.g. ``['batch_stats']``); their new
      values are returned as a third output when given.
    output_perturbations: as for :func:`capture_nnx`, from :func:`output_perturbations_linen`.

  Returns:
    ``(output, layer_inputs)`` (``(output, layer_inputs, updated_collections)`` if
    ``mutable``), ``layer_inputs`` a :class:`CapturedInputs` mirroring ``variables['params']``.
  """
  outputs = None if output_perturbations is None else _Outputs(output_perturbations)
  return _capture_linen(module, variables, args, kwargs, rng, max_rows, mutable, outputs)


def _capture_linen(module, variables, args, kwargs, rng, max_rows, mutable, outputs):
  _check_max_rows(max_rows)
  axes = {}
  with nn.intercept_methods(_linen_interceptor(max_rows, _Counter(rng), axes, outputs=outputs)):
    out, state = module.apply(variables, *args, mutable=[LINEN_COLLECTION, *mutable], **kwargs)
  state = dict(state)
  captured = state.pop(LINEN_COLLECTION, {})
  captured = CapturedInputs(jax.tree.map(_merge, dict(captured), is_leaf=lambda v: isinstance(v, tuple)), axes)
  if mutable:
    return out, captured, state
  return out, captured


def output_perturbations_linen(module: nn.Module, variables, *args, **kwargs) -> CapturedInputs:
  """:func:`output_perturbations_nnx` for a Linen model (``module.apply(variables, *args, **kwargs)``);
  pass them to :func:`capture_linen`."""
  outputs = _Outputs()
  jax.eval_shape(lambda v: _capture_linen(module, v, args, kwargs, None, None, (), outputs)[0], variables)
  return outputs.zeros()


def input_axes_linen(module: nn.Module, variables, *args, **kwargs) -> dict[str, tuple[int, ...]]:
  """``{param path: input axes}`` of every captured layer of a Linen model, traced once (no compute) on ``args``."""
  record = {}

  def run(variables, *a):
    with nn.intercept_methods(_linen_interceptor(None, _Counter(None), record, sow=False)):
      return module.apply(variables, *a, **kwargs)

  jax.eval_shape(run, variables, *args)
  return record


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
