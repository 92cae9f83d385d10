"""Banks: kernels alike (one kind of statistics, ``n`` and rank) whose statistics and factors are stored stacked, so
that their fold and refresh run as one computation over the bank and a model's programs grow with its kinds of
kernels, not with its depth.

A conditioning state keeps ``{kernel path: tree}`` as :class:`Banked`: one stacked tree per bank (its members'
slices along a leading axis; a kernel of one slice takes one place), read per kernel as a mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Hashable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def key(plan) -> tuple:
  """What kernels of one bank share: the kind of statistics and their object, ``n``, the rank, and whether they are
  stacks (a stack's slices keep their stack axis' sharding in a bank of stacks)."""
  return (plan.kind, plan.n, plan.rank, id(plan.statistics), plan.slices is None)


def grouped(kernel_plans, extra: Callable[[str], Hashable] = lambda path: ()) -> list[list[str]]:
  """The kernels' paths by bank, in the plans' order (``extra(path)``: what else members must share, e.g. the shape
  of the rows they fold)."""
  out: dict[tuple, list[str]] = {}
  for path, plan in kernel_plans.items():
    out.setdefault(key(plan) + (extra(path),), []).append(path)
  return list(out.values())


class Bank(NamedTuple):
  """One bank's members: their paths, each one's number of slices, and which keep one slice without a leading axis
  (``lone``: one layer, stored as one place of the bank)."""

  paths: tuple[str, ...]
  sizes: tuple[int, ...]
  lone: tuple[bool, ...]

  def starts(self) -> tuple[int, ...]:
    out, start = [], 0
    for size in self.sizes:
      out.append(start)
      start += size
    return tuple(out)


class BankIndex(NamedTuple):
  """Where each kernel's slices are stored: the banks in order, and the kernels that read another's (``aliases``:
  ``((kernel, the kernel whose entry it reads), ...)``, stored once, under the kernel read). Static: compared by
  value."""

  banks: tuple[Bank, ...]
  aliases: tuple[tuple[str, str], ...] = ()

  @classmethod
  def of(cls, kernel_plans, extra: Callable[[str], Hashable] = lambda path: (), aliases=()) -> "BankIndex":
    """The banks of ``kernel_plans`` (:func:`grouped`, ``extra`` as its), in the plans' order; ``aliases`` as the
    field's (their kernels not among ``kernel_plans``)."""
    return cls(tuple(Bank(tuple(paths), tuple(kernel_plans[p].slices or 1 for p in paths),
                          tuple(kernel_plans[p].slices is None for p in paths))
                     for paths in grouped(kernel_plans, extra)), tuple(aliases))

  def per_kernel(self) -> "BankIndex":
    """The same banks with one place per kernel (a stack's slices together), its aliases left out: where the
    state keeps a kernel's count (the rows the outlier guard clipped), not a slice's."""
    return BankIndex(tuple(Bank(b.paths, (1,) * len(b.paths), (True,) * len(b.paths)) for b in self.banks))

  @property
  def paths(self) -> tuple[str, ...]:
    """Every kernel's path: the banks' members, then the aliases."""
    return tuple(p for bank in self.banks for p in bank.paths) + tuple(p for p, _ in self.aliases)

  def read(self, path: str) -> str:
    """The kernel whose entry kernel ``path`` reads: its own path, or an alias' kernel read."""
    return dict(self.aliases).get(path, path)

  def place(self, path: str) -> tuple[int, int, int, bool]:
    """``(bank, first slice, slices, lone)`` of kernel ``path`` (an alias: of the kernel it reads)."""
    path = self.read(path)
    for i, bank in enumerate(self.banks):
      if path in bank.paths:
        j = bank.paths.index(path)
        return i, bank.starts()[j], bank.sizes[j], bank.lone[j]
    raise KeyError(path)


def stacked(trees, lone):
  """``trees`` (one per kernel) as one tree of stacked slices: ``lone[i]`` marks a kernel of one slice kept without
  a leading axis (it gets one); the others already lead with their slices."""
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *[jax.tree.map(lambda a: a[None], t) if l else t
                                                         for t, l in zip(trees, lone)])


def unstacked(tree, sizes, lone):
  """The inverse of :func:`stacked`: one tree per kernel of ``sizes`` slices."""
  out, start = [], 0
  for size, l in zip(sizes, lone):
    out.append(member(tree, start, size, l))
    start += size
  return out


def member(tree, start: int, size: int, lone: bool):
  """The slices ``start:start + size`` of a bank's stacked ``tree`` (``lone``: the one slice, without its axis);
  shapes alone where the bank holds shapes (``jax.eval_shape``), a member's sharding where it holds shardings
  (:func:`scsgd_jax.state_shardings`)."""
  def one(a):
    if isinstance(a, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(a.shape[1:] if lone else (size,) + a.shape[1:], a.dtype)
    if isinstance(a, PartitionSpec):
      return PartitionSpec(*a[1:]) if lone else a
    if isinstance(a, NamedSharding):
      return NamedSharding(a.mesh, one(a.spec))
    return a[start] if lone else a[start:start + size]

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


@jax.tree_util.register_pytree_with_keys_class
class Banked(Mapping):
  """``{kernel path: tree}`` stored as banks (:class:`BankIndex`): the leaves are the banks' stacked trees, so the
  state's arrays, shardings and checkpoints are per bank; reading a kernel (``banked[path]``) slices its bank."""

  def __init__(self, index: BankIndex, banks):
    self.index, self.banks = index, tuple(banks)

  @classmethod
  def of(cls, index: BankIndex, trees: Mapping) -> "Banked":
    """``trees`` (``{kernel path: tree}``) stacked into ``index``'s banks."""
    return cls(index, [stacked([trees[p] for p in bank.paths], bank.lone) for bank in index.banks])

  def __getitem__(self, path: str):
    i, start, size, lone = self.index.place(path)
    return member(self.banks[i], start, size, lone)

  def __iter__(self):
    return iter(self.index.paths)

  def __len__(self) -> int:
    return len(self.index.paths)

  def __eq__(self, other):
    """As a dict's: per bank against another :class:`Banked` (e.g. two trees of shapes), else per kernel."""
    if isinstance(other, Banked):
      return self.index == other.index and self.banks == other.banks
    return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

  __hash__ = None  # as a dict's

  def __repr__(self) -> str:
    return f"Banked({len(self.index.banks)} banks of {list(self.index.paths)})"

  def tree_flatten_with_keys(self):
    return [(jax.tree_util.DictKey(f"bank{i}"), bank) for i, bank in enumerate(self.banks)], self.index

  @classmethod
  def tree_unflatten(cls, index, banks):
    return cls(index, banks)


# flax.serialization (msgpack checkpoints, a Linen TrainState's to_bytes): the banks by name, restored into the
# target's index. Registered where Flax is installed: the optax core needs no Flax.
try:
  from flax import serialization
except ImportError:  # pragma: no cover - Flax is a dependency of the capture modules only
  serialization = None
if serialization is not None:
  serialization.register_serialization_state(
      Banked, lambda b: {f"bank{i}": serialization.to_state_dict(t) for i, t in enumerate(b.banks)},
      lambda target, state: Banked(target.index, [serialization.from_state_dict(t, state[f"bank{i}"])
                                                  for i, t in enumerate(target.banks)]))
