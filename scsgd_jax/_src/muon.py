"""Muon's orthogonalization behind the eigenbasis Adam: which kernels it takes, and Muon without its momentum
buffer (:func:`behind`)."""

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


def _has_count(x) -> bool:
  return isinstance(x, tuple) and "count" in getattr(x, "_fields", ())


def _with_counts(state, count):
  """``state`` with every optax state's ``count`` field (Muon's, its AdamW part's, a schedule's) set to ``count``."""

  def one(s):
    return type(s)(*(count if f == "count" else _with_counts(v, count) for f, v in zip(s._fields, s)))

  return jax.tree.map(lambda s: one(s) if _has_count(s) else s, state, is_leaf=_has_count)


def _lean(state, counts: bool):
  """Muon's state less its momentum buffers and, with ``counts``, its Newton-Schulz coefficients (constants of its
  constructor) and its counters (each the number of updates applied so far)."""
  drop = {"mu": None, **({"ns_coeffs": None} if counts else {})}
  state = jax.tree.map(lambda s: s._replace(**drop) if _is_muon(s) else s, state, is_leaf=_is_muon)
  return _with_counts(state, None) if counts else state


def _refilled(kept, fresh, count=None):
  """``kept`` (a :func:`_lean` state) with each field it left out taken from ``fresh`` (Muon's ``init``: zero
  momentum, its coefficients) and, given ``count``, every counter set to it."""
  full = jax.tree.map(lambda k, f: f if k is None else k, kept, fresh, is_leaf=lambda x: x is None)
  return full if count is None else _with_counts(full, count)


def behind(first: optax.GradientTransformation, muon: optax.GradientTransformation
           ) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(first, muon)`` (``muon`` an ``optax.contrib.muon`` built with ``beta=0``) whose Muon part keeps
  only its AdamW part's moments.

  At ``beta = 0`` Muon's momentum is the incoming update itself (``0 * mu + g``, Nesterov's ``0 * mu + g``, bias
  corrections of ``1``), so the buffer it keeps is never read: the state holds each ``MuonState`` with ``mu=None``
  and the update hands Muon zeros in its place (the eigenbasis in front keeps the momentum).

  ``first``'s state has a ``count`` (updates applied so far; the eigenbasis Adam's is its conditioning's). Every
  counter of Muon's state (Muon's own, unread at ``beta = 0``; its AdamW part's bias correction; a schedule's)
  counts the same updates, so the state keeps none and the update hands Muon ``first``'s; its Newton-Schulz
  coefficients come from ``muon.init``. The same arithmetic bit for bit as the chain, with one counter in the
  state where AdamW keeps its own (the state is a tuple, ``(first's, Muon's)``, as the chain's)."""
  first, muon = optax.with_extra_args_support(first), optax.with_extra_args_support(muon)

  def init(params):
    return first.init(params), _lean(muon.init(params), counts=True)

  def update(updates, state, params=None, **extra):
    first_state, muon_state = state
    count = first_state.count  # before this update: what each of Muon's counters would hold
    updates, first_state = first.update(updates, first_state, params, **extra)
    full = _refilled(muon_state, muon.init(updates), count)
    updates, full = muon.update(updates, full, params, **extra)
    return updates, (first_state, _lean(full, counts=True))

  return optax.GradientTransformationExtraArgs(init, update)


def checked_output_layer(output_layer: str, tx: optax.GradientTransformationExtraArgs
                         ) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``init`` refuses an ``output_layer`` that no kernel's path contains (a typo would send the head to
  Newton-Schulz), naming the kernels it could name."""
  if not output_layer:
    return tx

  def init(params):
    kernels = layout_lib.kernel_paths(params, layout_lib.default_kernel_filter)
    if not any(output_layer in path for path in kernels):
      raise ValueError(f"output_layer={output_layer!r} is in no kernel's path; the kernels are {sorted(kernels)}: "
                       "pass a part of the head's path (or output_layer='' for none).")
    return tx.init(params)

  return optax.GradientTransformationExtraArgs(init, tx.update)
