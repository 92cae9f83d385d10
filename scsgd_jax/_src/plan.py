r"""Which kernels are conditioned, and how: the per-kernel plan and the memory rule.

Decided from the parameters' shapes and ``input_axes`` at ``init`` and fixed afterwards: an update whose
captured layers read a kernel by another layout is refused (:func:`check_layouts`). For each kernel: its input axes (so the kernel reads as the matrix ``(n, p)``), the
statistics kept for it and the conditioner's rank (:class:`KernelPlan`). Under ``Statistics(kind='auto')`` the choice follows the memory
rule: each kernel's options, best first (dense ``C``, streaming at ``rank``, at each smaller rank,
diagonal), each costing :func:`state_floats`; a kernel takes the best that fits in its own ``n * p``
floats (Adam's second moment), and with ``budget='model'`` the model's leftover floats then go to the
kernels of smallest ``n`` first, the same layer of each block alike (:func:`allot`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import statistics as stats_lib
from scsgd_jax._src.budget import allot, options, state_floats
from scsgd_jax._src.layout import InputAxes, Layout, is_embedding, kernel_paths, layout_of


class KernelPlan(NamedTuple):
  """How one kernel is conditioned (decided from its shape at ``init``).

  Attributes:
    input_axes: the axes of one slice's kernel contracted with the layer input.
    n: the input dimension (product of ``input_axes``).
    kind: ``'dense'``, ``'streaming'``, ``'diagonal'``, ``'embedding'`` or ``'custom'``.
    rank: the factor's rank; ``None`` for the full ``C^{1/2}``; ``0`` for diagonal kinds.
    statistics: the :class:`~scsgd_jax.sketch.CorrelationStatistics` kept for it.
    stack: the shape of the kernel's leading stack axes (``()``: one layer; see :class:`Layout`).
    groups: a grouped convolution's feature groups, each its own slice.
    reads: the kernel whose statistics and factors this one reads (its layer reads the same rows,
      :class:`~scsgd_jax.Layout`); ``None``: its own. Such a kernel takes that kernel's plan and keeps no
      statistics, factors or refresh of its own.
  """

  input_axes: tuple[int, ...]
  n: int
  kind: str
  rank: Optional[int]
  statistics: stats_lib.CorrelationStatistics
  stack: tuple[int, ...] = ()
  groups: int = 1
  reads: Optional[str] = None

  @property
  def slices(self) -> Optional[int]:
    """How many ``(n, p)`` problems the kernel holds (``None``: one, kept without a leading axis)."""
    return math.prod(self.stack) * self.groups if self.stack or self.groups > 1 else None

  def layout(self) -> Layout:
    return Layout(self.input_axes, len(self.stack), self.groups, self.reads)

  def to_slices(self, kernel: jax.Array) -> jax.Array:
    """A stacked or grouped ``kernel`` (the parameter's shape) as ``(slices, *one slice's kernel)``."""
    x = kernel.reshape((-1,) + kernel.shape[len(self.stack):])
    if self.groups > 1:  # (S, ..., cout) -> (S, g, ..., cout / g) -> (S * g, ..., cout / g)
      x = jnp.moveaxis(x.reshape(x.shape[:-1] + (self.groups, x.shape[-1] // self.groups)), -2, 1)
      x = x.reshape((-1,) + x.shape[2:])
    return x

  def from_slices(self, x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of :meth:`to_slices` for a parameter of ``shape``."""
    if self.groups > 1:
      x = jnp.moveaxis(x.reshape((-1, self.groups) + x.shape[1:]), 1, -2)
      x = x.reshape(x.shape[:-2] + (-1,))
    return x.reshape(shape)

  def below(self, asked_rank: int) -> bool:
    """Whether the plan's rank is below both ``asked_rank`` (the rank asked for) and ``n`` (the full ``C^{1/2}``
    and a diagonal say what they are)."""
    if self.kind in ("diagonal", "embedding") or self.rank is None:
      return False
    return self.rank < min(asked_rank, self.n)

  def describe(self, asked_rank: Optional[int] = None) -> str:
    """E.g. ``'dense C, full C^(1/2), n=25'`` or ``'streaming C Omega, rank 32, n=800'``; a rank below
    ``asked_rank`` (the rank asked for) says why: beyond the layer's ``n``, or cut by the memory rule."""
    kind = {
        "embedding": "token frequencies",
        "diagonal": "diagonal C",
        "streaming": f"streaming C Omega, rank {self.rank}",
        "dense": "dense C, full C^(1/2)" if self.rank is None else f"dense C, rank {self.rank}",
        "custom": "custom statistics, " + ("full C^(1/2)" if self.rank is None else f"rank {self.rank}"),
    }[self.kind]
    where = []
    if self.stack:
      where.append(f"per layer of a stack {self.stack}")
    if self.groups > 1:
      where.append(f"per group of {self.groups}")
    if self.reads is not None:
      where.append(f"statistics shared with {self.reads}")
    if asked_rank is not None and self.below(asked_rank):
      sketch_cap = self.rank == self.n - 1 and asked_rank >= self.n
      where.append(f"rank {asked_rank} asked: " + ("a sketch's rank is below n" if sketch_cap else
                                                     "cut by the memory rule"))
    return f"{kind}, n={self.n}" + (f", {' and '.join(where)}" if where else "")


