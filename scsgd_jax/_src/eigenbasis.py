r"""Adam in the sketched conditioner's eigenbasis (EKFAC's input side; SOAP's rotation, sketched).

For a kernel read as ``(n, p)`` whose input correlation ``C`` the conditioning keeps, the refresh gives an
orthonormal ``U`` (``n x k``): the eigenvectors of ``C``'s sketch (``Q V`` with ``Q^T C Q = V \Lambda V^T``), or of
the full ``C`` (``k = n``). Adam's second moment is kept for the rotated gradient ``U^T G`` (``k x p``), and a
cheap one for the tail ``G - U U^T G`` that the sketch leaves out (Adafactor's factored row and column moments,
or one scalar as Sketchy); the update is Adam's, taken in those coordinates and rotated back. Leaves the
conditioning does not read (biases, norms, and the diagonal kinds: embeddings, whose eigenbasis is the
coordinate one) get Adam itself.

The memory rule (``Statistics(kind='auto')``) counts everything the eigenbasis keeps per kernel in place of Adam's
second moment (statistics, factor, rotated moments, tail, rotation) against that moment's floats, so the state
stays within Adam's.
"""

from __future__ import annotations

from typing import Literal, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import options
from scsgd_jax._src import eigen_banks as eb
from scsgd_jax._src import eigen_kernels as ek
from scsgd_jax._src import eigen_math as em
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.conditioning import checked
from scsgd_jax._src.conditioning import refuses_moved_keywords
from scsgd_jax._src.eigen_math import EigenMoments
from scsgd_jax._src.inputs import HELPERS
from scsgd_jax._src.eigen_math import Tail
from scsgd_jax._src.state import ScaleBySketchedConditioningState

__all__ = ["ScaleByEigenbasisAdamState", "scale_by_eigenbasis_adam"]

Basis = Literal["inputs", "gradients"]
Sides = Literal["input", "both"]


class ScaleByEigenbasisAdamState(NamedTuple):
  """State of :func:`scale_by_eigenbasis_adam`.

  Attributes:
    conditioning: the conditioning's state (statistics, factors, and the count of updates applied so far, which
      Adam's bias correction reads: :class:`ScaleBySketchedConditioningState`).
    mu: Adam's first moment, in the parameters' own coordinates (a tree like the parameters).
    nu: Adam's second moment of the leaves that get Adam itself (a tree like the parameters, each leaf shaped
      like its parameter; ``optax.MaskedNode`` at the conditioned kernels and the leaves passed through).
    moments: ``{kernel path: EigenMoments}``, each conditioned kernel's second moment in its rotated
      coordinates, stored in banks (:class:`~scsgd_jax._src.banks.Banked`: the kernels of one conditioning bank,
      shape and layout stacked; read per kernel as a mapping). Kept apart from ``nu`` so that every leaf of a
      parameter-shaped tree has its parameter's shape: Flax's ``nnx.Optimizer`` wraps such a leaf in its
      parameter's variable (its sharding annotation included) and would turn a tuple there into a dict.
    rotations: ``{kernel path: V}`` in the same banks, the eigenbasis in use as a rotation of the conditioning's
      factor: ``U = Q V`` (``V`` is ``k x k``; for a dense factor ``U = V``, ``n x n``), a leading axis per slice of
      a stack; none for a diagonal kind (the coordinate basis). Kept instead of ``U`` so the state does not hold
      ``Q`` twice.
    output: with ``sides='both'``, the output side's conditioning state (the statistics of the captured output
      gradients or of the gradient's columns, read along each kernel's output axes); else ``None``.
    output_rotations: with ``sides='both'``, ``{kernel path: V_out}`` of the kernels rotated on both sides
      (``U_out = Q_out V_out``, ``p x k``); else ``None``.
  """

  conditioning: ScaleBySketchedConditioningState
  mu: optax.Updates
  nu: optax.Updates
  moments: Mapping[str, EigenMoments]
  rotations: Mapping[str, jax.Array]
  output: Optional[ScaleBySketchedConditioningState] = None
  output_rotations: Optional[dict[str, jax.Array]] = None

  @property
  def count(self) -> jax.Array:
    """Updates applied so far (``int32``): the conditioning's count, the one counter the state keeps."""
    return self.conditioning.count

  def summary(self) -> dict[str, str]:
    """How each kernel is conditioned (the conditioning's :meth:`~ScaleBySketchedConditioningState.summary`)."""
    return self.conditioning.summary()


