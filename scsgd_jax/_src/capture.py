"""Capturing the inputs of Dense/Linear and Conv layers in the forward pass that computes the loss.

Neither helper needs a change to the model: the layers' ``__call__`` are
intercepted for the duration of one call, and what each layer sows is the
row matrix its kernel's statistics need (for convs, im2col rows of at most
``max_rows`` sampled output positions), stored under the layer's path with
the name ``kernel`` so that the result mirrors the parameter tree.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from scsgd_jax._src import patches

__all__ = ["LayerInput", "capture_linen", "capture_nnx", "layer_rows"]

DEFAULT_MAX_ROWS = 256
LINEN_COLLECTION = "layer_inputs"


class LayerInput(nnx.Intermediate):
  """NNX variable type of the captured input rows (a subtype of ``nnx.Intermediate``)."""


def _to_tuple(v, d):
  if v is None:
    return (1,) * d
  return (v,) * d if isinstance(v, int) else tuple(v)


def layer_rows(
    layer: Any,
    x: jax.Array,
    *,
    name: str,
    max_rows: Optional[int],
    key: Optional[jax.Array],
) -> jax.Array:
  """The ``(rows, n)`` inputs of ``layer``'s kernel for layer input ``x`` (Dense rows, or Conv im2col rows).

  ``layer`` is an ``nnx.Linear``/``nnx.Conv`` or ``nn.Dense``/``nn.Conv``; ``name``
  names it in errors.
  """
  x = jax.lax.stop_gradient(x)
  if isinstance(layer, (nnx.Conv, nn.Conv)):
    window = tuple(layer.kernel_size) if not isinstance(layer.kernel_size, int) else (layer.kernel_size,)
    d = len(window)
    groups = getattr(layer, "feature_group_count", 1)
    if groups != 1:
      raise NotImplementedError(
          f"layer '{name}' is a grouped convolution (feature_group_count={groups}); its kernel is not "
          "one (n, cout) matrix over all inputs. Exclude it with kernel_filter or optax.masked."
      )
    if any(v != 1 for v in _to_tuple(getattr(layer, "input_dilation", 1), d)):
      raise NotImplementedError(f"layer '{name}': input_dilation is not supported by the conv statistics.")
    try:
      return patches.conv_patch_rows(
          x, window,
          strides=_to_tuple(layer.strides, d),
          padding=layer.padding,
          dilation=_to_tuple(layer.kernel_dilation, d),
          max_rows=max_rows, key=key)
    except (ValueError, NotImplementedError) as e:
      raise type(e)(f"layer '{name}': {e}") from None
  return patches.dense_rows(x, max_rows, key)


class _Counter:
  def __init__(self, rng):
    self.rng = rng
    self.i = itertools.count()

  def key(self):
    return None if self.rng is None else jax.random.fold_in(self.rng, next(self.i))


def _merge(rows_tuple):
  rows = tuple(rows_tuple)
  return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


@contextlib.contextmanager
def _patched_nnx(names, max_rows, counter):
  originals = {cls: cls.__call__ for cls in (nnx.Linear, nnx.Conv)}

  def make(cls):
    orig = originals[cls]

    def call(self, inputs, *args, **kwargs):
      rows = layer_rows(self, inputs, name=names.get(id(self), type(self).__name__),
                        max_rows=max_rows, key=counter.key())
      self.sow(LayerInput, "kernel", rows)
      return orig(self, inputs, *args, **kwargs)

    return call

  try:
    for cls in originals:
      cls.__call__ = make(cls)
    yield
  finally:
    for cls, orig in originals.items():
      cls.__call__ = orig


def capture_nnx(
    model: nnx.Module,
    *args,
    rng: Optional[jax.Array] = None,
    max_rows: Optional[int] = DEFAULT_MAX_ROWS,
    **kwargs,
) -> tuple[Any, dict]:
  """Calls ``model(*args, **kwargs)`` and captures the inputs of its ``nnx.Linear`` and ``nnx.Conv`` layers.

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
    max_rows: rows kept per layer call (``None``: all). Conv rows are sampled
      output positions, gathered without materialising all patches.

  Returns:
    ``(output, layer_inputs)``, ``layer_inputs`` a nested dict mirroring the
    model's ``nnx.Param`` state: ``{..., 'layer': {'kernel': rows}}``. A layer called
    several times gets its rows concatenated.
  """
  names = {id(node): "/".join(map(str, path)) for path, node in nnx.iter_graph(model)
           if isinstance(node, nnx.Module)}
  counter = _Counter(rng)
  with _patched_nnx(names, max_rows, counter):
    out, captured = nnx.capture(lambda m, *a, **k: m(*a, **k), LayerInput)(model, *args, **kwargs)
  pure = nnx.to_pure_dict(captured)
  return out, jax.tree.map(_merge, pure, is_leaf=lambda v: isinstance(v, tuple))


def capture_linen(
    module: nn.Module,
    variables,
    *args,
    rng: Optional[jax.Array] = None,
    max_rows: Optional[int] = DEFAULT_MAX_ROWS,
    mutable=(),
    **kwargs,
):
  """``module.apply(variables, *args, **kwargs)`` capturing the inputs of its ``nn.Dense`` and ``nn.Conv`` layers.

  Uses ``nn.intercept_methods`` and ``Module.sow`` into the collection
  ``'layer_inputs'``; the model needs no change.

  Args:
    module, variables, *args, **kwargs: as for ``module.apply``.
    rng, max_rows: as for :func:`capture_nnx`.
    mutable: further mutable collections (e.g. ``['batch_stats']``); their new
      values are returned as a third output when given.

  Returns:
    ``(output, layer_inputs)`` (``(output, layer_inputs, updated_collections)`` if
    ``mutable``), ``layer_inputs`` mirroring ``variables['params']``.
  """
  counter = _Counter(rng)

  def interceptor(next_fun, a, k, context):
    mod = context.module
    if context.method_name == "__call__" and isinstance(mod, (nn.Dense, nn.Conv)) and a:
      name = "/".join(map(str, mod.path)) or type(mod).__name__
      rows = layer_rows(mod, a[0], name=name, max_rows=max_rows, key=counter.key())
      mod.sow(LINEN_COLLECTION, "kernel", rows)
    return next_fun(*a, **k)

  with nn.intercept_methods(interceptor):
    out, state = module.apply(variables, *args, mutable=[LINEN_COLLECTION, *mutable], **kwargs)
  state = dict(state)
  captured = state.pop(LINEN_COLLECTION, {})
  captured = jax.tree.map(_merge, captured, is_leaf=lambda v: isinstance(v, tuple))
  if mutable:
    return out, captured, state
  return out, captured
