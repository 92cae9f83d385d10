"""What a capture returns and the bookkeeping the NNX and Linen captures share: the rows of each
conditioned kernel (:class:`CapturedInputs`), the row-sampling keys, and the output perturbations
of output-side conditioning."""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import patches
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src.layers import LayerSpec
from scsgd_jax._src.layers import own_ndim

from scsgd_jax._src.inputs import CapturedInputs  # noqa: F401  (what a capture returns)
from scsgd_jax._src.inputs import LINEN_HELPER, NNX_HELPER  # noqa: F401  (the captures name theirs)

# why a tied token table (an Embed whose attend gives the logits) gets plain updates
TIED = ("a tied table: also the output projection (attend), whose gradient the token counts' conditioning does "
        "not describe")


# why the output side leaves a recurrent cell's kernels plain
RECURRENT_OUTPUT = ("the output side does not condition a recurrent cell's kernel (its outputs are made inside the "
                    "scan); its input side does")


def check_max_rows(max_rows) -> None:
  if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
    raise ValueError(
        f"max_rows must be a positive int (rows kept per layer call) or None (all rows), got {max_rows!r}; "
        "with no rows the statistics never change and training is plain SGD.")


class Counter:
  def __init__(self, rng):
    self.rng = rng
    self.i = itertools.count()

  def key(self):
    """The next layer's sampling key: its own Philox stream of the capture's ``rng``."""
    return None if self.rng is None else patches.stream_key(self.rng, next(self.i))


class Capture:
  """One capture call's bookkeeping, shared by the NNX and Linen captures and read by :func:`scsgd_jax.sow_rows`:
  what each kernel's layer reads (``layouts``), the kernels it cannot read (``unconditioned``: ``{path: why}``), the
  rows' budget and keys, the output side (``outputs``) and the shared-reads tracer (``reads``).

  ``sow(module, param, rows) -> bool`` and ``path_of(module) -> str`` are the framework's; ``recurrent`` counts the
  recurrent layers (``nn.RNN``, ``nnx.RNN``) whose scan the call is inside."""

  def __init__(self, helper: str, rng=None, max_rows=None, outputs=None, reads=None):
    check_max_rows(max_rows)
    self.helper = helper
    self.max_rows, self.counter, self.outputs, self.reads = max_rows, Counter(rng), outputs, reads
    self.layouts: dict[str, Any] = {}
    self.unconditioned: dict[str, str] = {}
    self.recurrent = 0
    self.sow: Optional[Callable[[Any, str, Any], bool]] = None
    self.path_of: Optional[Callable[[Any], str]] = None

  def plain(self, path: str, why: str) -> None:
    """Kernel ``path`` left unconditioned (plain updates) on both sides, and why."""
    for where in (self.unconditioned, self.outputs.unconditioned if self.outputs is not None else {}):
      where[path] = why

  def captured(self, rows) -> CapturedInputs:
    """The capture's result from the sown rows (``{..., 'kernel': (rows of each call, ...)}``)."""
    return CapturedInputs(merged(rows, self.layouts, self.max_rows, self.counter), self.layouts, self.unconditioned,
                          self.helper)

  @contextlib.contextmanager
  def active(self):
    """This capture, for :func:`active_capture`, while the model runs."""
    _ACTIVE.append(self)
    try:
      yield self
    finally:
      _ACTIVE.remove(self)


_ACTIVE: list[Capture] = []


def active_capture() -> Optional[Capture]:
  """The innermost capture running now (``None``: none)."""
  return _ACTIVE[-1] if _ACTIVE else None


