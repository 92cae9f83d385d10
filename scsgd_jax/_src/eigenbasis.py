r"""Adam in the sketched conditioner's eigenbasis (EKFAC's input side; SOAP's rotation, sketched).

For a kernel read as ``(n, p)`` whose input correlation ``C`` the conditioning keeps, the refresh gives an
orthonormal ``U`` (``n x k``): the eigenvectors of ``C``'s sketch (``Q V`` with ``Q^T C Q = V \Lambda V^T``), or of
the full ``C`` (``k = n``). Adam's second moment is kept for the rotated gradient ``U^T G`` (``k x p``), and a
cheap one for the tail ``G - U U^T G`` that the sketch leaves out (Adafactor's factored row and column moments,
or one scalar as Sketchy); the update is Adam's, taken in those coordinates and rotated back. Leaves the
conditioning does not read (biases, norms, and the diagonal kinds: embeddings, whose eigenbasis is the
coordinate one) get Adam itself.

The memory rule (``statistics='auto'``) counts everything the eigenbasis keeps per kernel in place of Adam's
second moment (statistics, factor, rotated moments, tail, rotation) against that moment's floats, so the state
stays within Adam's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import inputs
from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import options
from scsgd_jax._src import eigen_math as em
from scsgd_jax._src import output as output_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import sketch
from scsgd_jax._src import state as state_lib
from scsgd_jax._src import transform
from scsgd_jax._src.eigen_math import EigenMoments
from scsgd_jax._src.eigen_math import Tail
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = ["ScaleByEigenbasisAdamState", "scale_by_eigenbasis_adam"]

Basis = Literal["inputs", "gradients"]
Sides = Literal["input", "both"]
# the Conditioner's settings that move only the conditioner's eigenvalues: the eigenbasis reads its eigenvectors alone
_NO_EFFECT = ("eigenvalue_floor", "normalize")


class ScaleByEigenbasisAdamState(NamedTuple):
  """State of :func:`scale_by_eigenbasis_adam`.

  Attributes:
    conditioning: the conditioning's state (statistics, factors, and the count of updates applied so far, which
      Adam's bias correction reads: :class:`ScaleBySketchedConditioningState`).
    mu: Adam's first moment, in the parameters' own coordinates (a tree like the parameters).
    nu: Adam's second moment of the leaves that get Adam itself (a tree like the parameters, each leaf shaped
      like its parameter; ``optax.MaskedNode`` at the conditioned kernels and the leaves passed through).
    moments: ``{kernel path: EigenMoments}``, each conditioned kernel's second moment in its rotated
      coordinates. Kept apart from ``nu`` so that every leaf of a parameter-shaped tree has its parameter's
      shape: Flax's ``nnx.Optimizer`` wraps such a leaf in its parameter's variable (its sharding annotation
      included) and would turn a tuple there into a dict.
    rotations: ``{kernel path: V}``, the eigenbasis in use as a rotation of the conditioning's factor: ``U = Q V``
      (``V`` is ``k x k``; for a dense factor ``U = V``, ``n x n``), a leading axis per slice of a stack; none for a
      diagonal kind (the coordinate basis). Kept instead of ``U`` so the state does not hold ``Q`` twice.
    output: with ``sides='both'``, the output side's conditioning state (the statistics of the captured output
      gradients or of the gradient's columns, read along each kernel's output axes); else ``None``.
    output_rotations: with ``sides='both'``, ``{kernel path: V_out}`` of the kernels rotated on both sides
      (``U_out = Q_out V_out``, ``p x k``); else ``None``.
  """

  conditioning: ScaleBySketchedConditioningState
  mu: optax.Updates
  nu: optax.Updates
  moments: dict[str, EigenMoments]
  rotations: dict[str, jax.Array]
  output: Optional[ScaleBySketchedConditioningState] = None
  output_rotations: Optional[dict[str, jax.Array]] = None

  @property
  def count(self) -> jax.Array:
    """Updates applied so far (``int32``): the conditioning's count, the one counter the state keeps."""
    return self.conditioning.count

  def summary(self) -> dict[str, str]:
    """How each kernel is conditioned (the conditioning's :meth:`~ScaleBySketchedConditioningState.summary`)."""
    return self.conditioning.summary()


def _rank(plan: plan_lib.KernelPlan) -> Optional[int]:
  """The basis' width ``k`` (``n`` for the full conditioner), or ``None`` for a diagonal kind."""
  if plan.kind in ("diagonal", "embedding"):
    return None
  return plan.n if plan.rank is None else plan.rank


