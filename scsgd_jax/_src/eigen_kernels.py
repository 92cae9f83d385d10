r"""The eigenbasis' per-kernel pieces: what a kernel keeps (its zero moments, its share of the memory rule), the
gradient's rows for SOAP's basis, and the step of a kernel rotated on both sides, the moments carried into new
bases when a refresh moved them (:mod:`eigen_banks` takes the one-sided step a bank at a time, :mod:`eigen_math`
holds the arithmetic, :mod:`eigenbasis` the state and schedule).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import defaults
from scsgd_jax._src import eigen_math as em
from scsgd_jax._src import inputs
from scsgd_jax._src import output_rows as output_lib
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import sketch
from scsgd_jax._src import state as state_lib
from scsgd_jax._src import estimator as estimator_lib
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.eigen_math import EigenMoments
from scsgd_jax._src.eigen_math import Tail


class Step(NamedTuple):
  """One update's constants, alike for every kernel.

  Attributes:
    b2, eps: Adam's.
    correction: the second moment's bias correction ``1 - b2^t``.
    bound: Adam's bound on a coordinate's step (:func:`~scsgd_jax._src.eigen_math.adam_ratio_bound`).
    tail: the tail's treatment.
    late: the basis moves after this step's direction (the gradients' basis, SOAP's order), else before it.
  """

  b2: float
  correction: jax.Array
  eps: float
  bound: jax.Array
  tail: Tail
  late: bool


def rank(plan: plan_lib.KernelPlan) -> Optional[int]:
  """The basis' width ``k`` (``n`` for the full conditioner), or ``None`` for a diagonal kind."""
  if plan.kind in ("diagonal", "embedding"):
    return None
  return plan.n if plan.rank is None else plan.rank


def kept_beside(tail: Tail, side: str = "input"):
  """The memory rule's ``extra`` (:class:`~scsgd_jax._src.plan.Spec`'s): what the eigenbasis keeps for one
  ``(n, p)`` slice planned ``(kind, k)`` beside the statistics and factor, in place of Adam's second moment: the
  rotated second moment (``k p``), the tail's (``n + p``, one float, or none) and the rotation (``k^2``); on the
  output side (``sides='both'``) its rotation alone. ``None`` for the diagonal kinds: their basis is the coordinate
  one, so the kernel gets Adam itself and keeps no statistics."""

  def extra(kind: str, n: int, k: Optional[int], p: int) -> Optional[int]:
    if kind in ("diagonal", "embedding"):
      return None
    width = n if k is None else k
    if side == "output":
      return width * width
    return width * p + (0 if width == n else {"factored": n + p, "scalar": 1, "orthogonal": 0}[tail]) + width * width

  return extra


def fresh_moments(plan: plan_lib.KernelPlan, p: int, tail: Tail,
                  out: Optional[plan_lib.KernelPlan] = None) -> EigenMoments:
  """Zero moments of a kernel planned ``plan`` with ``p`` output columns; ``out``: its output side's plan when it
  is rotated on both sides (the lead is then ``k x k_out``, a tail kept if either side is sketched)."""
  k = rank(plan)
  k_out = None if out is None else (out.n if out.rank is None else out.rank)
  lead = jnp.zeros((plan.n if k is None else k, p if k_out is None else k_out), jnp.float32)
  no_tail = k is None or (k == plan.n and (out is None or k_out == out.n))
  if no_tail or tail == "orthogonal":
    moments = EigenMoments(lead, None, None)
  elif tail == "factored":
    moments = EigenMoments(lead, jnp.zeros((plan.n,), jnp.float32), jnp.zeros((p,), jnp.float32))
  else:
    moments = EigenMoments(lead, None, jnp.zeros((), jnp.float32))
  if plan.slices is None:
    return moments
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.slices,) + a.shape), moments)