class Spec(NamedTuple):
  """What decides the plans: a :class:`~scsgd_jax.Conditioning`'s settings as they run (resolved, checked), built by
  keyword in one place (the estimator's)."""

  rank: int
  full_max_dim: int
  oversample: int
  conditioner: str
  statistics: Union[str, stats_lib.CorrelationStatistics]
  budget: str
  kernel_filter: Callable[[str, Any], bool]
  layouts: InputAxes  # each kernel's layout as given (the input side: input_axes; the output side: its output axes)
  choices: "StatisticsChoices"
  default_axes: Callable[[str, Any], tuple[int, ...]] = None  # None: default_input_axes (the output side: its own)
  memory_share: float = 1.0  # the fraction of the memory rule's budget this transformation's statistics may take
  # A transformation built on the conditioning that keeps more per kernel (the eigenbasis' moments and rotation):
  # extra(kind, n, k, p) -> the floats it keeps for one (n, p) slice planned (kind, k) beside the statistics and
  # factor, counted by the memory rule, or None where that kind is of no use to it (the kernel is then not
  # planned). With it, the model's budget is its kernels' floats alone (its other leaves keep Adam's own).
  extra: Optional[Callable[[str, int, Optional[int], int], Optional[int]]] = None


class StatisticsChoices:
  """The statistics objects a plan may pick, built once per transformation (streaming: one per rank)."""

  def __init__(self, ema_rate, *, warm_start: bool, oversample: int, power_iterations: int, eigenvalue_floor):
    common = dict(identity_prior=not warm_start, eigenvalue_floor=eigenvalue_floor)
    self.dense = stats_lib.ema_correlation(ema_rate, oversample=oversample, power_iterations=power_iterations,
                                           **common)
    self.diagonal = stats_lib.diagonal_correlation(ema_rate, **common)
    self.ids = stats_lib.diagonal_correlation(ema_rate, takes_ids=True, **common)
    self.streaming = functools.lru_cache(maxsize=None)(
        lambda k: stats_lib.nystrom_correlation(k, ema_rate, oversample=oversample, **common))

  def of(self, kind: str, k: Optional[int]) -> stats_lib.CorrelationStatistics:
    return {"dense": self.dense, "diagonal": self.diagonal, "embedding": self.ids}.get(kind) or self.streaming(k)


# ------------------------------------------------------------------------------------------- plans


def _check_kernel_rank(path: str, n: int, k: int, spec: "Spec") -> None:
  """A rank-``k`` factor needs ``k < n``; the advice names what leads somewhere from ``spec``'s choices."""
  if k < n:
    return
  if spec.statistics == "streaming":
    advice = ("lower rank below n, or use Statistics(kind='auto') (the default: narrow kernels then get the dense "
              "C and the full C^(1/2)) or Statistics(kind='dense')")
  elif spec.conditioner == "sketched":
    advice = ("lower rank below n, or use Conditioner(kind='auto') (the default: the full C^(1/2) up to "
              "full_max_dim)")
  else:
    advice = f"lower rank below n, or raise Conditioner(full_max_dim=...) (now {spec.full_max_dim}) to at least n"
  raise ValueError(f"rank={k} must be < n={n}, the input dimension of kernel '{path}': {advice}.")


def _full(spec: Spec, n: int) -> bool:
  """Whether kernel of input dimension ``n`` gets the full ``C^{1/2}`` (else a rank-``k`` factor)."""
  return spec.conditioner == "full" or (spec.conditioner == "auto" and n <= spec.full_max_dim)