def _kept_beside(tail: Tail, side: str = "input"):
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


def _fresh_moments(plan: plan_lib.KernelPlan, p: int, tail: Tail,
                   out: Optional[plan_lib.KernelPlan] = None) -> EigenMoments:
  """Zero moments of a kernel planned ``plan`` with ``p`` output columns; ``out``: its output side's plan when it
  is rotated on both sides (the lead is then ``k x k_out``, a tail kept if either side is sketched)."""
  k = _rank(plan)
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
  flat = {plan_lib.path_to_str(p): g for p, g in jax.tree_util.tree_flatten_with_path(updates)[0]}
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


def _differs(old, new) -> jax.Array:
  """Whether two factors (trees of arrays, one structure) differ anywhere: a refresh changed the basis."""
  return jnp.any(jnp.stack([jnp.any(a != b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))]))


def _checked_moments(moments) -> dict[str, EigenMoments]:
  """The state's ``moments``, each an :class:`EigenMoments` (a checkpoint restored without its target's types
  would hold dicts: refused, naming the kernel)."""
  for path, m in moments.items():
    if not isinstance(m, EigenMoments):
      raise TypeError(f"scale_by_eigenbasis_adam's state.moments[{path!r}] is a {type(m).__name__}, not an "
                      "EigenMoments: restore a checkpoint into the state of tx.init(params) (its target), which "
                      "keeps the state's types.")
  return dict(moments)


