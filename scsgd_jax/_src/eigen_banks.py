"""The eigenbasis by bank: kernels alike (one bank of the conditioning, one shape and layout) keep their rotated
moments and rotations stacked (:class:`~scsgd_jax._src.banks.Banked`) and take their step as one computation over
the bank: the direction batched over the members, the moments carried into a rebuilt basis by one loop over the
members whose factor the refresh changed. The update's program grows with the model's kinds of kernels, not with
its depth (:mod:`eigen_kernels` holds a kernel's pieces, :mod:`eigen_math` the arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scsgd_jax._src import eigen_kernels as ek
from scsgd_jax._src import eigen_math as em
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import sketch
from scsgd_jax._src import state as state_lib
from scsgd_jax._src.banks import Bank
from scsgd_jax._src.banks import BankIndex
from scsgd_jax._src.banks import Banked
from scsgd_jax._src.eigen_math import EigenMoments


def index(tree, kernel_plans, two) -> BankIndex:
  """The eigenbasis' banks of ``tree``'s conditioned kernels: those of one conditioning bank with one shape and
  layout (their steps run in float32 whatever their dtype, so a bank's are read from the parameters at ``init`` and
  from the gradients at an update alike); a kernel rotated on both sides (``two``) alone."""
  leaves = {layout_lib.path_to_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

  def alike(path):
    plan = kernel_plans[path]
    return (tuple(np.shape(leaves[path])), tuple(plan.input_axes), plan.stack, plan.groups,
            path if path in two else None)

  return BankIndex.of(kernel_plans, alike)


def rotation_index(moments_index: BankIndex, kernel_plans) -> BankIndex:
  """The banks that keep a rotation: all but the diagonal kinds' (their basis is the coordinate one)."""
  return BankIndex(tuple(b for b in moments_index.banks if ek.rank(kernel_plans[b.paths[0]]) is not None))


def fresh(params, kernel_plans, two, tail) -> Banked:
  """Each conditioned kernel's zero moments in its rotated coordinates (:func:`~eigen_kernels.fresh_moments`),
  in banks."""
  leaves = {layout_lib.path_to_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  moments = {path: ek.fresh_moments(plan, np.size(leaves[path]) // (plan.n * (plan.slices or 1)), tail,
                                    two.get(path)) for path, plan in kernel_plans.items()}
  return Banked.of(index(params, kernel_plans, two), moments)


def rotations(factors: Banked, kernel_plans, moments_index: BankIndex) -> Banked:
  """Each rotated kernel's ``V`` of its factor (:func:`~eigen_kernels.rotations_of`), in banks."""
  rindex = rotation_index(moments_index, kernel_plans)
  return Banked.of(rindex, ek.rotations_of({p: factors[p] for p in rindex.paths},
                                           {p: kernel_plans[p] for p in rindex.paths}))


def checked(state, updates, kernel_plans, two, tail) -> None:
  """Refuses moments and rotations not in the banks, or not of the shapes, the plans (fixed at ``init``) keep: a
  checkpoint of another plan or of an earlier version, naming a kernel."""
  expected = jax.eval_shape(lambda: fresh(updates, kernel_plans, two, tail))
  for name, got in (("moments", state.moments), ("rotations", state.rotations)):
    if not isinstance(got, Banked):
      raise TypeError(
          f"scale_by_eigenbasis_adam's state.{name} is a {type(got).__name__}, not the banks this version keeps "
          "(a checkpoint of an earlier version, or one restored without its target's types): restore checkpoints "
          "into the state of tx.init(params) of the same optimizer and scsgd_jax version.")
  want = (expected.index, rotation_index(expected.index, kernel_plans))
  for got, index_, banks in ((state.moments, want[0], expected.banks), (state.rotations, want[1], None)):
    if got.index != index_ or (banks is not None and not all(
        state_lib.same_shapes(a, b) for a, b in zip(got.banks, banks))):
      mismatch = next((p for p in index_.paths if p not in got.index.paths), index_.paths[0] if index_.paths else "")
      raise ValueError(
          f"scale_by_eigenbasis_adam's moments of kernel '{mismatch}' are not kept as its plan keeps them: the state "
          "comes from another plan or an earlier version of the state. Restore checkpoints into the state of "
          "tx.init(params) of the same optimizer and scsgd_jax version.")


def members(tree, bank: Bank):
  """A bank's stored ``tree`` member by member: a leading axis of the bank's members (its members share a shape)."""
  if all(bank.lone):
    return tree
  return jax.tree.map(lambda a: a.reshape((len(bank.paths), bank.sizes[0]) + a.shape[1:]), tree)


def stored(tree, bank: Bank):
  """The inverse of :func:`members`."""
  if all(bank.lone):
    return tree
  return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tree)