def _fixed(spec: Spec, path: str, n: int) -> Optional[tuple[str, Optional[int]]]:
  """``(kind, rank)`` of a kernel when ``statistics`` is not ``'auto'``; ``None`` under ``'auto'``."""
  full = _full(spec, n)
  if spec.conditioner == "sketched":
    _check_kernel_rank(path, n, spec.rank, spec)
  if isinstance(spec.statistics, stats_lib.CorrelationStatistics) or spec.statistics == "dense" or (
      spec.conditioner == "full" and spec.statistics != "diagonal"):
    if not full:
      _check_kernel_rank(path, n, spec.rank, spec)
    kind = "dense" if isinstance(spec.statistics, str) else "custom"
    return kind, None if full else spec.rank
  if spec.statistics == "diagonal":
    return "diagonal", 0
  if spec.statistics == "streaming":
    _check_kernel_rank(path, n, spec.rank, spec)
    return "streaming", spec.rank
  return None


def _slices(leaf, layout: Layout) -> int:
  return math.prod(leaf.shape[:layout.stack]) * layout.groups


def _input_dim(leaf, layout: Layout) -> int:
  return math.prod(leaf.shape[layout.stack + a] for a in layout.input_axes)


def make_plans(tree, spec: Spec, captured: Optional[Mapping[str, Any]] = None) -> dict[str, KernelPlan]:
  """The plan of every kernel of ``tree`` (arrays or shapes) that ``spec.kernel_filter`` selects
  (``captured``: the layouts the capture read from the layers, under ``spec.layouts``). A stacked or
  grouped kernel is planned per slice, its memory that of all its slices. A kernel whose layout ``reads`` another's
  statistics takes that kernel's plan; the memory rule plans the two as one statistic for both kernels' floats."""
  custom = isinstance(spec.statistics, stats_lib.CorrelationStatistics)
  decided: dict[str, tuple[str, Optional[int]]] = {}
  layouts, dims, shapes, opts, count, stacks, sizes = {}, {}, {}, {}, {}, {}, {}
  for path, leaf in kernel_paths(tree, spec.kernel_filter).items():
    layout = layout_of(path, leaf, spec.layouts, captured, spec.default_axes)
    if layout is None:
      continue
    layouts[path] = layout
    stacks[path] = tuple(leaf.shape[:layout.stack])
    dims[path] = _input_dim(leaf, layout)
    count[path] = _slices(leaf, layout)
    sizes[path] = leaf.size
  readers = _readers(layouts, dims, stacks)  # {owner: [kernels reading its statistics]}
  for path in layouts:
    if layouts[path].reads is not None:
      continue  # planned as the kernel it reads, below
    n, group = dims[path], [path, *readers.get(path, ())]
    width = lambda q: sizes[q] // (n * count[q])  # one slice's p
    if is_embedding(path) and not custom:
      if spec.extra is None or spec.extra("embedding", n, 0, width(path)) is not None:
        decided[path] = ("embedding", 0)
      continue
    fixed = _fixed(spec, path, n)
    if fixed is None:
      shapes[path] = (n, sum(sizes[q] for q in group) // n)  # the bound n * p of all slices of the group
      opts[path] = [o._replace(floats=(o.floats + sum(extras)) * count[path])
                    for o in options(n, spec.rank, spec.oversample, _full(spec, n))
                    for extras in [[0 if spec.extra is None else spec.extra(o.kind, n, o.rank, width(q)) for q in group]]
                    if None not in extras]
    else:
      decided[path] = fixed
  if opts:
    # budget='model': Adam's state beyond SGD's momentum, one float per parameter (with spec.extra: per parameter
    # of the kernels planned), less this state's scalars (count and key beyond Adam's count, a clipped-row
    # counter per kernel of its own statistics) and the embeddings' statistics. With share < 1 (two
    # transformations splitting the budget) this one gets that fraction of the floats.
    planned = lambda q: q in shapes or q in decided or layouts[q].reads in shapes or layouts[q].reads in decided
    pool = (sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree)) if spec.extra is None else
            sum(sizes[p] for p in sizes if planned(p)))
    floats = math.floor(spec.memory_share * pool) - 2 - (len(layouts) - sum(map(len, readers.values())))
    floats -= sum(count[p] * state_floats("embedding", dims[p], 0, 0)
                  for p, (kind, _) in decided.items() if kind == "embedding")
    # with spec.extra a kernel left unplanned keeps Adam's second moment: its share of the floats stays its own
    keeps = spec.extra is not None
    for path, i in allot(shapes, opts, floats, spec.budget, spec.memory_share, unplanned_keeps=keeps).items():
      if i < len(opts[path]):  # else nothing fits: plain SGD
        decided[path] = (opts[path][i].kind, opts[path][i].rank)
  for owner, group in readers.items():
    if owner in decided:
      decided.update((q, decided[owner]) for q in group)
  ordered = [p for p in layouts if p in decided]  # the tree's order
  return {
      path: KernelPlan(layouts[path].input_axes, dims[path], kind, k,
                       spec.statistics if kind == "custom" else spec.choices.of(kind, k),
                       stacks[path], layouts[path].groups, layouts[path].reads)
      for path, (kind, k) in ((p, decided[p]) for p in ordered)
  }


