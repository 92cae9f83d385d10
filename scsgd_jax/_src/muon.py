"""Muon's orthogonalization behind the eigenbasis Adam: which kernels it takes, and Muon without its momentum
buffer (:func:`muon_without_momentum`)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax
import optax.contrib

from scsgd_jax._src import layout as layout_lib


def muon_kernel_filter(output_layer: str = "", input_axes: layout_lib.InputAxes = None) -> Callable[[str, Any], bool]:
  """The kernels Muon's authors give Muon: the kernels the conditioning takes by default (:func:`default_kernel_filter`'s
  and every matrix an ``input_axes`` mapping names, :func:`kernels_of`) but the embedding tables and the output
  layer (a path containing ``output_layer``; ``""``: none is)."""
  kernels = layout_lib.kernels_of(None, input_axes)

  def hidden(path: str, leaf) -> bool:
    return (kernels(path, leaf) and not layout_lib.is_embedding(path)
            and not (output_layer and output_layer in path))

  return hidden


def muon_kernels(kernel_filter: Callable[[str, Any], bool], input_axes: layout_lib.InputAxes = None):
  """``kernel_filter`` narrowed to the kernels Muon can take as matrices: not left plain by ``input_axes`` and
  not grouped (a grouped kernel's blocks are separate problems; Muon's AdamW part takes it)."""

  def keep(path: str, leaf) -> bool:
    if not kernel_filter(path, leaf):
      return False
    layout = layout_lib.layout_of(path, leaf, input_axes)
    return layout is not None and layout.groups == 1

  return keep


def muon_dimension_numbers(kernel_filter: Callable[[str, Any], bool], input_axes: layout_lib.InputAxes = None):
  """``optax.contrib.muon``'s ``muon_weight_dimension_numbers``: each kernel ``kernel_filter`` keeps is
  orthogonalized as the matrix the eigenbasis reads it as (its input axes against the rest, from ``input_axes``
  or :func:`default_input_axes`; a layer stack's leading axes each their own matrix); every other leaf goes to
  Muon's AdamW part."""

  def numbers(path, leaf):
    name = layout_lib.path_to_str(path)
    if not kernel_filter(name, leaf):
      return None
    layout = layout_lib.layout_of(name, leaf, input_axes)
    stack = tuple(range(layout.stack))
    reduction = tuple(layout.stack + a for a in layout.input_axes)
    output = tuple(a for a in range(leaf.ndim) if a not in reduction and a not in stack)
    return optax.contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)

  return lambda params: jax.tree_util.tree_map_with_path(numbers, params)


def _is_muon(x) -> bool:
  return isinstance(x, optax.contrib.MuonState)


def _without_momentum(state):
  """Muon's state less what it never reads at ``beta = 0``: each ``MuonState``'s momentum buffer."""
  lean = lambda s: s._replace(mu=None)
  return jax.tree.map(lambda s: lean(s) if _is_muon(s) else s, state, is_leaf=_is_muon)


def _refilled(kept, fresh):
  """``kept`` (a :func:`_without_momentum` state) with each buffer it left out taken from ``fresh`` (``init``'s
  zeros)."""
  return jax.tree.map(lambda k, f: f if k is None else k, kept, fresh, is_leaf=lambda x: x is None)


def _check_output_layer(params, output_layer: str) -> None:
  """Refuse an ``output_layer`` that no kernel's path contains (a typo would send the head to Newton-Schulz), naming
  the kernels it could name."""
  if not output_layer:
    return
  kernels = layout_lib.kernel_paths(params, layout_lib.default_kernel_filter)
  if not any(output_layer in path for path in kernels):
    raise ValueError(f"output_layer={output_layer!r} is in no kernel's path; the kernels are {sorted(kernels)}: "
                     "pass a part of the head's path (or output_layer='' for none).")


# optax.contrib.muon's arguments that muon_without_momentum sets itself
_MUON_OWN = ("beta", "nesterov", "mu_dtype", "muon_weight_dimension_numbers")


def muon_without_momentum(learning_rate: optax.ScalarOrSchedule,
                          kernel_filter: Callable[[str, Any], bool],
                          *,
                          input_axes: layout_lib.InputAxes = None,
                          output_layer: str = "",
                          **muon: Any) -> optax.GradientTransformationExtraArgs:
  """``optax.contrib.muon(learning_rate, beta=0, **muon)`` without the momentum buffer it never reads, for a
  transform in front that keeps the momentum (:func:`scsgd_eigen_muon`'s eigenbasis Adam).

  At ``beta = 0`` Muon's momentum is the incoming update itself (``0 * mu + g``, Nesterov's ``0 * mu + g``, bias
  corrections of ``1``): the state holds each ``MuonState`` with ``mu=None`` and the update hands Muon zeros in its
  place, the same arithmetic as ``optax.contrib.muon`` bit for bit, one float per orthogonalized parameter less.
  The kernels ``kernel_filter`` keeps (narrowed by :func:`muon_kernels`) are orthogonalized as the matrices of
  their input axes (:func:`muon_dimension_numbers`); every other leaf goes to Muon's AdamW part. ``init`` refuses
  an ``output_layer`` that no kernel's path contains.

  Args:
    learning_rate: Muon's rate.
    kernel_filter: ``(path, leaf) -> bool``, the kernels to orthogonalize (e.g. :func:`muon_kernel_filter`).
    input_axes: the conditioning's ``input_axes`` (how each kernel is read as a matrix).
    output_layer: the head's name, checked at ``init`` to name a kernel (``""``: not checked).
    **muon: ``optax.contrib.muon``'s other arguments (``adam_learning_rate``, ``weight_decay``, ``ns_steps``, ...).
  """
  for name in muon:
    if name in _MUON_OWN:
      raise TypeError(f"muon_without_momentum sets optax.contrib.muon's {name}= itself (it runs at beta=0 behind "
                      f"a transform that keeps the momentum); {', '.join(_MUON_OWN)} are not taken.")
  kernels = muon_kernels(kernel_filter, input_axes)
  tx = optax.with_extra_args_support(
      optax.contrib.muon(learning_rate,
                         beta=0.0,
                         muon_weight_dimension_numbers=muon_dimension_numbers(kernels, input_axes),
                         **muon))

  def init(params):
    _check_output_layer(params, output_layer)
    return _without_momentum(tx.init(params))

  def update(updates, state, params=None, **extra):
    updates, full = tx.update(updates, _refilled(state, tx.init(updates)), params, **extra)
    return updates, _without_momentum(full)

  return optax.GradientTransformationExtraArgs(init, update)