@refuses_moved_keywords
def scale_by_eigenbasis_adam(
    conditioning: Conditioning = Conditioning(),
    *,
    b1: float = defaults.ADAM_B1,
    b2: float = defaults.ADAM_B2,
    eps: float = defaults.ADAM_EPS,
    nesterov: bool = False,
    tail: Tail = "factored",
    basis: Basis = "inputs",
    sides: Sides = "input",
    others: Literal["adam", "identity"] = "adam",
    memory_share: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam in the eigenbasis of each kernel's sketched input conditioner (one-sided EKFAC / SOAP, sketched).

  The conditioning (:func:`scale_by_sketched_conditioning`'s, under ``conditioning``) keeps each
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
  factor and statistics. Under ``Statistics(kind='auto')`` the memory rule counts all but the first moment against
  ``memory_share`` of Adam's second moment (per kernel, or over the kernels with ``budget='model'``): each kernel
  gets the best statistics and rank that fit, so the state is at most Adam's. A kernel whose only fit would be
  diagonal statistics (a coordinate basis) gets Adam itself, keeping no statistics.

  ``update`` takes ``layer_inputs=`` as :func:`scale_by_sketched_conditioning` does.

  Args:
    conditioning: the conditioning's :class:`Conditioning`; of its :class:`Conditioner` only ``kind`` and
      ``full_max_dim`` act here (the eigenbasis reads the factor's eigenvectors, which its floor and normalization
      leave as they are), and its refreshes run in the update (``Refresh(apart=True)`` is refused).
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
      may take (``Statistics(kind='auto')``; with ``sides='both'`` the two sides split it).

  References:
    George et al., Fast Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis (EKFAC), 2018.
    Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam, 2024.
    Liu et al., COSMOS: A Hybrid Adaptive Optimizer for Memory-Efficient Training of LLMs, 2025.
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, 2015.
  """
  _check_arguments(b1, b2, eps, nesterov, tail, basis, sides, others)
  s = checked(conditioning, "scale_by_eigenbasis_adam")
  s.refresh.refuse_apart("the eigenbasis (scale_by_eigenbasis_adam, scsgd_eigen, scsgd_eigen_muon)",
                         "rotates its moments into each rebuilt basis inside its update")
  _check_eigenvectors_only(s.conditioner)
  checks.check_float("memory_share", memory_share, low=0.0, high=1.0, low_open=True)
  k = ek.Kernels(s, tail, sides, others, memory_share / 2 if sides == "both" else memory_share)
  e = _EigenbasisAdam(k, _Adam(b1, b2, eps, nesterov), basis == "gradients")
  return optax.GradientTransformationExtraArgs(e.init, e.update)


def _check_arguments(b1, b2, eps, nesterov, tail, basis, sides, others) -> None:
  """:func:`scale_by_eigenbasis_adam`'s own arguments, each checked (a traced value, as
  ``optax.inject_hyperparams`` passes, is not)."""
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


def _check_eigenvectors_only(conditioner: options.Conditioner) -> None:
  """Refuses the :class:`Conditioner` settings that move only the eigenvalues, which the eigenbasis does not read."""
  default = options.Conditioner()
  for name in options.Conditioner.EIGENVALUES_ONLY:
    if getattr(conditioner, name) != getattr(default, name):
      raise TypeError(f"scale_by_eigenbasis_adam got Conditioner({name}=...), which changes the conditioner's "
                      "eigenvalues only: the eigenbasis reads its eigenvectors, which it leaves as they are; drop it.")


class _Adam(NamedTuple):
  b1: float
  b2: float
  eps: float
  nesterov: bool


class _EigenbasisAdam:
  """:func:`scale_by_eigenbasis_adam`'s ``init`` and ``update`` over its kernels (:class:`eigen_kernels.Kernels`):
  the conditioning's estimator, both sides' plans, and Adam's settings."""

  def __init__(self, k: ek.Kernels, adam: "_Adam", gradient_basis: bool):
    self.k, self.adam, self.gradient_basis = k, adam, gradient_basis

  def init(self, params) -> ScaleByEigenbasisAdamState:
    k = self.k
    kernel_plans = k.plans(params)
    conditioning_state = k.estimator.init(params)
    two = k.both_sides(params, kernel_plans)
    output_state = k.output_summary(params, k.output_of(params).init(params)) if k.sides == "both" else None
    adam = k.adam_leaves(params, kernel_plans)  # Adam itself; the conditioned kernels' second moments are rotated
    return ScaleByEigenbasisAdamState(
        conditioning=conditioning_state,
        mu=ek.zeros_at(params, adam | set(kernel_plans)),
        nu=ek.zeros_at(params, adam),
        moments=(moments := eb.fresh(params, kernel_plans, two, k.tail)),
        rotations=eb.rotations(conditioning_state.factors, kernel_plans, moments.index),
        output=output_state,
        output_rotations=None if output_state is None else ek.rotations_of(output_state.factors, two))

  def update(self, updates, state, params=None, *, layer_inputs=None, output_grads=None, **extra_args):
    del params, extra_args  # optax's; the estimator reads the captured rows (layer_inputs) alone
    k, adam = self.k, self.adam
    axes = getattr(layer_inputs, "input_axes", None)
    kernel_plans = k.plans(updates, axes, getattr(layer_inputs, "helper", HELPERS))
    if self.gradient_basis:  # the statistics of the gradient's own rows (SOAP's left factor), no capture read
      layer_inputs = ek.gradient_rows(updates, kernel_plans, axes)
    conditioning_state, _, rebuilt = k.estimator.update(updates, state.conditioning, layer_inputs)
    two = k.both_sides(updates, kernel_plans)
    output_state, output_rebuilt = (None, None) if k.sides != "both" else ek.output_update(
        k, "gradients" if self.gradient_basis else "inputs", updates, state, output_grads)
    eb.checked(state, updates, kernel_plans, two, k.tail)
    count = optax.safe_increment(state.count)  # the conditioning's count before this update
    c = ek.Step(adam.b2, 1.0 - adam.b2**count, adam.eps, em.adam_ratio_bound(adam.b1, adam.b2, count, adam.nesterov),
                k.tail, self.gradient_basis)
    out, mu, nu, moments, rotations, out_rotations = _leaf_steps(updates, state, kernel_plans, two,
                                                                 conditioning_state, output_state, adam, c, count,
                                                                 (rebuilt, output_rebuilt))
    return out, ScaleByEigenbasisAdamState(
        conditioning=conditioning_state, mu=mu, nu=nu, moments=moments, rotations=rotations, output=output_state,
        output_rotations=None if output_state is None else out_rotations)


def _first_moment(m, g32, adam: _Adam, count):
  """Adam's bias-corrected first moment (NAdam's form with ``nesterov``)."""
  if adam.nesterov:
    return adam.b1 * m.astype(jnp.float32) / (1.0 - adam.b1**(count + 1)) + (1.0 - adam.b1) * g32 / (1.0 - adam.b1**count)
  return optax.tree.bias_correction(m.astype(jnp.float32), adam.b1, count)


def _leaf_steps(updates, state, kernel_plans, two, conditioning_state, output_state, adam: _Adam, c: ek.Step,
                count, rebuilt):
  """Every leaf's step: passed through (``others='identity'``), Adam's, or its kernel's in its basis, a bank at a
  time (:func:`_bank_steps`); with the new moments and rotations."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
  mus = [m if isinstance(m, optax.MaskedNode) else optax.tree.update_moment(g, m, adam.b1, 1).astype(m.dtype)
         for m, (_, g) in zip(treedef.flatten_up_to(state.mu), flat)]
  out, nus, conditioned = {}, [], {}
  for (p, g), m, v in zip(flat, mus, treedef.flatten_up_to(state.nu)):
    path = layout_lib.path_to_str(p)
    nus.append(v)
    if isinstance(m, optax.MaskedNode):  # others="identity"
      out[path] = g
      continue
    g32 = g.astype(jnp.float32)
    m_hat = _first_moment(m, g32, adam, count)
    if path in kernel_plans:  # a conditioned kernel: its moments are in `moments`, its step its bank's
      conditioned[path] = (g32, m_hat)
      continue
    v = optax.tree.update_moment_per_elem_norm(g32, v, adam.b2, 2).astype(v.dtype)  # Adam
    out[path] = (m_hat / (jnp.sqrt(optax.tree.bias_correction(v, adam.b2, count)) + adam.eps)).astype(g.dtype)
    nus[-1] = v
  directions, moments, rotations, out_rotations = _bank_steps(state, kernel_plans, two, conditioned,
                                                              conditioning_state, output_state, c, rebuilt)
  ordered = []
  for p, g in flat:
    path = layout_lib.path_to_str(p)
    ordered.append(directions[path].astype(g.dtype) if path in directions else out[path])
  return (treedef.unflatten(ordered), treedef.unflatten(mus), treedef.unflatten(nus), moments, rotations,
          out_rotations)


def _bank_steps(state, kernel_plans, two, conditioned, conditioning_state, output_state, c: ek.Step, rebuilt):
  """The conditioned kernels' steps, a bank of the moments at a time (:func:`eigen_banks.one_side`); a kernel
  rotated on both sides alone (:func:`~eigen_kernels.both_sides`): ``(directions, moments, rotations, output
  rotations)``."""
  moments_index, rotation_index = state.moments.index, state.rotations.index
  directions, moment_banks, rotation_banks, out_rotations = {}, [], {}, {}
  for i, bank in enumerate(moments_index.banks):
    plan = kernel_plans[bank.paths[0]]
    v = eb.members(state.moments.banks[i], bank)
    rotated = bank.paths[0] in rotation_index.paths
    r = eb.members(state.rotations.banks[rotation_index.banks.index(bank)], bank) if rotated else None
    old = eb.gathered(state.conditioning.factors, bank)
    new = eb.gathered(conditioning_state.factors, bank)
    moved = jnp.any(eb.gathered(rebuilt[0], bank).reshape(len(bank.paths), -1), axis=1)  # the refresh says which
    if bank.paths[0] in two:  # rotated on both sides: U^T M U_out, one layer
      path = bank.paths[0]
      g, m_hat = conditioned[path]
      pick = lambda tree: jax.tree.map(lambda a: a[0], tree)
      direction, v, r, out_rotations[path] = ek.both_sides(
          plan, g, m_hat, pick(v), pick(r), state.output_rotations[path], pick(old), pick(new),
          state.output.factors[path], output_state.factors[path], c, moved[0] | rebuilt[1][path])
      directions[path] = direction
      v, r = jax.tree.map(lambda a: a[None], (v, r))
    else:
      g = jnp.stack([conditioned[p][0] for p in bank.paths])
      m_hat = jnp.stack([conditioned[p][1] for p in bank.paths])
      direction, v, r = eb.one_side(plan, g, m_hat, v, r, old, new, c, moved)
      directions.update({p: direction[j] for j, p in enumerate(bank.paths)})
    moment_banks.append(eb.stored(v, bank))
    if rotated:
      rotation_banks[bank] = eb.stored(r, bank)
  moments = banks_lib.Banked(moments_index, moment_banks)
  rotations = banks_lib.Banked(rotation_index, [rotation_banks[b] for b in rotation_index.banks])
  return directions, moments, rotations, out_rotations