def own_statistics(kernel_plans: Mapping[str, KernelPlan]) -> dict[str, KernelPlan]:
  """The plans of the kernels that keep statistics and factors of their own (not those that read another's)."""
  return {p: plan for p, plan in kernel_plans.items() if plan.reads is None}


def _readers(layouts: Mapping[str, Layout], dims, stacks) -> dict[str, list[str]]:
  """``{kernel: [the kernels whose layout reads its statistics]}``, each pair checked: the kernel read is conditioned
  here, reads its own statistics, and has the reader's input dimension, stack and feature groups."""
  out: dict[str, list[str]] = {}
  for path, layout in layouts.items():
    owner = layout.reads
    if owner is None:
      continue
    if owner not in layouts:
      raise ValueError(f"kernel '{path}' reads the statistics of '{owner}' (Layout(reads=...)), which is not a "
                       f"conditioned kernel of these parameters; the conditioned kernels: {sorted(layouts)}.")
    other = layouts[owner]
    if other.reads is not None or (dims[owner], stacks[owner], other.groups) != (dims[path], stacks[path],
                                                                                 layout.groups):
      raise ValueError(
          f"kernel '{path}' (n={dims[path]}, stack {stacks[path]}, {layout.groups} groups) cannot read the "
          f"statistics of '{owner}' (n={dims[owner]}, stack {stacks[owner]}, {other.groups} groups"
          + (f", itself reading '{other.reads}'" if other.reads is not None else "")
          + "): a kernel read by others keeps its own statistics, of the same input dimension, stack and groups.")
    out.setdefault(owner, []).append(path)
  return out


def slice_phases(kernel_plans: Mapping[str, KernelPlan], update_every: int, stagger: bool) -> dict[str, np.ndarray]:
  """Each kernel's slices' refresh phases: with ``stagger``, the slices of all kernels (a lone kernel is one)
  spread evenly over the window in the plans' order, else all at phase 0."""
  total = sum(plan.slices or 1 for plan in kernel_plans.values())
  out, start = {}, 0
  for path, plan in kernel_plans.items():
    size = plan.slices or 1
    out[path] = np.array([(i * update_every) // total if stagger else 0 for i in range(start, start + size)])
    start += size
  return out


def misread(planned: dict[str, KernelPlan], tree, spec: Spec, captured: Mapping[str, Any]) -> dict[str, str]:
  """``{path: how}`` of the kernels whose layers read them by another layout (input axes, a stack, feature groups)
  than ``init`` planned from the parameters alone."""
  leaves = kernel_paths(tree, spec.kernel_filter)
  wrong = {}
  for path, plan in planned.items():
    layout = layout_of(path, leaves[path], spec.layouts, captured, spec.default_axes)
    if layout != plan.layout():
      wrong[path] = (f"{tuple(leaves[path].shape)} read as {layout} (n={_input_dim(leaves[path], layout)}), planned "
                     f"as {plan.layout()} (n={plan.n})")
  return wrong


def check_layouts(planned: dict[str, KernelPlan], tree, spec: Spec, captured: Mapping[str, Any],
                  helper: str) -> dict[str, str]:
  """The kernels whose layers read them by another layout than ``init`` planned (:func:`misread`): the plans, and
  so the state's shapes, are fixed at ``init``. Without ``input_axes`` (``init`` could only guess an Einsum's or a
  DenseGeneral's layout from its shape) they are returned, to be stepped plainly; with it (the layers contradict
  what it says) they are refused. The fix, named in the error: ``input_axes``, which ``init`` reads."""
  wrong = misread(planned, tree, spec, captured)
  if wrong and spec.layouts is not None:
    raise ValueError(
        "the layers read these kernels by another layout than init planned from input_axes (plans, and the state's "
        "shapes, are fixed at init): " + "; ".join(f"'{p}' {how}" for p, how in wrong.items())
        + f". Set input_axes={helper} in the optimizer's scsgd_jax.Conditioning, so that init plans each kernel by "
        "its layer's layout.")
  return wrong
