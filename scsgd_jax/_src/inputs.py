"""What a capture hands the transformation: :class:`CapturedInputs`, the captured rows and each kernel's layout. No
Flax here: the optax transformations read it, and they import without Flax."""

from __future__ import annotations

import jax

__all__ = ["CapturedInputs", "HELPERS", "NNX_HELPER", "LINEN_HELPER"]

# the call that reads every layer's layout, per framework: what messages name as the fix
NNX_HELPER = "scsgd_jax.input_axes_nnx(model, x)"
LINEN_HELPER = "scsgd_jax.input_axes_linen(module, variables, x)"
HELPERS = f"{NNX_HELPER} (Linen: {LINEN_HELPER})"  # the framework unknown: both


@jax.tree_util.register_pytree_with_keys_class
class CapturedInputs(dict):
  """What :func:`capture_nnx` and :func:`capture_linen` return: a ``dict`` of the captured rows (mirroring the
  parameter tree) that also says how each kernel is read.

  ``input_axes`` (``{param path: Layout}``, e.g. ``{'attn/q_einsum/kernel': Layout((1,), 0, 1)}``: the
  kernel's input axes, its leading stack axes (a layer in ``nnx.scan``/``nnx.vmap``/``nn.scan``, whose rows
  then lead with the stack) and a grouped conv's feature groups) is read from the layers themselves at
  capture, Einsum equations included; it is static pytree metadata (no leaves), so it
  travels through ``jit``, ``pmap``, ``shard_map`` and ``jax.tree.map`` unchanged and costs nothing. The
  transformation reads it, so a DenseGeneral/Einsum model of any layout needs no ``input_axes=`` argument.
  ``unconditioned`` (``{param path: why}``, static too) names the kernels of layers the capture cannot
  condition (a grouped or transposed convolution, ...): the transformation gives them plain updates and
  says so in its ``summary()``, so no model fails to train because of one layer kind.
  ``helper`` (static too): the ``input_axes_*`` call of the model's framework, which messages name as the fix.
  Converted to a plain ``dict``, the rows stay valid and the kernels fall back to the name-based default axes.
  """

  def __init__(self, rows=(), input_axes=None, unconditioned=None, helper=HELPERS):
    super().__init__(rows)
    self.input_axes = dict(input_axes or {})
    self.unconditioned = dict(unconditioned or {})
    self.helper = helper

  def tree_flatten_with_keys(self):
    keys = tuple(sorted(self))
    return ([(jax.tree_util.DictKey(k), self[k]) for k in keys],
            (keys, tuple(sorted(self.input_axes.items())), tuple(sorted(self.unconditioned.items())), self.helper))

  def tree_flatten(self):
    children, aux = self.tree_flatten_with_keys()
    return [c for _, c in children], aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    keys, axes, unconditioned, helper = aux
    return cls(zip(keys, children), dict(axes), dict(unconditioned), helper)

  def __repr__(self):
    return (f"CapturedInputs({dict.__repr__(self)}, input_axes={self.input_axes}"
            + (f", unconditioned={self.unconditioned})" if self.unconditioned else ")"))
