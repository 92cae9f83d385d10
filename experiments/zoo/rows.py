"""The zoo's rows: each optimizer as its authors run it, built for a workload at a peak rate schedule.

A row linear in its rate (the rate multiplies the whole update, weight decay included) is built once at peak rate 1
and scaled per run (:func:`scaled_by_rate`): one compiled step serves the whole rate grid and every seed. A row whose
step bound reads the scaled step (``scsgd``'s ``max_relative_step``) is not linear: it is built at each rate.
``scsgd_no_axes`` is what a user gets who passes no ``input_axes`` (the README's recipe passes them).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import optax

import scsgd_jax as sk
from experiments.optim import peers
from experiments.optim import registry
from experiments.optim.sources import ADAM, MUON, NANOGPT
from experiments.zoo.workloads import Workload

NESTEROV = "Nesterov SGD, momentum 0.9 (Sutskever et al. 2013), the paper's baseline with momentum"


class Row(NamedTuple):
  """``build(schedule, workload, input_axes) -> tx``; ``centre``: the middle of its factor-2 rate grid; ``linear``:
  whether its step is linear in its rate (:func:`build_row`)."""

  build: Callable[[optax.Schedule, Workload, dict], optax.GradientTransformation]
  centre: float
  source: str
  linear: bool = True


def _adam(w: Workload) -> dict:
  return registry.adam_settings(w.kind)


def _muon_args(w: Workload) -> dict:
  """Muon's recipe: the output layer (and tables, vectors) on its AdamW part at the authors' betas."""
  return {"output_layer": w.head, **{f"adam_{k}": v for k, v in _adam(w).items() if k != "decay_matrices_only"}}


def _eigen(s, w, axes):
  settings = dict(_adam(w))
  if settings.pop("decay_matrices_only", False):
    settings["mask"] = peers.decay_matrices
  return sk.scsgd_eigen(s, sk.Conditioning(input_axes=axes), **settings)


def eigen_muon(s, w, axes, conditioning: Optional[dict] = None, **changed):
  """The ``scsgd_eigen_muon`` row; ``conditioning``/``changed``: its :class:`scsgd_jax.Conditioning` fields and
  keywords changed from the row's (the probe's variants)."""
  args = _muon_args(w)
  own = {k: args.pop(k) for k in ("output_layer",)}
  b2 = _adam(w).get("b2")
  kwargs = {**own, **({"b2": b2} if b2 else {}), **changed}
  return sk.scsgd_eigen_muon(s, sk.Conditioning(input_axes=axes, **(conditioning or {})), muon=args, **kwargs)


ROWS: dict[str, Row] = {
    "sgd":
        Row(lambda s, w, axes: optax.sgd(s, momentum=0.9, nesterov=True), 0.1, NESTEROV),
    "scsgd":
        Row(
            lambda s, w, axes: sk.scsgd(s, sk.Conditioning(input_axes=axes)), 0.1,
            "scsgd_jax.scsgd at its defaults, the README's recipe (input_axes read from the model); rate centre "
            "SGD's", linear=False),
    "scsgd_no_axes":
        Row(lambda s, w, axes: sk.scsgd(s), 0.1,
            "scsgd_jax.scsgd at its defaults without input_axes (a new user's first try)", linear=False),
    "adamw":
        Row(lambda s, w, axes: peers.adamw(s, **_adam(w)), 3e-3, f"transformers: {NANOGPT}; the other models: {ADAM}"),
    "scsgd_eigen":
        Row(_eigen, 3e-3, "scsgd_jax.scsgd_eigen at AdamW's settings (SOAP's authors run SOAP so)"),
    "muon":
        Row(lambda s, w, axes: peers.muon(s, **_muon_args(w)), 0.02, MUON),
    "scsgd_eigen_muon":
        Row(eigen_muon, 0.02, "scsgd_jax.scsgd_eigen_muon as Muon's recipe: " + MUON),
    "scsgd_muon":
        Row(
            lambda s, w, axes: optax.chain(sk.scale_by_sketched_conditioning(sk.Conditioning(input_axes=axes)),
                                           peers.muon(s, **_muon_args(w))), 0.02,
            "scsgd_jax's conditioning in front of Muon as Muon's recipe: " + MUON),
}


def row(name: str) -> Row:
  if name not in ROWS:
    raise ValueError(f"unknown zoo row {name!r}; choose one of {sorted(ROWS)}")
  return ROWS[name]


def scaled_by_rate() -> optax.GradientTransformationExtraArgs:
  """The updates times ``update``'s ``rate=`` argument (a traced scalar: one compiled step for every rate)."""

  def update(updates, state, params=None, *, rate=1.0, **extra):
    del params, extra
    return jax.tree.map(lambda u: u * rate, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def build(name: str, w: Workload, axes: dict, rate: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """Row ``name`` for ``w`` (:func:`build_row`)."""
  return build_row(row(name), w, axes, rate)


def schedule(w: Workload, peak: float = 1.0, warmup_fraction: float = 0.1) -> optax.Schedule:
  """The zoo's rate schedule for ``w``: warmup over ``warmup_fraction`` of its steps to ``peak``, then cosine to 0."""
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, round(warmup_fraction * w.steps)), w.steps, 0.0)


def build_row(r: Row, w: Workload, axes: dict, rate: float = 1.0,
              warmup_fraction: float = 0.1) -> optax.GradientTransformationExtraArgs:
  """Row ``r`` (a registry's or any other) for ``w`` under warmup + cosine (:func:`schedule`): a linear row at peak
  rate 1, then :func:`scaled_by_rate` (its ``update`` takes the run's ``rate=``); any other at peak ``rate`` itself
  (its ``update`` takes no ``rate=``)."""
  if r.linear:
    return optax.chain(r.build(schedule(w, 1.0, warmup_fraction), w, axes), scaled_by_rate())
  return optax.with_extra_args_support(r.build(schedule(w, rate, warmup_fraction), w, axes))
