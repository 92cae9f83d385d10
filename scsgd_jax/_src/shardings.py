"""The optimizer state's shardings from the parameters': what to give ``jax.jit``'s ``out_shardings`` for ``init``
(and the step's state), so the statistics shard with their kernels instead of staying whole on every device."""

from __future__ import annotations

import math
from typing import Mapping, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src.state import PlanSummary

__all__ = ["state_shardings"]


def state_shardings(tx, params, param_shardings):
  """The shardings of ``tx.init(params)``'s leaves, from the parameters' (``param_shardings``: a tree like
  ``params`` of :class:`~jax.sharding.NamedSharding`, or of :class:`~jax.sharding.PartitionSpec`; the answer is of
  the same kind).

  - A leaf shaped like a parameter, at that parameter's place in a tree like the parameters (momentum, Adam's
    moments, any optax state's): the parameter's sharding.
  - A conditioned kernel's statistics, factor and rotated moments: along the kernel's input (``n``) axes where a
    dimension has the kernel's ``n``, along its output (``p``) axes where one has its ``p``, along its stack axes
    where one leads with its slices; each mesh axis used once per leaf, and only where it divides the dimension.
    An ``n`` or ``p`` the kernel does not shard (its input side under tensor parallelism, its output side under
    FSDP) takes the kernel's axes no other dimension of the leaf took, so the state shards as far as its kernel
    does.
    The output side's state reads the kernel's output axes as its ``n``.
  - Everything else (counts, keys, rotations ``k x k``): replicated.

  ``tx`` may be any optax transformation containing this library's (a chain, ``optax.masked``, ...): the
  conditioning states are found in ``jax.eval_shape(tx.init, params)`` by type. Example::

    shardings = scsgd_jax.state_shardings(tx, params, jax.tree.map(lambda p: p.sharding, params))
    opt_state = jax.jit(tx.init, out_shardings=shardings)(params)
  """
  state = jax.eval_shape(tx.init, params)
  flat, leaves = _matched(params, param_shardings)
  by_path = {_keys(p): (tuple(leaf.shape), s) for (p, leaf), s in zip(flat, leaves)}
  kernels = {layout_lib.path_to_str(p): (tuple(leaf.shape), s) for (p, leaf), s in zip(flat, leaves)}
  kind = next(iter(leaves), None)
  replicated = (NamedSharding(kind.mesh, PartitionSpec()) if isinstance(kind, NamedSharding) else PartitionSpec())
  return _walk(state, (), None, kernels, by_path, replicated)


