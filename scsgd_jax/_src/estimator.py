r"""The estimator: every conditioned kernel's input statistics, their fold, the refresh schedule and the factors, in
one object (kfac-jax's split of curvature estimation from its use). The input side's conditioning
(:mod:`transform`), the eigenbasis and the output side build on it and read its factors."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scsgd_jax._src import apart
from scsgd_jax._src import banks as banks_lib
from scsgd_jax._src import checks
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import options
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import plan as plan_lib
from scsgd_jax._src import state as state_lib
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.inputs import HELPERS
from scsgd_jax._src.state import ScaleBySketchedConditioningState


def _spec(c: Conditioning, layouts, default_axes, memory_share: float, extra) -> tuple[plan_lib.Spec, int]:
  """The plans' spec of conditioning ``c`` reading kernels by ``layouts`` (else ``default_axes``), and the fold
  period."""
  checks.check_float("memory_share", memory_share, low=0.0, high=1.0, low_open=True)
  st = c.statistics
  got = (options.Statistics(fold_every=st.fold_every) if st.custom else st).resolved()
  cond = c.conditioner.resolved(c.sketch_rank())
  # ema_rate is per step: a fold every s steps weighs its batch 1 - (1 - nu)^s, so the EMA spans as many steps
  fold_rate = 1.0 - (1.0 - got["ema_rate"])**got["fold_every"]
  choices = plan_lib.StatisticsChoices(fold_rate,
                                       warm_start=c.refresh.warm_start,
                                       oversample=got["oversample"],
                                       power_iterations=got["power_iterations"],
                                       eigenvalue_floor=cond["eigenvalue_floor"])
  spec = plan_lib.Spec(rank=c.sketch_rank(), full_max_dim=cond["full_max_dim"], oversample=got["oversample"],
                       conditioner=cond["kind"], statistics=st.kind, budget=got["budget"],
                       kernel_filter=layout_lib.kernels_of(c.kernel_filter, layouts), layouts=layouts,
                       choices=choices, default_axes=default_axes, memory_share=memory_share, extra=extra)
  return spec, got["fold_every"]


INPUT_AXES = object()  # the estimator's layouts default: its conditioning's input_axes

# what the leaves the conditioning leaves plain get, as its warnings say it (the eigenbasis says its own)
PLAIN_STEP = ("their gradients pass on unconditioned to the rest of the chain (under scsgd: Nesterov SGD; in front of "
              "AdamW or Muon: theirs)")


class Estimator:
  """Every conditioned kernel's statistics, fold, refresh schedule and factors under conditioning ``c``: ``init``
  plans the kernels (fixed there) and builds their fresh state; ``update`` checks the captured rows against the
  plans, folds them (:meth:`fold`), rebuilds the factors due (:meth:`refresh`, unless the refreshes run apart)
  and counts the update; ``state.factors`` are what the conditioning, the eigenbasis and the output side read.

  ``default_axes``: how a kernel is read unless told otherwise (the output side passes the kernel's output axes);
  ``layouts``: the kernels' layouts (default: ``c.input_axes``; the output side passes its output axes);
  ``memory_share``: the share of the memory rule's budget the statistics take; ``extra``: what a transformation
  built on it keeps per kernel beside them, for the memory rule (:class:`~scsgd_jax._src.plan.Spec`'s).
  ``plans(tree, captured_axes=None) -> {path: KernelPlan}``: the plans of a tree of that structure (cached).
  """

  def __init__(self, c: Conditioning, *, layouts=INPUT_AXES, default_axes=layout_lib.default_input_axes,
               memory_share: float = 1.0, extra=None, plain_step: str = PLAIN_STEP):
    self.c, self.default_axes, self.plain_step = c, default_axes, plain_step
    self.layouts = c.input_axes if layouts is INPUT_AXES else layouts
    spec, self.fold_every = _spec(c, self.layouts, default_axes, memory_share, extra)
    self.plans = state_lib.PlanCache(spec)

  def refresher(self, kernel_plans) -> apart.Refresher:
    """What rebuilds the factors of ``kernel_plans`` on this estimator's schedule (fixed by the plans); a kernel
    that reads another's statistics has none to rebuild."""
    return apart.refresher(plan_lib.own_statistics(kernel_plans), self.c.refresh, self.fold_every,
                           self.c.conditioner.normalize, self.c.statistics.outlier_threshold, self.c.axis_name)

  def init(self, params) -> ScaleBySketchedConditioningState:
    """The plans of ``params``' kernels and their fresh statistics and factors."""
    layout_lib.check_input_axes_keys(self.layouts, params)
    kernel_plans = self.plans(params)
    input_side = self.default_axes is layout_lib.default_input_axes
    kernels = {}
    if not kernel_plans and input_side:  # the input side: say it, once
      kernels = {p: why for p, why in state_lib.said(self.plans.notes).items() if why != state_lib.RAW}
      warn_nothing_conditioned(params, kernels, self.plain_step)
    if input_side and (kernel_plans or kernels):  # else the warning above named every matrix and input_axes
      warn_raw_parameters(self.plans.notes, self.plain_step, self.layouts is not None)
    if self.c.rank is not None:
      warn_rank_cut(kernel_plans, self.c.rank)
    if self.layouts is None and input_side:
      warn_shared_inputs_unknown(kernel_plans)
    key, (statistics, factors, clipped) = state_lib.fresh_kernel_states(kernel_plans, self.c.seed)
    return ScaleBySketchedConditioningState(
        count=jnp.zeros([], jnp.int32),
        key=key,
        statistics=statistics,
        factors=factors,
        clipped_rows=clipped,
        plan=state_lib.summary_of(kernel_plans, self.plans.notes, self.c.sketch_rank(),
                                  self.refresher(kernel_plans) if self.c.refresh.apart else None),
    )

  def fold(self, state: ScaleBySketchedConditioningState, kernel_plans, rows):
    """``(statistics, clipped rows)`` with ``rows`` (:func:`fold.checked_rows`) folded in, at the steps the fold period
    says."""
    return self.refresher(kernel_plans).fold(state.statistics, state.clipped_rows, state.count, rows)

  def refresh(self, statistics, state: ScaleBySketchedConditioningState, kernel_plans):
    """``(factors, key, rebuilt)``: the factors of ``kernel_plans`` due at this update rebuilt from ``statistics``,
    and which were (banked as the factors, per slice)."""
    return self.refresher(kernel_plans).rebuild(statistics, state.factors, state.key, state.count,
                                                planned=kernel_plans)

  def update(self, updates, state: ScaleBySketchedConditioningState, layer_inputs):
    """``(state, plans, rebuilt)``: ``state`` after this update's fold and refresh, the plans of the kernels
    conditioned in it (``updates``' kernels, less those the capture could not condition in this update), and which
    factors the refresh rebuilt (banked as the factors, per slice; none when the refreshes run apart)."""
    helper = getattr(layer_inputs, "helper", HELPERS)
    kernel_plans = self.plans(updates, getattr(layer_inputs, "input_axes", None), helper)
    if set(kernel_plans) != set(state.factors):
      raise ValueError(
          f"the conditioned kernels of `updates` {sorted(kernel_plans)} do not match those the state "
          f"was initialised with {sorted(state.factors)}.")
    # layers the capture cannot condition: plain updates, their state untouched, the summary says so
    skipped = {p: f"not conditioned: {why}" for p, why in getattr(layer_inputs, "unconditioned", {}).items()
               if p in kernel_plans}
    # and, without input_axes, those init could only guess and guessed wrong (an Einsum's, a DenseGeneral's)
    skipped |= {p: f"not conditioned: its layer reads it {how}" for p, how in self.plans.misread.items()}
    state = state_lib.noted(state, kernel_plans, skipped, self.c.sketch_rank())
    if skipped:  # planned at init, unread by the capture or read otherwise: said once per trace
      warnings.warn("scsgd_jax: these kernels init planned get plain updates, as the capture could not read them "
                    "by the layout planned: " + "; ".join(f"{p} ({why})" for p, why in skipped.items())
                    + f". Set input_axes={helper} in the optimizer's scsgd_jax.Conditioning to plan each by its "
                    "layer's layout at init.", stacklevel=4)
      kernel_plans = {p: plan for p, plan in kernel_plans.items() if p not in skipped}
    own = plan_lib.own_statistics(kernel_plans)  # a kernel reading another's statistics folds no rows of its own
    statistics, clipped = self.fold(state, own, fold_lib.checked_rows(own, layer_inputs))
    factors, key = state.factors, state.key
    rebuilt = banks_lib.Banked(factors.index, [jnp.zeros(sum(b.sizes), bool) for b in factors.index.banks])
    if not self.c.refresh.apart:  # else refresh_conditioners rebuilds them, apart from this step
      factors, key, rebuilt = self.refresh(statistics, state, own)
    return state._replace(count=optax.safe_increment(state.count), key=key, statistics=statistics, factors=factors,
                          clipped_rows=clipped), kernel_plans, rebuilt


def warn_rank_cut(kernel_plans, asked: int) -> None:
  """A warning naming the kernels planned below the rank asked (beyond their ``n``, or cut by the memory rule)."""
  cut = {p: plan for p, plan in kernel_plans.items() if plan.below(asked)}
  if cut:
    warnings.warn(f"scsgd_jax: rank={asked} was asked, but these kernels are planned at a lower rank: " + "; ".join(
        f"{p} (rank {plan.rank}, n={plan.n}: "
        f"{'a sketch is below n' if plan.rank == plan.n - 1 and asked >= plan.n else 'the memory rule'})"
        for p, plan in cut.items()) + ". The memory rule (Statistics(budget=...)) and n decide it; "
        "scsgd_jax.plans(state) shows every plan.", stacklevel=4)


def attention_siblings(paths) -> list[list[str]]:
  """Groups of kernels named as one attention's query, key and value (Flax's names): one input array, as a rule."""
  groups: dict[str, list[str]] = {}
  for p in paths:
    parts = p.split("/")
    if len(parts) >= 3 and parts[-1] == "kernel" and parts[-2] in ("query", "key", "value"):
      groups.setdefault("/".join(parts[:-2]), []).append(p)
  return [g for g in groups.values() if len(g) > 1]


def warn_shared_inputs_unknown(kernel_plans) -> None:
  """Without ``input_axes`` the plans cannot know which kernels read one input array (an attention's query, key and
  value: each is planned apart, with a third of the memory one shared statistic has), nor an Einsum's equation
  (its kernel is read by name). One line each, naming the fix."""
  einsums = [p for p in kernel_plans if p.count("/") and "einsum" in p.rsplit("/", 2)[-2].lower()]
  if einsums:
    warnings.warn(
        f"scsgd_jax: no input_axes given, so {len(einsums)} Einsum kernel(s) (e.g. '{einsums[0]}') are planned by "
        "Flax's name-based axes, which an Einsum's equation may contradict (the first update then steps those it "
        "does plainly and names them): "
        "pass scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(model, x)) (Linen: "
        "scsgd_jax.input_axes_linen(module, variables, x)), which reads each equation.", stacklevel=4)
  groups = [g for g in attention_siblings(kernel_plans)
            if any((kernel_plans[p].kind, kernel_plans[p].rank) != ("dense", None) for p in g)]
  if groups:
    warnings.warn(
        f"scsgd_jax: no input_axes given, so the query, key and value of {len(groups)} attention layer(s) are "
        f"planned apart, each within a third of the memory one shared statistic of their one input has (e.g. "
        + ", ".join(f"{p}: {kernel_plans[p].describe()}" for p in groups[0])
        + "): pass scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(model, x)) (Linen: "
        "scsgd_jax.input_axes_linen(module, "
        "variables, x)), which finds the shared inputs.", stacklevel=4)


def warn_nothing_conditioned(params, notes: dict[str, str], plain_step: str) -> None:
  """A warning (once per model) that no leaf of ``params`` is conditioned: why for each kernel the filter took
  (``notes``), or, when it took none, the matrices it saw; ``plain_step``: what the leaves get instead."""
  if notes:
    warnings.warn(f"scsgd_jax: no leaf is conditioned, so {plain_step}: "
                  + "; ".join(f"{p} ({why})" for p, why in notes.items()), stacklevel=3)
    return
  matrices = [layout_lib.path_to_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
              if np.ndim(leaf) >= 2]
  warnings.warn(
      f"scsgd_jax: no leaf is conditioned, so {plain_step}: the kernel filter took none of the "
      f"parameters' matrices {matrices[:8]}{' ...' if len(matrices) > 8 else ''}. Flax names kernels 'kernel' and "
      "'embedding'; for other names (Equinox's 'weight', a plain dict) say each kernel's input axes, e.g. "
      "input_axes={'layers/0/weight': scsgd_jax.Layout(input_axes=(1,))} for an (out, in) weight, (0,) for "
      "(in, out).", stacklevel=3)


def warn_raw_parameters(notes: dict[str, str], plain_step: str, input_axes_given: bool) -> None:
  """One line naming the raw matrices no filter takes (a mixture of experts' weights used with ``jnp.einsum``) and
  the route that conditions them: without ``input_axes``, the ``input_axes_*`` call that reads what a model's
  :func:`~scsgd_jax.sow_rows` says."""
  raw = [p for p, why in notes.items() if why == state_lib.RAW]
  if not raw:
    return
  named = f"{', '.join(raw[:8])}{' ...' if len(raw) > 8 else ''}"
  route = ("name its layout in input_axes (e.g. input_axes={..., '" + raw[0] + "': scsgd_jax.Layout((0,), stack=1)} "
           "for (experts, d, hidden) read along d) and hand the capture its rows in the model: "
           "scsgd_jax.sow_rows(self, name, rows, layout)")
  if input_axes_given:
    warnings.warn(f"scsgd_jax: {len(raw)} raw parameter(s) with two or more axes are no layer's kernel, so "
                  f"{plain_step}: {named}. To condition one a model multiplies by (a mixture of experts' weights used "
                  f"with jnp.einsum), {route}; scsgd_jax.plans(state) lists every leaf.", stacklevel=4)
  else:
    warnings.warn(
        f"scsgd_jax: no input_axes given, so {len(raw)} raw parameter(s) with two or more axes, no layer's "
        f"kernel, are not conditioned and {plain_step}: {named}. If the model hands their rows with "
        "scsgd_jax.sow_rows, pass scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_nnx(model, x)) (Linen: "
        "scsgd_jax.input_axes_linen(module, variables, x)), which reads their layouts; else " + route + ".",
        stacklevel=4)