def gradient_rows(updates, kernel_plans: dict[str, plan_lib.KernelPlan], input_axes=None) -> inputs.CapturedInputs:
  r"""Each planned kernel's gradient ``G`` (``(n, p)``) as ``p`` rows of its input space, ``G^\top``: the
  statistics fed with them keep the EMA of ``G G^\top / p``, Shampoo's and SOAP's left factor, in place of
  the inputs' ``C``. A diagonal kind (an embedding, whose basis is the coordinate one) gets no rows (its
  statistics stay as they are). ``input_axes``: the captured layouts, passed on."""
  flat = {layout_lib.path_to_str(p): g for p, g in jax.tree_util.tree_flatten_with_path(updates)[0]}
  rows = {}
  for path, plan in kernel_plans.items():
    lead = plan.stack + ((plan.groups,) if plan.groups > 1 else ())
    if plan.statistics.takes_ids:
      rows[path] = jnp.zeros(lead + (0,), jnp.int32)
      continue
    one = lambda g, plan=plan: sketch.kernel_matrix(g, plan.input_axes)[0].T
    g = jax.lax.stop_gradient(flat[path]).astype(jnp.float32)
    rows[path] = one(g) if plan.slices is None else jax.vmap(one)(plan.to_slices(g)).reshape(lead + (-1, plan.n))
  return inputs.CapturedInputs(rows, input_axes)


def _when(changed: jax.Array, f):
  """``f`` applied to its operand where ``changed``, the operand as it is elsewhere (one ``lax.cond``)."""
  return lambda operand: jax.lax.cond(changed, f, lambda o: o, operand)


def both_sides(plan: plan_lib.KernelPlan, g, m_hat, v: EigenMoments, r, r_out, old, new, old_out, new_out,
               c: Step, moved: jax.Array):
  """One kernel's step rotated on both sides, ``U^T M U_out`` (one layer): ``(direction, moments, rotation,
  output rotation)``; the factors before (``None``: afresh) and after this update's refresh on each side, as
  :func:`one_side`'s, both sides' bases moving together (:func:`~eigen_math.carried_both`) where the refresh rebuilt
  either (``moved``)."""
  q, q_out, rebase = new.q, new_out.q, None
  if old is not None:

    def rebase_both(operand):
      r, r_out, v = operand
      fresh, fresh_out = em.rotation(new), em.rotation(new_out)
      return fresh, fresh_out, em.carried_both(v, em.basis(new.q, fresh), em.basis(old.q, r),
                                               em.basis(new_out.q, fresh_out), em.basis(old_out.q, r_out))

    rebase = _when(moved, rebase_both)
    if c.late:
      q, q_out = old.q, old_out.q
    else:
      r, r_out, v = rebase((r, r_out, v))
  mm, restore = sketch.kernel_matrix(m_hat, plan.input_axes)
  gm, _ = sketch.kernel_matrix(g, plan.input_axes)
  direction, v = em.direction(q, r, mm, gm, v, c.b2, c.correction, c.eps, c.bound, c.tail, (q_out, r_out))
  if c.late and rebase is not None:
    r, r_out, v = rebase((r, r_out, v))
  return restore(direction), v, r, r_out