def sow_rows(module, param: str, rows, layout=None) -> None:
  """Hands the capture running now the rows that parameter ``param`` of ``module`` reads: for a raw parameter the
  capture cannot find a layer for (a mixture of experts' ``(experts, d, hidden)`` weights used with
  ``jnp.einsum``). Outside :func:`capture_nnx` / :func:`capture_linen` (and the ``input_axes_*`` traces) it does
  nothing, so the model runs as before.

  Args:
    module: the NNX or Linen module that holds the parameter (``self`` in its ``__call__``).
    param: the parameter's name in ``module`` (its path is the module's path and this name).
    rows: ``(*stack, ..., n)``: the rows the parameter's input axes are contracted with, one set per slice of its
      stack (the axes between the stack and ``n`` are folded into rows, within the capture's ``max_rows``).
    layout: the parameter's :class:`~scsgd_jax.Layout` (e.g. ``Layout((0,), stack=1)`` for ``(experts, d, hidden)``
      read along ``d``), recorded so that ``input_axes_nnx`` / ``input_axes_linen`` given the model's inputs return
      it. ``init`` conditions the parameter only when ``input_axes`` names it.

  Example (an NNX layer)::

    h = jnp.einsum('td,edh->eth', x, self.w_in[...])
    scsgd_jax.sow_rows(self, 'w_in', jnp.broadcast_to(x, (experts, *x.shape)), scsgd_jax.Layout((0,), stack=1))
  """
  cap = active_capture()
  if cap is None or cap.sow is None:
    return
  path = param_path(cap.path_of(module), param)
  if layout is not None:
    cap.layouts[path] = layout if isinstance(layout, layout_lib.Layout) else layout_lib.Layout(tuple(layout))
  if not cap.sow(module, param, jax.lax.stop_gradient(rows)):
    cap.plain(path, f"its module '{cap.path_of(module)}' runs inside a transform that drops the captured rows")


def layer_input(args, kwargs) -> tuple[Any, Optional[str]]:
  """``(input, einsum equation or None)`` of a Flax layer's call as the caller gave them (positionally or by name:
  ``inputs=``, ``einsum_str=``); the input is ``None`` where the call passes it otherwise."""
  x = args[0] if args else kwargs.get("inputs")
  equation = args[1] if len(args) > 1 and isinstance(args[1], str) else kwargs.get("einsum_str")
  return x, equation


# why a layer called without its input where the capture reads it is left plain
NO_INPUT = "its call passes the input neither first nor as inputs=, where the capture reads it"


@contextlib.contextmanager
def patched(stand_ins: dict):
  """Each ``{(class, method name): stand-in}`` set for the duration, every original put back after, however the
  block ends (an exception, ``KeyboardInterrupt``)."""
  _MISSING = object()
  saved = {(cls, name): cls.__dict__.get(name, _MISSING) for cls, name in stand_ins}
  try:
    for (cls, name), fn in stand_ins.items():
      setattr(cls, name, fn)
    yield
  finally:
    for (cls, name), orig in saved.items():
      if orig is _MISSING:
        delattr(cls, name)
      else:
        setattr(cls, name, orig)


def merge(rows_tuple, layout=None, max_rows=None, key=None):
  """A layer's rows of several calls as one array, within ``max_rows`` rows per step.

  Rows ``(..., m, n)`` join along ``m``, ids ``(..., m)`` along the last axis. Given the kernel's ``layout``, the
  axes between its lead (a stack's axes, a grouped conv's groups) and the rows (a recurrent cell's time steps, a
  layer called inside a scan) are folded into the rows first, and rows beyond ``max_rows`` (all calls together)
  are sampled uniformly with ``key``; an embedding keeps all its ids."""
  rows = tuple(rows_tuple)
  ids = jnp.issubdtype(rows[0].dtype, jnp.integer)
  if layout is not None:
    lead = layout.stack + (1 if layout.groups > 1 else 0)
    rows = tuple(r.reshape(r.shape[:lead] + ((-1,) if ids else (-1, r.shape[-1]))) for r in rows)
  joined = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=-1 if ids else -2)
  if ids or max_rows is None or layout is None or joined.shape[-2] <= max_rows:
    return joined
  if key is None:
    raise ValueError(f"sampling {max_rows} of {joined.shape[-2]} rows needs a PRNG key; pass rng=... to the "
                     "capture helper.")
  return jnp.take(joined, patches.uniform_indices(key, max_rows, joined.shape[-2]), axis=-2)