def _is_sharding(x) -> bool:
  return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def _matched(params, param_shardings):
  """``params``' leaves with paths, and each one's sharding: ``param_shardings`` a tree like ``params``, or any tree
  whose paths name the same parameters (a dict for an ``nnx.State``, ``nnx.get_named_sharding``'s state)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  try:
    return flat, treedef.flatten_up_to(param_shardings)
  except (ValueError, TypeError):
    pass
  given = {layout_lib.path_to_str(p): s
           for p, s in jax.tree_util.tree_flatten_with_path(param_shardings, is_leaf=_is_sharding)[0]}
  missing = [layout_lib.path_to_str(p) for p, _ in flat if layout_lib.path_to_str(p) not in given]
  if missing or not all(_is_sharding(s) for s in given.values()):
    raise ValueError(
        "state_shardings: param_shardings must hold a NamedSharding or PartitionSpec for every parameter, as a tree "
        f"like params or by the same paths; {len(missing)} parameter(s) have none (e.g. {missing[:3]}). Pass "
        "jax.tree.map(lambda p: p.sharding, params), or for NNX nnx.get_named_sharding(nnx.state(model, nnx.Param), "
        "mesh).")
  return flat, [given[layout_lib.path_to_str(p)] for p, _ in flat]


def _keys(path) -> tuple:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _layouts(node) -> Optional[dict]:
  """The kernels' layouts a state node's own plans read (its ``plan``, or its conditioning's), or ``None``."""
  plan = getattr(node, "plan", None)
  if isinstance(plan, PlanSummary):
    return plan.layouts
  inner = getattr(node, "conditioning", None)
  return _layouts(inner) if inner is not None else None


def _walk(node, path, layouts, kernels, by_path, replicated):
  """The shardings of ``node`` (at key path ``path``), ``layouts`` those of the nearest enclosing conditioning."""
  if node is None:
    return None
  if isinstance(node, banks_lib.Banked) and layouts:  # {kernel path: ...} in banks
    return banks_lib.Banked(node.index, [_bank_sharding(bank, tree, kernels, layouts, replicated)
                                         for bank, tree in zip(node.index.banks, node.banks)])
  if isinstance(node, Mapping) and layouts and node and all(k in layouts for k in node):  # {kernel path: ...}
    return type(node)({k: jax.tree.map(lambda leaf, k=k: _kernel_sharding(leaf, kernels[k], layouts[k], replicated), v)
                       for k, v in node.items()})
  children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
  if treedef == jax.tree_util.tree_structure(0):  # an array: a parameter's place, with its shape, or replicated
    for start in range(len(path)):
      hit = by_path.get(tuple(path[start:]))
      if hit is not None and hit[0] == tuple(node.shape):
        return hit[1]
    return replicated
  own = _layouts(node)  # a conditioning state: its own plans; else its enclosing one's
  inner = layouts if own is None else own
  return treedef.unflatten(
      _walk(child, path + _keys(key), _side(node, _keys(key), inner), kernels, by_path, replicated)
      for key, child in children)


def _bank_sharding(bank, tree, kernels, layouts, replicated):
  """A bank's stacked leaves sharded as its members are (:func:`_kernel_sharding`): each dimension along the mesh
  axes the first member that shards it gives it (each axis once per leaf); a bank of lone kernels keeps its
  stacking axis whole."""
  def one(leaf):
    if not hasattr(leaf, "shape"):
      return replicated
    specs = []
    for path, size, lone in zip(bank.paths, bank.sizes, bank.lone):
      shape = leaf.shape[1:] if lone else (size,) + tuple(leaf.shape[1:])
      got = _kernel_sharding(jax.ShapeDtypeStruct(shape, leaf.dtype), kernels[path], layouts[path], replicated)
      spec = _spec_of(got, len(shape))
      specs.append((None,) + spec if lone else spec)
    out, used = [], set()
    for candidates in zip(*specs):
      pick = next((c for c in candidates if c is not None and not set(_mesh_axes([c])) & used), None)
      used.update(_mesh_axes([pick]))
      out.append(pick)
    spec = PartitionSpec(*out)
    return NamedSharding(replicated.mesh, spec) if isinstance(replicated, NamedSharding) else spec

  return jax.tree.map(one, tree)


def _side(node, field: tuple, layouts):
  """An eigenbasis state's output rotations are read along the output side's layouts."""
  if field == ("output_rotations",) and getattr(node, "output", None) is not None:
    return _layouts(node.output)
  return layouts


def _kernel_sharding(leaf, kernel, layout: layout_lib.Layout, replicated):
  """One leaf of a kernel's statistics, factor or moments, sharded along the kernel's axes of equal size."""
  if not hasattr(leaf, "shape"):
    return replicated
  shape, sharding = kernel
  spec = _spec_of(sharding, len(shape))
  stack = layout.stack
  n_axes = _mesh_axes(spec[stack + a] for a in layout.input_axes)
  p_axes = _mesh_axes(spec[stack + a] for a in range(len(shape) - stack) if a not in layout.input_axes)
  n = math.prod(shape[stack + a] for a in layout.input_axes)
  slices = math.prod(shape[:stack]) * layout.groups
  p = math.prod(shape) // (n * slices)
  out, used, dims = [None] * len(leaf.shape), set(), list(leaf.shape)
  wanted = {}  # {leaf dimension: the kernel's mesh axes it takes}, in the order they are given
  stacked = bool((stack or layout.groups > 1) and dims and dims[0] == slices)
  if stacked:
    wanted[0] = _mesh_axes(spec[:stack]) if layout.groups == 1 else ()
  free = lambda size: next((d for d in range(len(dims)) if dims[d] == size and d not in wanted), None)
  d = free(n)
  if d is not None:
    wanted[d] = n_axes
  d = free(p)
  d = free(n) if d is None else d  # no p: a dense C (n, n) gives its second n the output axes
  if d is not None:
    wanted[d] = p_axes
  mesh = getattr(sharding, "mesh", None)
  fits = lambda d, axes: axes and (mesh is None or dims[d] % math.prod(mesh.shape[a] for a in axes) == 0)
  for d, axes in wanted.items():
    axes = tuple(a for a in axes if a not in used)
    if fits(d, axes):
      out[d] = axes[0] if len(axes) == 1 else axes
      used.update(axes)
  # an n or p the kernel does not shard (under tensor parallelism the input side, under FSDP the output side and
  # the rotated moments' p): along the kernel's axes no other dimension took (n first), so no statistic, factor or
  # moment stays whole on every device while its kernel is split
  for d in [d for d in wanted if not (stacked and d == 0)]:
    spare = tuple(a for a in _mesh_axes(spec) if a not in used)
    if out[d] is None and fits(d, spare):
      out[d] = spare[0] if len(spare) == 1 else spare
      used.update(spare)
  spec = PartitionSpec(*out)
  return NamedSharding(sharding.mesh, spec) if isinstance(sharding, NamedSharding) else spec


def _spec_of(sharding, ndim: int) -> tuple:
  spec = tuple(sharding.spec if isinstance(sharding, NamedSharding) else sharding or ())
  return spec + (None,) * (ndim - len(spec))


def _mesh_axes(entries) -> tuple[str, ...]:
  out = []
  for e in entries:
    out.extend(() if e is None else (e,) if isinstance(e, str) else tuple(e))
  return tuple(out)