class Kernels:
  """Which kernels the eigenbasis rotates and on which sides, and what each keeps, from the conditioning's plans of
  a tree (cached per tree structure, as the plans are)."""

  def __init__(self, c: Conditioning, tail: Tail, sides: str, others: str, memory_share: float):
    self.c, self.tail, self.sides, self.others, self.memory_share = c, tail, sides, others, memory_share
    self.estimator = estimator_lib.Estimator(c, memory_share=memory_share, extra=kept_beside(tail), plain_step=(
        "they get Adam itself, in the coordinate basis (under scsgd_eigen: AdamW)" if others == "adam" else
        "their gradients pass on as they are to the rest of the chain (under scsgd_eigen_muon: Muon's AdamW part; "
        "a hidden kernel left plain by the memory rule is orthogonalized by Muon without a basis)"))
    self.plans = self.estimator.plans
    self.keep = c.kernels()
    self.output_side = functools.lru_cache(maxsize=None)(self._output_side)

  def on_output_side(self, path: str, leaf) -> bool:
    return self.keep(path, leaf) and output_lib.output_kernel_filter(path, leaf)

  def _output_side(self, rotatable: frozenset[str]):
    """The output side's estimator (output rows or the gradient's columns, along the output axes) of the kernels in
    ``rotatable``: no statistics, and no share of the memory, for a kernel it would never rotate."""
    chosen = lambda path, leaf: path in rotatable and self.on_output_side(path, leaf)
    return estimator_lib.Estimator(
        self.c.replace(seed=self.c.seed + 1, kernel_filter=chosen),
        layouts=output_lib.output_axes_from(self.c.input_axes), default_axes=output_lib.default_output_axes,
        memory_share=self.memory_share, extra=kept_beside(self.tail, "output"))

  def rotatable(self, tree) -> frozenset[str]:
    """The kernels of ``tree`` that init's plans rotate on the input side as one layer (a basis, unstacked,
    ungrouped)."""
    return frozenset(p for p, plan in self.plans(tree).items() if rank(plan) is not None and plan.slices is None)

  def output_of(self, tree):
    return self.output_side(self.rotatable(tree))

  def output_summary(self, tree, output_state):
    """``output_state`` whose plan summary says why the output side leaves a kernel to its input side alone."""
    alone = set(layout_lib.kernel_paths(tree, self.on_output_side)) - self.rotatable(tree)
    why = "no output side: rotated on its input side alone (a stack, feature groups, or no basis there)"
    return output_state._replace(plan=state_lib.PlanSummary(
        ((p, why if p in alone else d) for p, d in output_state.plan.items), output_state.plan.layouts))

  def both_sides(self, tree, kernel_plans) -> dict[str, plan_lib.KernelPlan]:
    """The output side's plans of the kernels rotated on both sides: one unstacked, ungrouped layer whose input
    side has a basis and whose output axes are the complement of its input axes (others: the input side alone)."""
    if self.sides != "both":
      return {}
    leaves = {layout_lib.path_to_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    out = {}
    for path, o in self.output_of(tree).plans(tree).items():
      plan = kernel_plans.get(path)
      if plan is None or rank(plan) is None or rank(o) is None or plan.slices is not None or o.slices is not None:
        continue
      ndim = leaves[path].ndim
      inputs = {a % ndim for a in plan.input_axes}
      if tuple(a % ndim for a in o.input_axes) == tuple(a for a in range(ndim) if a not in inputs):
        out[path] = o
    return out

  def adam_leaves(self, tree, kernel_plans) -> set[str]:
    """The leaves that get Adam itself: those not conditioned (with ``others='adam'``) and the kernels
    ``kernel_filter`` selects that the memory rule leaves unplanned (their basis would be the coordinate one)."""
    chosen = layout_lib.kernel_paths(tree, self.keep)
    return {p for p in map(layout_lib.path_to_str, (q for q, _ in jax.tree_util.tree_flatten_with_path(tree)[0]))
            if p not in kernel_plans and (self.others == "adam" or p in chosen)}

def zeros_at(params, paths: set[str]):
  """A moment shaped like ``params``: zeros at the leaves in ``paths``, ``optax.MaskedNode`` elsewhere."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.zeros_like(x) if layout_lib.path_to_str(p) in paths else optax.MaskedNode(), params)


def rotations_of(factors, kernel_plans):
  out = {}
  for path, plan in kernel_plans.items():
    if rank(plan) is not None:
      out[path] = em.rotation(factors[path]) if plan.slices is None else jax.vmap(em.rotation)(factors[path])
  return out


def output_update(k: Kernels, basis: str, updates, state, output_grads):
  """The output side's conditioning state after this update (its statistics fed with the captured output
  gradients, sampled, or with the gradient's columns), and which of its factors the refresh rebuilt."""
  out = k.output_of(updates)
  if basis == "gradients":
    rows = gradient_rows(updates, out.plans(updates))
  else:
    output_lib.check_output_grads(output_grads, "scale_by_eigenbasis_adam(sides='both', basis='inputs')",
                                  "; or basis='gradients' (no capture)")
    key = jax.random.fold_in(jax.random.PRNGKey(k.c.seed + 2), state.count)  # made here, never at construction
    rows = output_lib.sample_rows(output_grads, key, defaults.MAX_ROWS)
  output_state, _, rebuilt = out.update(updates, state.output, rows)
  return k.output_summary(updates, output_state), rebuilt