def merged(captured, layouts, max_rows, counter: "Counter") -> dict:
  """Every kernel's captured rows (``{..., 'kernel': (rows of each call, ...)}``) merged (:func:`merge`), each
  within ``max_rows`` per step, sampled with its own stream of the capture's key."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(captured, is_leaf=lambda v: isinstance(v, tuple))
  out = []
  for path, rows in flat:
    name = layout_lib.path_to_str(path)
    layout = layouts.get(name)
    out.append(merge(rows, layout if isinstance(layout, layout_lib.Layout) else None, max_rows, counter.key()))
  return jax.tree_util.tree_unflatten(treedef, out)


def layout(spec: LayerSpec, layer, full_ndim) -> layout_lib.Layout:
  """The :class:`~scsgd_jax._src.plan.Layout` of ``layer``'s kernel whose parameter has ``full_ndim`` axes
  (``None``: unknown): the axes beyond those the layer declares (:func:`own_ndim`) are a stack of layers."""
  stack = max(full_ndim - own_ndim(layer), 0) if full_ndim is not None else 0
  return layout_lib.Layout(spec.input_axes, stack, spec.groups)


class Reads:
  """Which kernels' layers read the same rows in one traced call of a model: per kernel, each call's input array
  and the axes its rows are made of (:class:`LayerSpec`'s ``contracts``)."""

  def __init__(self):
    self.calls: dict[str, list] = {}

  def __call__(self, path: str, spec: LayerSpec, x) -> None:
    contracts = None if spec.contracts is None else tuple(a % x.ndim for a in spec.contracts)
    self.calls.setdefault(path, []).append((x, contracts))

  def marked(self, layouts: dict) -> dict:
    """``layouts`` (``{param path: Layout or Plain}``) with each kernel whose layer read, call for call, the rows an
    earlier kernel's read (the same arrays, the same axes; one layout) marked ``Layout(reads=<that kernel>)``."""
    out, owners = dict(layouts), []
    same = lambda a, b: len(a) == len(b) and all(x is y and c == d for (x, c), (y, d) in zip(a, b))
    for path, calls in self.calls.items():
      layout = layouts.get(path)
      if not isinstance(layout, layout_lib.Layout) or any(c is None for _, c in calls):
        continue
      owner = next((o for o, o_calls in owners if same(o_calls, calls) and layouts[o] == layout), None)
      if owner is None:
        owners.append((path, calls))
      else:
        out[path] = layout._replace(reads=owner)
    return out


def param_path(name: str, param: str) -> str:
  """The path of a layer's parameter ``param`` (``'kernel'``, ``'embedding'``), as the transformation names it."""
  return f"{name}/{param}" if name else param


class Outputs:
  """What a capture does to each conditioned layer's output ``y``: with ``perturbations`` (``{kernel path:
  (rows, p)}``), adds them, the kernel's output axes of ``y`` moved last and flattened in the kernel's order
  (so their gradient is the rows of the back-propagated ``delta``); without, records their shapes and the
  kernel's output axes (:func:`output_perturbations_nnx`)."""

  def __init__(self, perturbations=None):
    self.perturbations = None if perturbations is None else flat(perturbations)
    self.shapes, self.axes, self.unconditioned = {}, {}, {}

  def __call__(self, path: str, spec: LayerSpec, y, layout: layout_lib.Layout):
    if spec.output_axes is None or spec.input_axes is None:
      return y
    if layout.stack or layout.groups > 1:
      self.unconditioned[path] = ("the output side does not condition a stacked (scanned, vmapped) or grouped "
                                  "kernel; its input side does")
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
    return CapturedInputs({p: jnp.zeros(s.shape, s.dtype) for p, s in self.shapes.items()}, self.axes,
                          self.unconditioned)


def flat(tree) -> dict:
  """``{'layer/kernel': leaf}``, named as the transformation names kernels (:func:`plan.path_to_str`)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {layout_lib.path_to_str(p): v for p, v in flat}
