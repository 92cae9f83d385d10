"""Every optimizer of the experiments, one record each: how it is built, what its training step captures,
the arguments its builder fixes, and how its authors run it per model kind (with the source).

Adding an optimizer is one :class:`Entry` in :data:`REGISTRY` (and a test). ``optimizers.py`` turns a config
into one of them; the head to head (``benchmark.py``) reads each entry's recipe.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Optional

import optax

import scsgd_jax
from experiments.optim import options
from experiments.optim import peers
from experiments.optim.sources import PAPER, SCSGD, ADAM, NANOGPT, NADAM, MUON, SHAMPOO, SKETCHY, KFAC, PSGD, DEVELOPED
from experiments.optim import schedules

KINDS = ("cnn", "transformer", "linear")  # the model kinds a recipe is given for
CAPTURES = ("none", "inputs", "two_sided", "model")  # what a step passes to tx.update (step.make_train_step)


class Recipe(NamedTuple):
  """How an optimizer's authors run it on one model kind: the centre of the rate grid every optimizer
  gets alike, its settings (keyword arguments of its function) and the source."""

  learning_rate: float
  settings: dict
  source: str


class Entry(NamedTuple):
  """One optimizer.

  Attributes:
    build: ``build(schedule, kwargs, config, forward) -> tx``; ``kwargs`` its sub-config's set values.
    function: the function whose keyword arguments its sub-config holds.
    capture: what its training step captures and passes to ``tx.update`` (:data:`CAPTURES`): ``'inputs'``
      (``layer_inputs=``), ``'two_sided'`` (also ``output_grads=``), ``'model'`` (``batch=, key=``: K-FAC
      runs the model itself) or ``'none'``.
    recipe: ``recipe(kind) -> Recipe``, its authors' settings per model kind (:data:`KINDS`).
    fixed: arguments its builder fixes (written out in a run's resolved settings).
    prefixed: ``(prefix, function)``: a composite's second part, whose arguments its sub-config holds
      prefixed (their defaults written out in the resolved settings).
    packages: the peer packages its runs depend on (recorded with each run).
    adam_rate: the argument that takes AdamW's tuned rate in the head to head (Muon's AdamW part).
  """

  build: Callable
  function: Callable
  capture: str
  recipe: Callable[[str], Recipe]
  fixed: dict = {}
  prefixed: Optional[tuple[str, Callable]] = None
  packages: tuple[str, ...] = ()
  adam_rate: Optional[str] = None


SHAMPOO_SETTINGS = dict(beta1=0.9, beta2=0.999, block_size=1536, matrix_epsilon=1e-8, graft="RMSPROP_NORMALIZED",
                        nesterov=False, moving_average_for_momentum=True, exponent_override=0,
                        start_preconditioning_step=51, preconditioning_compute_steps=50)
INPUT_SIDE = (" (upstream's INPUT preconditioner type, which needs best_effort_shape_interpretation off; "
              "vectors take the grafting step)")
OUTPUT_LAYER = {"cnn": "dense2", "transformer": "head", "linear": ""}  # the benchmark models' heads
# scsgd_muon_fresh: the conditioning's statistics refreshed every 10 steps at EMA rate 0.2, chosen on the
# development task (experiments/results/develop/probes/fresh_statistics, synthetic data) before any benchmark
# task ran it
FRESH_STATISTICS = {"update_every": 10, "ema_rate": 0.2}


def adam_settings(kind: str) -> dict:
  """AdamW's authors' settings beyond the rate: nanoGPT's on a transformer, optax's defaults elsewhere."""
  return dict(b2=0.99, weight_decay=0.1, decay_matrices_only=True) if kind == "transformer" else {}


def adam_source(kind: str) -> str:
  return NANOGPT if kind == "transformer" else ADAM


def _muon_settings(kind: str) -> dict:
  return {"output_layer": OUTPUT_LAYER[kind],
          **{f"adam_{k}": v for k, v in adam_settings(kind).items() if k != "decay_matrices_only"}}


def _muon_note(kind: str) -> str:
  return "" if OUTPUT_LAYER[kind] else " (a one-layer model: its only matrix, the output layer, stays on Muon)"


def _scsgd_muon_recipe(fresh: dict) -> Callable[[str], Recipe]:
  said = f"with fresher statistics ({fresh}, chosen on the development task) " if fresh else "at its defaults "
  return lambda kind: Recipe(
      0.02, {**{f"muon_{k}": v for k, v in _muon_settings(kind).items()}, **fresh},
      f"scsgd_jax's conditioning {said}in front of Muon as Muon's recipe: {MUON}{_muon_note(kind)}")


def _sketchy_recipe(kind: str) -> Recipe:
  settings = {**SHAMPOO_SETTINGS, "preconditioning_compute_steps": 1}
  conv = kind == "cnn"
  if conv:
    settings["graft_conv"] = True
  return Recipe(1e-3, settings, SKETCHY + INPUT_SIDE + (
      "; conv kernels take the grafting step alone (their small axes cost ~50 s a step on the benchmark CPU)"
      if conv else ""))


# ------------------------------------------------------------------------------------------ builders
# build(schedule, kwargs, config, forward) -> tx


def _pop_prefixed(kwargs: dict, prefix: str) -> dict:
  """The ``prefix``-ed entries of ``kwargs``, removed from it, without their prefix."""
  return {k[len(prefix):]: kwargs.pop(k) for k in list(kwargs) if k.startswith(prefix)}


def _plain(fn):
  return lambda lr, kwargs, config, forward: fn(**{"learning_rate": lr, **kwargs})


def _scsgd(lr, kwargs, config, forward):
  c, rest = options.conditioning(kwargs, seed=config.seed)
  return scsgd_jax.scsgd(lr, c, **rest)


def _kfac(lr, kwargs, config, forward):
  if forward is None:
    raise ValueError("kfac runs the model itself: optimizers.create needs forward=Forward(apply_fn, example_batch)")
  return peers.kfac(lr, apply_fn=forward.apply_fn, example_batch=forward.example_batch, **kwargs)


def _adam_part_scheduled(kwargs, config) -> dict:
  """Muon's arguments with its AdamW part's rate (``adam_learning_rate``, when set: the benchmark's, AdamW's own
  tuned rate) following ``config.schedule`` as its peak."""
  if kwargs.get("adam_learning_rate") is not None:
    kwargs["adam_learning_rate"] = schedules.learning_rate(config, kwargs["adam_learning_rate"])
  return kwargs


def _muon(lr, kwargs, config, forward):
  """Muon; its AdamW part (embeddings, head, vectors) at :func:`_adam_part_scheduled`'s rate, else Muon's."""
  return peers.muon(lr, **_adam_part_scheduled(kwargs, config))


def _scsgd_muon(lr, kwargs, config, forward):
  """SCSGD's conditioning in front of Muon (``muon_*``: Muon's arguments): Muon orthogonalizes the
  conditioned gradients of its kernels, and its AdamW part takes the conditioned ones of the rest."""
  muon_args = _pop_prefixed(kwargs, "muon_")
  c, rest = options.conditioning(kwargs, seed=config.seed)
  return optax.chain(scsgd_jax.scale_by_sketched_conditioning(c, **rest), _muon(lr, muon_args, config, forward))


def _scsgd_adamw(lr, kwargs, config, forward):
  """SCSGD's conditioning in front of AdamW: Adam's moments see the conditioned gradients."""
  adamw_args = _pop_prefixed(kwargs, "adamw_")
  c, rest = options.conditioning(kwargs, seed=config.seed)
  return optax.chain(scsgd_jax.scale_by_sketched_conditioning(c, **rest), peers.adamw(lr, **adamw_args))


def _scsgd_graft(lr, kwargs, config, forward):
  """SCSGD's conditioned direction at normalized RMSprop's per-layer step size (``graft_*``: its
  ``decay``, ``eps``), then Nesterov momentum at SCSGD's default: Shampoo's grafting layout."""
  graft_args = _pop_prefixed(kwargs, "graft_")
  momentum = inspect.signature(scsgd_jax.scsgd).parameters["momentum"].default
  c, rest = options.conditioning(kwargs, seed=config.seed)
  return optax.chain(
      scsgd_jax.contrib.scale_by_grafting(
          scsgd_jax.contrib.scale_by_normalized_rms(**graft_args), scsgd_jax.scale_by_sketched_conditioning(c, **rest)),
      optax.sgd(lr, momentum=momentum, nesterov=True))


def _scsgd_two_sided(lr, kwargs, config, forward):
  """``scsgd_jax.contrib.scsgd_two_sided``, with two probes of the development task (off unless given):
  ``momentum_first=True`` takes the Nesterov momentum of the raw gradient before conditioning and grafting;
  ``condition_embeddings=False`` leaves embeddings unconditioned (the output side's default filter)."""
  kwargs = dict(kwargs)
  momentum_first = kwargs.pop("momentum_first", False)
  if not kwargs.pop("condition_embeddings", True):
    kwargs["kernel_filter"] = scsgd_jax.contrib.output_kernel_filter
  c, rest = options.conditioning(kwargs, seed=config.seed)
  if not momentum_first:
    return scsgd_jax.contrib.scsgd_two_sided(lr, c, **rest)
  momentum = rest.pop("momentum", inspect.signature(scsgd_jax.contrib.scsgd_two_sided).parameters["momentum"].default)
  return optax.chain(optax.trace(momentum, nesterov=True), scsgd_jax.contrib.scsgd_two_sided(lr,
                                                                                             c,
                                                                                             momentum=0.0,
                                                                                             **rest))


def _scsgd_eigen(lr, kwargs, config, forward):
  """``scsgd_jax.scsgd_eigen``; ``decay_matrices_only`` as :func:`peers.adamw`'s (nanoGPT's weight decay mask)."""
  kwargs = dict(kwargs)
  if kwargs.pop("decay_matrices_only", False):
    kwargs["mask"] = peers.decay_matrices
  c, rest = options.conditioning(kwargs, seed=config.seed)
  return scsgd_jax.scsgd_eigen(lr, c, **rest)


def _eigen_recipe(full: bool) -> Callable[[str], Recipe]:
  what = ("at full rank (conditioner='full', statistics='dense': Adam in the full eigenbasis of each kernel's input "
          "correlation, EKFAC's input side; George et al. 2018)" if full else "at its defaults")
  return lambda kind: Recipe(1e-3, adam_settings(kind),
                             f"scsgd_jax.scsgd_eigen {what}: Adam in the conditioner's eigenbasis, so Adam's recipe "
                             f"(SOAP's authors, Vyas et al. 2024, run SOAP at AdamW's settings): {adam_source(kind)}")


EIGEN_FULL = {"conditioner": "full", "statistics": "dense"}
EIGEN_TWO_SIDED = {"sides": "both"}


def _scsgd_eigen_muon(lr, kwargs, config, forward):
  """``scsgd_jax.scsgd_eigen_muon`` (``muon_*``: the Muon peer's arguments, as :func:`_muon` takes them: its
  momentum ``muon_beta`` becomes the eigenbasis Adam's Nesterov first moment; the AdamW part's rate follows
  ``config.schedule``)."""
  muon_args = _adam_part_scheduled(_pop_prefixed(kwargs, "muon_"), config)
  own = {name: muon_args.pop(name) for name in ("beta", "output_layer", "weight_decay", "adam_learning_rate")
         if name in muon_args}
  c, rest = options.conditioning(kwargs, seed=config.seed)
  return scsgd_jax.scsgd_eigen_muon(lr, c, muon=muon_args, **own, **rest)


LEAN = {"magnitude": "sign", "memory_share": 0.5}  # scsgd_two_sided at Adam's memory
POLAR3 = peers.polar_express(3)
POLAR3_IN_FRONT = {f"muon_{k}": v for k, v in POLAR3.items()}
POLAR3_NOTE = ("three Newton-Schulz steps at Polar Express's coefficients (Amsel et al. 2025, arXiv:2505.16932, the "
               "first three the nanoGPT speedrun runs)")


# the anchor of what the sketch gives up: SOAP's two-sided basis (the gradients' own correlations on both sides) at
# full rank in front of Muon, the layout of SOAP-Muon, refreshed every 10 steps (SOAP's precondition_frequency,
# Vyas et al. 2024, Table 1 and its reference code's default)
SOAP_IN_FRONT = {"basis": "gradients", "sides": "both", "conditioner": "full", "statistics": "dense",
                 "update_every": 10}
SOAP_NOTE = ("the bases at full rank on both sides, from the gradients' correlations (SOAP's, Vyas et al. 2024, "
             "arXiv:2409.11321), refreshed every 10 steps (SOAP's precondition_frequency): the anchor of what the "
             "one-sided sketch gives up")


def _eigen_muon_recipe(note: str) -> Callable[[str], Recipe]:
  return lambda kind: Recipe(
      0.02, {**{f"muon_{k}": v for k, v in _muon_settings(kind).items()},
             **{k: v for k, v in adam_settings(kind).items() if k == "b2"}},
      "Adam's scaling in scsgd_jax's sketched eigenbasis of Muon's momentum, in front of Muon's orthogonalization "
      "(the SOAP-Muon layout), b2 AdamW's, as Muon's recipe: " + MUON + _muon_note(kind) + (f"; {note}" if note else ""))
CONDITIONING = scsgd_jax.scale_by_sketched_conditioning
SHAMPOO_PACKAGE = ("precondition-opt",)

# ---------------------------------------------------------------------------------------- the registry

REGISTRY: dict[str, Entry] = {
    "scsgd": Entry(_scsgd, scsgd_jax.scsgd, "inputs", lambda kind: Recipe(0.01, {}, SCSGD)),
    "sgd": Entry(_plain(optax.sgd), optax.sgd, "none", lambda kind: Recipe(0.01, {}, PAPER)),
    "adam": Entry(_plain(optax.adam), optax.adam, "none", lambda kind: Recipe(1e-3, {}, ADAM)),
    "adamw": Entry(_plain(peers.adamw), peers.adamw, "none",
                   lambda kind: Recipe(1e-3, adam_settings(kind), adam_source(kind))),
    "nadamw": Entry(_plain(peers.nadamw), peers.nadamw, "none",
                    lambda kind: Recipe(1e-3, adam_settings(kind), f"{NADAM}; {adam_source(kind)}")),
    # AdamW's part is not `prefixed`: its committed rows' records state every AdamW setting it changes
    "scsgd_adamw": Entry(_scsgd_adamw, CONDITIONING, "inputs", lambda kind: Recipe(
        1e-3, {f"adamw_{k}": v for k, v in adam_settings(kind).items()},
        f"scsgd_jax's conditioning at its defaults in front of AdamW as AdamW's recipe: {adam_source(kind)}")),
    "scsgd_graft": Entry(_scsgd_graft, CONDITIONING, "inputs", lambda kind: Recipe(
        3.16e-4, {"graft_decay": SHAMPOO_SETTINGS["beta2"]},
        "scsgd_jax's conditioning at its defaults, grafted onto normalized RMSprop as Shampoo's "
        "RMSPROP_NORMALIZED grafting (Agarwal et al. 2020; beta2 as Shampoo's), Nesterov 0.9; " + DEVELOPED),
        prefixed=("graft_", scsgd_jax.contrib.scale_by_normalized_rms)),
    "scsgd_two_sided": Entry(_scsgd_two_sided, CONDITIONING, "two_sided", lambda kind: Recipe(
        1e-3, {"graft_decay": SHAMPOO_SETTINGS["beta2"]},
        "scsgd_jax.contrib.scsgd_two_sided at its defaults: both sides' conditioning grafted onto normalized RMSprop as "
        "Shampoo's RMSPROP_NORMALIZED grafting (Agarwal et al. 2020; beta2 as Shampoo's) with Adafactor's factored "
        "second moment, Nesterov 0.9; rate "
        "centre Adam's 1e-3 (the grafted step is on Adam's scale)"),
        prefixed=("graft_", scsgd_jax.contrib.scale_by_normalized_rms)),
    "scsgd_two_sided_lean": Entry(
        lambda lr, kwargs, config, forward: _scsgd_two_sided(lr, {**kwargs, **LEAN}, config, forward),
        CONDITIONING, "two_sided", lambda kind: Recipe(
            3.16e-4, {}, "scsgd_jax.contrib.scsgd_two_sided at Adam's memory (magnitude='sign', memory_share=0.5): both "
            "sides' conditioning at the per-layer norm of sign(g), distributed Shampoo's SQRT_N grafting (Anil et "
            "al. 2020), Nesterov 0.9; " + DEVELOPED), fixed=LEAN),
    "scsgd_eigen": Entry(_scsgd_eigen, scsgd_jax.scsgd_eigen, "inputs", _eigen_recipe(False)),
    "scsgd_eigen_full": Entry(
        lambda lr, kwargs, config, forward: _scsgd_eigen(lr, {**kwargs, **EIGEN_FULL}, config, forward),
        scsgd_jax.scsgd_eigen, "inputs", _eigen_recipe(True), fixed=EIGEN_FULL),
    # EKFAC's two factors sketched: the inputs' and the captured output gradients' eigenbases (a probe of the
    # development task's directions)
    "scsgd_eigen_two_sided": Entry(
        lambda lr, kwargs, config, forward: _scsgd_eigen(lr, {**kwargs, **EIGEN_TWO_SIDED}, config, forward),
        scsgd_jax.scsgd_eigen, "two_sided", lambda kind: Recipe(
            1e-3, adam_settings(kind), "scsgd_jax.scsgd_eigen with sides='both' (the inputs' and the output "
            "gradients' eigenbases: EKFAC's two factors, George et al. 2018, sketched): Adam in the two-sided "
            f"eigenbasis, so Adam's recipe: {adam_source(kind)}"), fixed=EIGEN_TWO_SIDED),
    "scsgd_eigen_muon": Entry(_scsgd_eigen_muon, scsgd_jax.scale_by_eigenbasis_adam, "inputs", _eigen_muon_recipe(""),
                              prefixed=("muon_", peers.muon), adam_rate="muon_adam_learning_rate"),
    # the step rule's form: three Newton-Schulz steps (chosen on the development task) bring its step near Muon's
    "scsgd_eigen_muon_polar3": Entry(
        lambda lr, kwargs, config, forward: _scsgd_eigen_muon(lr, {**kwargs, **POLAR3_IN_FRONT}, config, forward),
        scsgd_jax.scale_by_eigenbasis_adam, "inputs", _eigen_muon_recipe(POLAR3_NOTE + ", chosen on the development "
                                                                          "task (Muon's five steps replaced)"),
        fixed=POLAR3_IN_FRONT, prefixed=("muon_", peers.muon), adam_rate="muon_adam_learning_rate"),
    "scsgd_eigen_muon_soap": Entry(
        lambda lr, kwargs, config, forward: _scsgd_eigen_muon(lr, {**kwargs, **SOAP_IN_FRONT}, config, forward),
        scsgd_jax.scale_by_eigenbasis_adam, "inputs", _eigen_muon_recipe(SOAP_NOTE), fixed=SOAP_IN_FRONT,
        prefixed=("muon_", peers.muon), adam_rate="muon_adam_learning_rate"),
    "psgd_kron": Entry(_plain(peers.psgd_kron), peers.psgd_kron, "none", lambda kind: Recipe(
        5e-4, {k: v for k, v in adam_settings(kind).items() if k != "b2"}, PSGD), packages=("psgd-jax",)),
    "muon": Entry(_muon, peers.muon, "none",
                  lambda kind: Recipe(0.02, _muon_settings(kind), MUON + _muon_note(kind)),
                  adam_rate="adam_learning_rate"),
    "muon_polar3": Entry(lambda lr, kwargs, config, forward: _muon(lr, {**kwargs, **POLAR3}, config, forward),
                         peers.muon, "none",
                         lambda kind: Recipe(0.02, _muon_settings(kind), MUON + _muon_note(kind) + "; " + POLAR3_NOTE
                                             + " (a step-cost variant: on the development task Muon keeps its five)"),
                         fixed=POLAR3, adam_rate="adam_learning_rate"),
    "scsgd_muon": Entry(_scsgd_muon, CONDITIONING, "inputs", _scsgd_muon_recipe({}),
                        adam_rate="muon_adam_learning_rate"),
    "scsgd_muon_fresh": Entry(_scsgd_muon, CONDITIONING, "inputs", _scsgd_muon_recipe(FRESH_STATISTICS),
                              adam_rate="muon_adam_learning_rate"),
    "shampoo": Entry(_plain(peers.shampoo), peers.shampoo, "none",
                     lambda kind: Recipe(1e-3, dict(SHAMPOO_SETTINGS), SHAMPOO), packages=SHAMPOO_PACKAGE),
    "shampoo_input": Entry(_plain(peers.shampoo_input), peers.shampoo_input, "none",
                           lambda kind: Recipe(1e-3, dict(SHAMPOO_SETTINGS), SHAMPOO + "; input side only" + INPUT_SIDE),
                           packages=SHAMPOO_PACKAGE),
    "sketchy": Entry(_plain(peers.sketchy), peers.sketchy, "none", _sketchy_recipe, packages=SHAMPOO_PACKAGE),
    "kfac": Entry(_kfac, peers.kfac, "model", lambda kind: Recipe(0.01, dict(norm_constraint=1e-3), KFAC),
                  packages=("kfac-jax",)),
}


def entry(name: str) -> Entry:
  if name not in REGISTRY:
    raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(REGISTRY)}")
  return REGISTRY[name]


def recipe(name: str, kind: str) -> Recipe:
  """How the authors of optimizer ``name`` run it on a model of ``kind`` (one of :data:`KINDS`)."""
  if kind not in KINDS:
    raise ValueError(f"unknown model kind {kind!r}; choose one of {KINDS}")
  return entry(name).recipe(kind)