def scale_by_eigenbasis_adam(
    rank: Optional[int] = None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    nesterov: bool = False,
    tail: Tail = "factored",
    basis: Basis = "inputs",
    sides: Sides = "input",
    others: Literal["adam", "identity"] = "adam",
    memory_share: float = 1.0,
    statistics: options.StatisticsOption = options.Statistics(),
    refresh: options.Refresh = options.Refresh(),
    conditioner: options.Conditioner = options.Conditioner(),
    kernel_filter: Optional[Callable[[str, Any], bool]] = None,
    input_axes: plan_lib.InputAxes = None,
    axis_name: Optional[Hashable] = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam in the eigenbasis of each kernel's sketched input conditioner (one-sided EKFAC / SOAP, sketched).

  The conditioning (:func:`scale_by_sketched_conditioning`, whose arguments it takes) keeps each
  kernel's input statistics and refreshes its factor ``A^{-1} = Q B^{-1} Q^\top + a^{-1}(I - QQ^\top)``; at each
  refresh the kernel's basis becomes ``U = Q V`` (:func:`eigenbasis`) and Adam's second moment is carried into it
  (:func:`carried`: SOAP re-projects its moments likewise). Every step, with ``G`` the gradient read as
  ``(n, p)`` and ``M`` Adam's first moment (kept in the parameters' coordinates, bias-corrected):

  .. math::

    \text{update} = U \frac{U^\top M}{\sqrt{v} + \epsilon} + \frac{M - U U^\top M}{\sqrt{v_\perp} + \epsilon},
    \quad v \leftarrow \beta_2 v + (1 - \beta_2) (U^\top G)^{\circ 2}

  (bias-corrected), with ``v_perp`` the tail's second moment: ``'factored'`` (Adafactor's row and column moments of
  ``(G - U U^\top G)^{\circ 2}``, ``O(n + p)`` floats) or ``'scalar'`` (one float, as Sketchy); or, with
  ``tail='orthogonal'`` (COSMOS's split: Adam on the leading subspace, Muon on the rest), the tail's first moment
  is orthogonalized instead (:func:`orthogonalize`, at ``0.2 sqrt(max(n, p))``, AdamW's typical RMS) and keeps no
  second moment. With the full conditioner (``k = n``) there is no tail: Adam in the full eigenbasis of ``C``
  (EKFAC's input side). Other leaves, and the diagonal kinds (embeddings: token frequencies), get Adam.

  ``basis='gradients'`` builds ``U`` from the EMA of the gradient's own Gram matrix ``G G^\top / p``
  (:func:`gradient_rows`; Shampoo's and SOAP's left factor) instead of the inputs' ``C`` (EKFAC's): the same
  statistics, sketch and refresh, fed with the rows of ``G^\top``, so no capture is needed (``layer_inputs`` is
  read only for its layouts). ``sides='both'`` rotates on the output side too, by the eigenbasis ``U_out``
  (``p x k``) of an EMA kept alike (each kernel read along its output axes): of the captured output gradients'
  correlation ``Delta`` with the inputs' basis (EKFAC's two factors; ``update`` then takes ``output_grads=`` as
  :func:`scsgd_two_sided` does), of ``G^\top G / n`` with the gradients' (SOAP's). Adam's second moment is
  kept for ``U^\top G U_out`` (``k x k``), the tail is everything outside that block, and the moments are
  carried by both sides' overlaps; at full rank on both sides it is EKFAC or SOAP. A
  stacked or grouped kernel, one whose input side has no basis, or one whose output side has none, is rotated on
  its input side alone; the output side keeps statistics only for the kernels whose input side init plans with a
  basis as one layer (pass ``input_axes`` for a layout init cannot read from the parameters, such as a scanned
  stack). The two sides split ``memory_share``.

  Cost: ``U = Q V`` formed (``n k^2``) and five ``(k x n) (n x p)`` products a step per kernel (two into the basis,
  three back; three at ``k = n``: ``O(n k p)``, the conditioning's own order), and
  an ``eigh`` of ``k x k`` per refresh. State: Adam's first moment (``n p``), the rotated second moment
  (``k p``), the tail (``n + p``), the basis as a rotation of the factor's ``Q`` (``k^2``), the conditioning's
  factor and statistics. Under ``statistics='auto'`` the memory rule counts all but the first moment against
  ``memory_share`` of Adam's second moment (per kernel, or over the kernels with ``budget='model'``): each kernel
  gets the best statistics and rank that fit, so the state is at most Adam's. A kernel whose only fit would be
  diagonal statistics (a coordinate basis) gets Adam itself, keeping no statistics.

  ``update`` takes ``layer_inputs=`` as :func:`scale_by_sketched_conditioning` does.

  Args:
    rank: sketch rank ``k`` (default 32).
    b1, b2, eps: Adam's.
    nesterov: Nesterov's form of Adam's first moment (NAdam's).
    tail: the tail's treatment: ``'factored'`` or ``'scalar'`` second moments, or ``'orthogonal'``.
    basis: whose statistics give the basis: ``'inputs'`` (the layer's inputs, EKFAC's) or ``'gradients'``
      (the gradient's rows, SOAP's).
    sides: ``'input'`` or ``'both'`` (both factors: EKFAC's with the inputs' basis, SOAP's with the gradients').
    others: what the leaves it does not condition get: ``'adam'``, or ``'identity'`` (passed through, no state:
      for a chain whose next transformation treats them, e.g. Muon's orthogonalization of the conditioned
      kernels, the kernels chosen by ``kernel_filter``, with its AdamW part for the rest).
    memory_share: the share of Adam's second moment that the statistics, factor, rotated moments and rotation
      may take (``statistics='auto'``; with ``sides='both'`` the two sides split it).
    statistics, refresh, kernel_filter, input_axes, axis_name, seed: the conditioning's
      (:func:`scale_by_sketched_conditioning`).
    conditioner: the conditioning's :class:`Conditioner`; only its ``kind`` and ``full_max_dim`` act here (the
      eigenbasis reads the factor's eigenvectors, which its floor and normalization leave as they are).

  References:
    George et al., Fast Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis (EKFAC), 2018.
    Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam, 2024.
    Liu et al., COSMOS: A Hybrid Adaptive Optimizer for Memory-Efficient Training of LLMs, 2025.
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, 2015.
  """
  if tail not in ("factored", "scalar", "orthogonal"):
    raise ValueError(f"tail must be 'factored', 'scalar' or 'orthogonal', got {tail!r}.")
  if basis not in ("inputs", "gradients"):
    raise ValueError(f"basis must be 'inputs' or 'gradients', got {basis!r}.")
  if sides not in ("input", "both"):
    raise ValueError(f"sides must be 'input' or 'both', got {sides!r}.")
  if others not in ("adam", "identity"):
    raise ValueError(f"others must be 'adam' or 'identity', got {others!r}.")
  if not isinstance(nesterov, bool):
    raise ValueError(f"nesterov must be a bool, got {nesterov!r}.")
  for name, value in (("b1", b1), ("b2", b2)):
    if not isinstance(value, jax.Array):
      checks.check_float(name, value, low=0.0, high=1.0, high_open=True)
  if not isinstance(eps, jax.Array):
    checks.check_float("eps", eps, low=0.0)
  if not isinstance(conditioner, options.Conditioner):
    raise TypeError(f"conditioner must be a scsgd_jax.Conditioner(kind=...), got {conditioner!r}.")
  default = options.Conditioner()
  for name in _NO_EFFECT:
    if getattr(conditioner, name) != getattr(default, name):
      raise TypeError(f"scale_by_eigenbasis_adam got Conditioner({name}=...), which changes the conditioner's "
                      "eigenvalues only: the eigenbasis reads its eigenvectors, which it leaves as they are; drop it.")
  args = transform.settings(rank, statistics, refresh, conditioner, kernel_filter, input_axes, axis_name, seed)
  checks.check_float("memory_share", memory_share, low=0.0, high=1.0, low_open=True)
  share = memory_share / 2 if sides == "both" else memory_share
  inner, plans = transform.conditioning_and_plans(args, budget_share=share, extra=_kept_beside(tail))
  keep = plan_lib.kernels_of(kernel_filter, input_axes)
  on_output_side = lambda path, leaf: keep(path, leaf) and output_lib.output_kernel_filter(path, leaf)

  @functools.lru_cache(maxsize=None)
  def output_side(rotatable: frozenset[str]):
    """The output side's conditioning and plans (output rows or the gradient's columns, along the output axes) of
    the kernels in ``rotatable``: no statistics, and no share of the memory, for a kernel it would never rotate."""
    return transform.conditioning_and_plans(args._replace(
        seed=seed + 1,
        input_axes=None,
        kernel_filter=lambda path, leaf: path in rotatable and on_output_side(path, leaf)),
                                            default_axes=output_lib.default_output_axes,
                                            budget_share=share,
                                            extra=_kept_beside(tail, "output"))

  def rotatable(tree) -> frozenset[str]:
    """The kernels of ``tree`` that init's plans rotate on the input side as one layer (a basis, unstacked,
    ungrouped). A kernel that the first update re-plans (a layout init could not read, e.g. a stack) keeps the
    output side init gave it, unread: ``input_axes`` plans it at init (the re-planning warning says so)."""
    return frozenset(p for p, plan in plans(tree).items() if _rank(plan) is not None and plan.slices is None)

  def output_of(tree):
    return output_side(rotatable(tree))

  def output_summary(tree, output_state):
    """``output_state`` whose plan summary says why the output side leaves a kernel to its input side alone."""
    alone = set(plan_lib.kernel_paths(tree, on_output_side)) - rotatable(tree)
    why = "no output side: rotated on its input side alone (a stack, feature groups, or no basis there)"
    return output_state._replace(plan=state_lib.PlanSummary(
        (p, why if p in alone else d) for p, d in output_state.plan.items))

  def both_sides(tree, kernel_plans) -> dict[str, plan_lib.KernelPlan]:
    """The output side's plans of the kernels rotated on both sides: one unstacked, ungrouped layer whose input
    side has a basis and whose output axes are the complement of its input axes (others: the input side alone)."""
    if sides != "both":
      return {}
    leaves = {plan_lib.path_to_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    out = {}
    for path, o in output_of(tree)[1](tree).items():
      plan = kernel_plans.get(path)
      if plan is None or _rank(plan) is None or _rank(o) is None or plan.slices is not None or o.slices is not None:
        continue
      ndim = leaves[path].ndim
      inputs = {a % ndim for a in plan.input_axes}
      if tuple(a % ndim for a in o.input_axes) == tuple(a for a in range(ndim) if a not in inputs):
        out[path] = o
    return out

  def adam_leaves(tree, kernel_plans) -> set[str]:
    """The leaves that get Adam itself: those not conditioned (with ``others='adam'``) and the kernels
    ``kernel_filter`` selects that the memory rule leaves unplanned (their basis would be the coordinate one)."""
    chosen = plan_lib.kernel_paths(tree, keep)
    return {p for p in map(plan_lib.path_to_str, (q for q, _ in jax.tree_util.tree_flatten_with_path(tree)[0]))
            if p not in kernel_plans and (others == "adam" or p in chosen)}

  def adam_moment(params, kernel_plans):
    """Adam's zero second moment at the leaves that get Adam itself; ``MaskedNode`` elsewhere."""
    adam = adam_leaves(params, kernel_plans)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if plan_lib.path_to_str(p) in adam else optax.MaskedNode(), params)

  def kernel_moments(params, kernel_plans, two=None) -> dict[str, EigenMoments]:
    """Each conditioned kernel's zero moments in its rotated coordinates (:func:`_fresh_moments`)."""
    two = two or {}
    leaves = {plan_lib.path_to_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    return {path: _fresh_moments(plan, leaves[path].size // (plan.n * (plan.slices or 1)), tail, two.get(path))
            for path, plan in kernel_plans.items()}

  def rotations_of(factors, kernel_plans):
    out = {}
    for path, plan in kernel_plans.items():
      if _rank(plan) is not None:
        out[path] = em.rotation(factors[path]) if plan.slices is None else jax.vmap(em.rotation)(factors[path])
    return out

  def init_fn(params):
    kernel_plans = plans(params)
    conditioning_state = inner.init(params)
    two = both_sides(params, kernel_plans)
    output_state = output_summary(params, output_of(params)[0].init(params)) if sides == "both" else None
    return ScaleByEigenbasisAdamState(
        conditioning=conditioning_state,
        mu=jax.tree_util.tree_map_with_path(
            lambda p, x, held=adam_leaves(params, kernel_plans) | set(kernel_plans): jnp.zeros_like(x)
            if plan_lib.path_to_str(p) in held else optax.MaskedNode(), params),
        nu=adam_moment(params, kernel_plans),
        moments=kernel_moments(params, kernel_plans, two),
        rotations=rotations_of(conditioning_state.factors, kernel_plans),
        output=output_state,
        output_rotations=None if output_state is None else rotations_of(output_state.factors, two))

  def update_fn(updates, state, params=None, *, layer_inputs=None, output_grads=None, **extra_args):
    kernel_plans = plans(updates, getattr(layer_inputs, "input_axes", None))
    if basis == "gradients":  # the statistics of the gradient's own rows (SOAP's left factor), no capture read
      layer_inputs = gradient_rows(updates, kernel_plans, getattr(layer_inputs, "input_axes", None))
    # the conditioned gradients are not used (compiled away under jit): the refreshed factors are
    _, conditioning_state = inner.update(updates, state.conditioning, params, layer_inputs=layer_inputs,
                                         **extra_args)
    two, output_state = both_sides(updates, kernel_plans), None
    if sides == "both":
      out_inner, out_plans = output_of(updates)
      if basis == "gradients":
        rows = gradient_rows(updates, out_plans(updates))
      else:
        output_lib.check_output_grads(output_grads, "scale_by_eigenbasis_adam(sides='both', basis='inputs')",
                                      "; or basis='gradients' (no capture)")
        key = jax.random.fold_in(jax.random.PRNGKey(seed + 2), state.count)  # made here, never at construction
        rows = output_lib.sample_rows(output_grads, key, defaults.MAX_ROWS)
      _, output_state = out_inner.update(updates, state.output, params, layer_inputs=rows)
      output_state = output_summary(updates, output_state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [plan_lib.path_to_str(p) for p, _ in flat]
    nus = treedef.flatten_up_to(state.nu)
    moments = _checked_moments(state.moments)
    shapes = jax.eval_shape(lambda: kernel_moments(updates, kernel_plans, two))
    # a kernel re-planned at the first update (a layout init could not read): its moments and basis start afresh
    restart = {p for p, f in shapes.items() if p not in moments or not state_lib.same_shapes(f, moments[p])}
    if restart:
      fresh = kernel_moments(updates, kernel_plans, two)
      moments = {p: fresh[p] if p in restart else moments[p] for p in kernel_plans}
    rotations = {**state.rotations, **{p: r for p, r in rotations_of(conditioning_state.factors, kernel_plans).items()
                                       if p in restart or p not in state.rotations}}
    out_rotations = {} if output_state is None else {
        **{p: r for p, r in (state.output_rotations or {}).items() if p in two},
        **{p: r for p, r in rotations_of(output_state.factors, two).items()
           if p in restart or p not in (state.output_rotations or {})}}
    count = optax.safe_increment(state.count)  # the conditioning's count before this update
    first_corr, second_corr = 1.0 - b1 ** count, 1.0 - b2 ** count
    bound = em.adam_ratio_bound(b1, b2, count, nesterov)  # Adam's step per coordinate of its basis, at most
    mus = [m if isinstance(m, optax.MaskedNode) else (b1 * m + (1.0 - b1) * g).astype(m.dtype)
           for m, (_, g) in zip(treedef.flatten_up_to(state.mu), flat)]

    out, new_nus, new_moments, new_rotations, new_out_rotations = [], [], {}, {}, {}
    late = basis == "gradients"
    for path, (_, g), m, v in zip(paths, flat, mus, nus):
      if isinstance(m, optax.MaskedNode):  # others="identity"
        out.append(g)
        new_nus.append(v)
        continue
      g32 = g.astype(jnp.float32)
      m_hat = m.astype(jnp.float32) / first_corr
      if nesterov:
        m_hat = b1 * m.astype(jnp.float32) / (1.0 - b1 ** (count + 1)) + (1.0 - b1) * g32 / first_corr
      plan = kernel_plans.get(path)
      if plan is None:  # Adam
        v = (b2 * v + (1.0 - b2) * jnp.square(g32)).astype(v.dtype)
        out.append((m_hat / (jnp.sqrt(v / second_corr) + eps)).astype(g.dtype))
        new_nus.append(v)
        continue
      new_nus.append(v)  # a conditioned kernel's moments are in `moments`
      v = moments[path]
      r = rotations.get(path)
      new = conditioning_state.factors[path]
      # a refreshed factor gives a new basis, the moments carried into it: before this step's direction for the
      # inputs' basis, after it for the gradients' (SOAP's order: the step never uses the basis its own gradient
      # just joined, in which U^T G U_out would be G's diagonal of singular values)
      if path in two:  # rotated on both sides: U^T M U_out, one layer
        r_out, new_out = out_rotations[path], output_state.factors[path]
        q, q_out, rebase = new.q, new_out.q, None
        if path not in restart:
          old, old_out = state.conditioning.factors[path], state.output.factors[path]
          changed = _differs((old, old_out), (new, new_out))

          def rebase_both(operand, old=old, new=new, old_out=old_out, new_out=new_out):
            r, r_out, v = operand
            fresh, fresh_out = em.rotation(new), em.rotation(new_out)
            return fresh, fresh_out, em.carried_both(v, em.basis(new.q, fresh), em.basis(old.q, r),
                                                   em.basis(new_out.q, fresh_out), em.basis(old_out.q, r_out))

          rebase = lambda operand, changed=changed, f=rebase_both: jax.lax.cond(changed, f, lambda o: o, operand)
          if late:
            q, q_out = old.q, old_out.q
          else:
            r, r_out, v = rebase((r, r_out, v))
        mm, restore = sketch.kernel_matrix(m_hat, plan.input_axes)
        gm, _ = sketch.kernel_matrix(g32, plan.input_axes)
        direction, v = em.direction(q, r, mm, gm, v, b2, second_corr, eps, bound, tail, (q_out, r_out))
        if late and rebase is not None:
          r, r_out, v = rebase((r, r_out, v))
        new_rotations[path], new_out_rotations[path] = r, r_out
        out.append(restore(direction).astype(g.dtype))
        new_moments[path] = v
        continue
      q, rebase = (new.q if r is not None else None), None
      if r is not None and path not in restart:
        old = state.conditioning.factors[path]
        changed = _differs(old, new)

        def rebase_one(operand, old=old, new=new, plan=plan):
          def one_slice(r, v, old, new):
            fresh = em.rotation(new)
            return fresh, em.carried(v, em.basis(new.q, fresh), em.basis(old.q, r))

          return (one_slice if plan.slices is None else jax.vmap(one_slice))(*operand, old, new)

        rebase = lambda operand, changed=changed, f=rebase_one: jax.lax.cond(changed, f, lambda o: o, operand)
        if late:
          q = old.q
        else:
          r, v = rebase((r, v))

      def one(q, r, m_slice, g_slice, moments, plan=plan):
        mm, restore = sketch.kernel_matrix(m_slice, plan.input_axes)
        gm, _ = sketch.kernel_matrix(g_slice, plan.input_axes)
        direction, moments = em.direction(q, r, mm, gm, moments, b2, second_corr, eps, bound, tail)
        return restore(direction), moments

      if plan.slices is None:
        direction, v = one(q, r, m_hat, g32, v)
      else:
        axis = lambda x: None if x is None else 0
        direction, v = jax.vmap(one, in_axes=(axis(q), axis(r), 0, 0, 0))(
            q, r, plan.to_slices(m_hat), plan.to_slices(g32), v)
        direction = plan.from_slices(direction, g.shape)
      if late and rebase is not None:
        r, v = rebase((r, v))
      if r is not None:
        new_rotations[path] = r
      out.append(direction.astype(g.dtype))
      new_moments[path] = v
    return treedef.unflatten(out), ScaleByEigenbasisAdamState(
        conditioning=conditioning_state, mu=treedef.unflatten(mus), nu=treedef.unflatten(new_nus),
        moments=new_moments, rotations=new_rotations, output=output_state,
        output_rotations=None if output_state is None else new_out_rotations)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
