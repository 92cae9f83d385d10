"""How a kernel parameter reads as matrices ``(n, p)``: which leaves are kernels, their input axes, and the
``input_axes`` entries that say so (:class:`Layout`, :class:`Plain`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax

__all__ = ["InputAxes", "Layout", "Plain", "axes_of", "default_input_axes", "default_kernel_filter", "is_embedding",
           "kernel_paths", "kernels_of", "layout_of", "path_to_str", "plain_why", "check_input_axes_keys"]


class Layout(NamedTuple):
  """How a kernel parameter reads as matrices ``(n, p)``: one, or a stack of them.

  Attributes:
    input_axes: the axes of one slice's kernel contracted with the layer input.
    stack: leading axes that index layers, not features (``nnx.scan``/``nnx.vmap``/``nn.scan`` stacks):
      each index is its own layer, conditioned by its own statistics.
    groups: feature groups of a grouped convolution: the last (output) axis is ``groups`` blocks, block
      ``i`` read by input channels block ``i`` only, each its own problem (block-diagonal ``C``).
    reads: the path of another kernel whose layer reads the same input rows (an attention's query, key and value,
      a gated MLP's gate and up): this kernel is conditioned by that kernel's statistics and factors and keeps
      none of its own (:func:`scsgd_jax.input_axes_nnx` of a model and an input finds them).
  """

  input_axes: tuple[int, ...]
  stack: int = 0
  groups: int = 1
  reads: Optional[str] = None

  def __repr__(self) -> str:
    reads = "" if self.reads is None else f", reads={self.reads!r}"
    return f"Layout(input_axes={self.input_axes}, stack={self.stack}, groups={self.groups}{reads})"


class Plain(NamedTuple):
  """An ``input_axes`` entry for a kernel whose layer the conditioning cannot read (a transposed conv, ...):
  ``init`` plans it plain (no statistics) and the summary says ``why`` (:func:`scsgd_jax.input_axes_nnx`)."""

  why: str


InputAxes = Union[None, Mapping[str, Union[Sequence[int], Layout, Plain]], Callable[[str, Any], Sequence[int]]]


def plain_why(input_axes: InputAxes, path: str) -> Optional[str]:
  """Why ``input_axes`` leaves kernel ``path`` plain, or ``None``."""
  entry = input_axes.get(path) if isinstance(input_axes, Mapping) else None
  return entry.why if isinstance(entry, Plain) else None


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_to_str(path) -> str:
  """``('conv1', 'kernel')``-style key path as ``'conv1/kernel'`` (the names used in errors and in the state).

  The trailing ``.value`` of an ``nnx.Variable`` leaf is dropped, so an NNX state
  of Variables and its pure-array form give the same names.
  """
  path = tuple(path)
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]
  return "/".join(_key_str(k) for k in path)


def is_embedding(path: str) -> bool:
  """Whether ``path`` names a token table (Flax's ``embedding``): the one predicate the planner, Muon's filter and the
  output side read."""
  return path.rsplit("/", 1)[-1] == "embedding"


def default_kernel_filter(path: str, leaf: jax.Array) -> bool:
  """Flax's conventions: a ``kernel`` with at least two dims (Dense, Conv, DenseGeneral, Einsum) or a 2-D ``embedding``."""
  ndim = getattr(leaf, "ndim", 0)
  return (path.rsplit("/", 1)[-1] == "kernel" and ndim >= 2) or (is_embedding(path) and ndim == 2)


def kernels_of(kernel_filter: Optional[Callable[[str, Any], bool]], input_axes: InputAxes
               ) -> Callable[[str, Any], bool]:
  """The kernels conditioned: ``kernel_filter``'s; by default (``None``) Flax's kernels
  (:func:`default_kernel_filter`) and every matrix an ``input_axes`` mapping names (a model whose kernels Flax's
  names miss, e.g. Equinox's ``weight``, is conditioned by naming them there)."""
  if kernel_filter is not None:
    return kernel_filter
  if not isinstance(input_axes, Mapping):
    return default_kernel_filter
  named = frozenset(input_axes)
  return lambda path, leaf: default_kernel_filter(path, leaf) or (path in named and getattr(leaf, "ndim", 0) >= 2)


def default_input_axes(path: str, leaf: jax.Array) -> tuple[int, ...]:
  """The input axes of a Flax kernel, read from its name and rank.

  - ``.../embedding`` ``(vocab, features)``: ``(0,)`` (one-hot input).
  - attention's ``.../query|key|value/kernel`` ``(in, heads, head_dim)`` (``nnx.MultiHeadAttention``,
    ``nn.MultiHeadDotProductAttention``): ``(0,)``.
  - everything else: all but the last axis (Dense ``(n, p)``, Conv ``(*window, cin, cout)``,
    attention's ``out`` ``(heads, head_dim, out)``, a DenseGeneral with one output axis).

  A DenseGeneral with several output axes or an Einsum kernel is read by the axes that
  :func:`~scsgd_jax.capture_nnx` / :func:`~scsgd_jax.capture_linen` read from the layer itself
  (carried by the captured inputs); these defaults serve rows captured by other means.
  """
  parts = path.split("/")
  if is_embedding(path):
    return (0,)
  if leaf.ndim == 3 and len(parts) >= 2 and parts[-2] in ("query", "key", "value"):
    return (0,)
  return tuple(range(leaf.ndim - 1))


def kernel_paths(tree, kernel_filter: Callable[[str, Any], bool] = default_kernel_filter) -> dict[str, Any]:
  """``{path: leaf}`` of the leaves of ``tree`` that ``kernel_filter`` selects."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {path_to_str(p): leaf for p, leaf in flat if kernel_filter(path_to_str(p), leaf)}


def check_input_axes_keys(input_axes: InputAxes, tree) -> None:
  """Refuses an ``input_axes`` mapping key that names no parameter of ``tree`` (a typo would leave the layer it
  meant to the defaults, silently), naming the key and the closest parameter paths."""
  if not isinstance(input_axes, Mapping):
    return
  import optax  # a leaf optax.masked / partition hid is still a parameter: its path counts
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  paths = [path_to_str(p) for p, _ in flat]
  unknown = sorted(set(input_axes) - set(paths))
  if unknown:
    import difflib
    near = {k: difflib.get_close_matches(k, paths, n=3, cutoff=0.5) for k in unknown}
    raise ValueError("input_axes names no parameter at " + "; ".join(
        f"'{k}'" + (f" (closest: {', '.join(repr(m) for m in near[k])})" if near[k] else "") for k in unknown)
        + ". Keys are parameter paths joined by '/', e.g. 'layers/0/kernel'.")


def layout_of(path: str, leaf, input_axes: InputAxes, captured: Optional[Mapping[str, Any]] = None,
              default: Optional[Callable[[str, Any], tuple[int, ...]]] = None) -> Optional[Layout]:
  """The one layout rule: how kernel ``path`` is read (:func:`axes_of`), or ``None`` when ``input_axes`` leaves it
  :class:`Plain`. The planner, Muon's filter and the output side read each kernel by it."""
  if plain_why(input_axes, path) is not None:
    return None
  return axes_of(path, leaf, input_axes, captured, default)


def axes_of(path: str, leaf, input_axes: InputAxes, captured: Optional[Mapping[str, Any]] = None,
            default: Optional[Callable[[str, Any], tuple[int, ...]]] = None) -> Layout:
  """The checked :class:`Layout` of kernel ``path``: ``input_axes`` (callable or mapping; a tuple of axes or a
  :class:`Layout`), else what the capture read from the layer (``captured``), else the name-based defaults."""
  if callable(input_axes):
    layout = input_axes(path, leaf)
  elif input_axes is not None and path in input_axes:
    layout = input_axes[path]
  elif captured and captured.get(path) is not None:
    layout = captured[path]
  else:
    layout = (default or default_input_axes)(path, leaf)
  layout = layout if isinstance(layout, Layout) else Layout(tuple(layout))
  shape = tuple(leaf.shape)
  ndim = len(shape) - layout.stack
  if layout.stack < 0 or ndim < 2:
    raise ValueError(f"kernel '{path}' {shape}: {layout.stack} stack axes leave no matrix to condition.")
  given = tuple(int(a) for a in layout.input_axes)
  if any(not -ndim <= a < ndim for a in given):
    raise ValueError(
        f"input axes {given} of kernel '{path}' {shape}: each must lie in [-{ndim}, {ndim}), the axes of "
        + (f"one slice {shape[layout.stack:]} of its {layout.stack}-axis stack." if layout.stack else "the kernel."))
  axes = tuple(a % ndim for a in given)
  if not axes or len(set(axes)) != len(axes) or len(axes) >= ndim:
    raise ValueError(
        f"input axes {axes} of kernel '{path}' {shape} must be distinct and leave at least one output axis"
        + (f" of each of its {layout.stack}-axis stack's slices {shape[layout.stack:]}." if layout.stack else "."))
  if layout.groups < 1 or shape[-1] % layout.groups or (layout.groups > 1 and ndim - 1 in axes):
    raise ValueError(f"kernel '{path}' {shape}: {layout.groups} feature groups must divide its last (output) axis.")
  if layout.reads is not None and (not isinstance(layout.reads, str) or layout.reads == path):
    raise ValueError(f"kernel '{path}': Layout(reads={layout.reads!r}) must name another kernel's path, whose "
                     "statistics this kernel reads.")
  return layout._replace(input_axes=axes)