def gathered(banked: Banked, bank: Bank):
  """The factors of ``bank``'s members, which one bank of ``banked`` holds, member by member (:func:`members`):
  that bank itself where it holds them alone and in order, else its members' slices gathered."""
  places = [banked.index.place(p) for p in bank.paths]
  i, size = places[0][0], bank.sizes[0]
  whole = banked.banks[i]
  starts = [start for _, start, _, _ in places]
  if starts != list(range(0, size * len(starts), size)) or size * len(starts) != sum(banked.index.banks[i].sizes):
    picks = np.concatenate([np.arange(s, s + size) for s in starts])
    whole = jax.tree.map(lambda a: a[picks], whole)
  return members(whole, bank)


def _rebased_one(plan, r, v, old, new):
  """One member's rotation and moments carried into its new factor's basis, each slice of a stack in its own."""

  def one_slice(r, v, old, new):
    fresh_r = em.rotation(new)
    return fresh_r, em.carried(v, em.basis(new.q, fresh_r), em.basis(old.q, r))

  return (one_slice if plan.slices is None else jax.vmap(one_slice))(r, v, old, new)


def _rebased(plan, r, v, old, new, moved):
  """``(r, v)`` of every member whose factor ``moved``, carried into its new basis: one loop over the members (one
  or a few move at a step with a staggered refresh), run only when one moved."""
  pick = lambda tree, j: jax.tree.map(lambda a: a[j], tree)
  put = lambda tree, j, x: jax.tree.map(lambda a, b: a.at[j].set(b), tree, x)

  def body(j, rv):
    def renew(rv):
      r_j, v_j = _rebased_one(plan, pick(rv[0], j), pick(rv[1], j), pick(old, j), pick(new, j))
      return put(rv[0], j, r_j), put(rv[1], j, v_j)

    return jax.lax.cond(moved[j], renew, lambda rv: rv, rv)

  if moved.shape[0] == 1:  # a bank of one: its carry, when it moved (no loop to compile)
    return body(0, (r, v))
  loop = lambda rv: jax.lax.fori_loop(0, moved.shape[0], body, rv)
  return jax.lax.cond(jnp.any(moved), loop, lambda rv: rv, (r, v))


def one_side(plan, g, m_hat, v: EigenMoments, r, old, new, c: ek.Step, moved: jax.Array):
  """A bank's step in its members' input-side bases ``U = Q V`` (every argument member by member along a leading
  axis; ``r``: ``V``, ``None`` for a diagonal kind, the coordinate basis), each slice of a stack in its own:
  ``(direction, moments, rotation)``. ``old``, ``new``: the factors before and after this update's refresh; where
  the refresh rebuilt a member's (``moved``, per member), its basis moves to ``new``'s and its moments are carried
  into it
  (:func:`~eigen_math.carried`): before the direction, or after it for the gradients' basis (``c.late``)."""
  q = None
  if r is not None:
    q = old.q if c.late else new.q
    if not c.late:
      r, v = _rebased(plan, r, v, old, new, moved)

  def one(q, r, m_slice, g_slice, moments):
    mm, restore = sketch.kernel_matrix(m_slice, plan.input_axes)
    gm, _ = sketch.kernel_matrix(g_slice, plan.input_axes)
    direction, moments = em.direction(q, r, mm, gm, moments, c.b2, c.correction, c.eps, c.bound, c.tail)
    return restore(direction), moments

  def member(q, r, m_hat, g, v):
    if plan.slices is None:
      return one(q, r, m_hat, g, v)
    direction, v = jax.vmap(one)(q, r, plan.to_slices(m_hat), plan.to_slices(g), v)
    return plan.from_slices(direction, g.shape), v

  direction, v = jax.vmap(member)(q, r, m_hat, g, v)
  if r is not None and c.late:
    r, v = _rebased(plan, r, v, old, new, moved)
  return direction, v, r
