"""The optimizers of the experiments: one factory from ``config.optimizer``.

``config.optimizer.name`` picks one; ``config.optimizer[name]`` holds that optimizer's keyword
arguments beyond the learning rate, passed with ``**`` (kfac-jax examples' shape), so a sub-config
states only what differs from the library's own defaults. The learning rate comes from
``config.schedule`` (the paper's Caffe "inv" policy) for every optimizer whose sub-config does not
name its own ``learning_rate``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import ml_collections
import optax

import scsgd_jax
from experiments import machine
from experiments import peers


class Optimizer(NamedTuple):
  """A transformation and what its ``update`` needs from the training step."""

  tx: optax.GradientTransformation
  needs_layer_inputs: bool  # True: pass ``layer_inputs=`` (captured kernel inputs) to ``tx.update``
  needs_batch: bool = False  # True: pass ``batch=(inputs, labels), key=`` to ``tx.update`` (K-FAC)
  needs_output_grads: bool = False  # True: also pass ``output_grads=`` (the layers' back-propagated outputs)


def capture_mode(opt: Optimizer) -> str:
  """What a training step captures for ``opt``: ``'two_sided'``, ``'use'`` (input rows) or ``'none'``."""
  return "two_sided" if opt.needs_output_grads else "use" if opt.needs_layer_inputs else "none"


class Forward(NamedTuple):
  """The model, for an optimizer that runs it itself (K-FAC): ``apply_fn(params, inputs) -> logits``
  and a batch of the right shapes (values unused)."""

  apply_fn: Callable
  example_batch: tuple


def caffe_inv_schedule(base: float, gamma: float, power: float) -> optax.Schedule:
  """Caffe's "inv" policy, the paper's ``eta_t = base (1 + gamma t)^(-power)`` (0.01, 1e-4, 0.75)."""
  return lambda t: base * (1.0 + gamma * t) ** (-power)


def warmup_cosine_schedule(base: float, warmup_fraction: float, num_steps: int) -> optax.Schedule:
  """Linear warmup from 0 over ``warmup_fraction`` of the run, then cosine decay to 0 at ``num_steps``."""
  warmup = max(1, round(warmup_fraction * num_steps))
  return optax.warmup_cosine_decay_schedule(0.0, base, warmup, max(num_steps, warmup + 1), end_value=0.0)


SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    "inv": caffe_inv_schedule,
    "constant": lambda base: optax.constant_schedule(base),
    "warmup_cosine": warmup_cosine_schedule,  # takes the run's num_steps
}


def learning_rate(config: ml_collections.ConfigDict, base: float | None = None) -> optax.Schedule:
  """``config.schedule`` as an optax schedule (with peak ``base`` instead of ``config.schedule.base`` if given)."""
  s = dict(config.schedule)
  fn = SCHEDULES[s.pop("name")]
  if base is not None:
    s["base"] = base
  if "num_steps" in inspect.signature(fn).parameters:
    s["num_steps"] = config.num_steps
  return fn(**s)


def _scsgd(lr, kwargs, config, forward):
  return Optimizer(scsgd_jax.scsgd(lr, seed=config.seed, **kwargs), True)


def _optax(fn):
  return lambda lr, kwargs, config, forward: Optimizer(fn(**{"learning_rate": lr, **kwargs}), False)


def _kfac(lr, kwargs, config, forward):
  if forward is None:
    raise ValueError("kfac runs the model itself: optimizers.create needs forward=Forward(apply_fn, example_batch)")
  return Optimizer(peers.kfac(lr, apply_fn=forward.apply_fn, example_batch=forward.example_batch, **kwargs),
                   False, True)


def _muon_tx(lr, kwargs, config):
  """Muon; its AdamW part (embeddings, head, vectors) follows ``config.schedule`` with peak
  ``adam_learning_rate`` when that is set (the benchmark's: AdamW's own tuned rate), else Muon's rate."""
  if kwargs.get("adam_learning_rate") is not None:
    kwargs["adam_learning_rate"] = learning_rate(config, kwargs["adam_learning_rate"])
  return peers.muon(lr, **kwargs)


def _muon(lr, kwargs, config, forward):
  return Optimizer(_muon_tx(lr, kwargs, config), False)


def _scsgd_muon(lr, kwargs, config, forward):
  """SCSGD's conditioning in front of Muon (``muon_*``: Muon's arguments): Muon orthogonalizes the
  conditioned gradients of its kernels, and its AdamW part takes the conditioned ones of the rest (issue 20)."""
  muon_args = _pop_prefixed(kwargs, "muon_")
  tx = optax.chain(scsgd_jax.scale_by_sketched_conditioning(seed=config.seed, **kwargs),
                   _muon_tx(lr, muon_args, config))
  return Optimizer(tx, True)


def _pop_prefixed(kwargs: dict, prefix: str) -> dict:
  """The ``prefix``-ed entries of ``kwargs``, removed from it, without their prefix."""
  return {k[len(prefix):]: kwargs.pop(k) for k in list(kwargs) if k.startswith(prefix)}


def _scsgd_adamw(lr, kwargs, config, forward):
  """SCSGD's conditioning in front of AdamW: Adam's moments see the conditioned gradients."""
  adamw_args = _pop_prefixed(kwargs, "adamw_")
  tx = optax.chain(scsgd_jax.scale_by_sketched_conditioning(seed=config.seed, **kwargs),
                   peers.adamw(lr, **adamw_args))
  return Optimizer(tx, True)


def _scsgd_graft(lr, kwargs, config, forward):
  """SCSGD's conditioned direction at normalized RMSprop's per-layer step size (``graft_*``: its
  ``decay``, ``eps``), then Nesterov momentum at SCSGD's default: Shampoo's grafting layout (issue 20)."""
  graft_args = _pop_prefixed(kwargs, "graft_")
  momentum = inspect.signature(scsgd_jax.scsgd).parameters["momentum"].default
  tx = optax.chain(
      scsgd_jax.scale_by_grafting(scsgd_jax.scale_by_normalized_rms(**graft_args),
                                  scsgd_jax.scale_by_sketched_conditioning(seed=config.seed, **kwargs)),
      optax.sgd(lr, momentum=momentum, nesterov=True))
  return Optimizer(tx, True)


def _scsgd_two_sided(lr, kwargs, config, forward):
  """Two-sided conditioning (inputs and back-propagated outputs) grafted onto normalized RMSprop, then Nesterov
  momentum (issue 20, direction 1): ``scsgd_jax.scsgd_two_sided``.

  Two probes of issue 20's direction 4 (development task only, off unless given): ``momentum_first=True`` takes
  the Nesterov momentum of the raw gradient before conditioning and grafting (``optax.trace`` in front, the
  alias without momentum); ``condition_embeddings=False`` leaves embeddings unconditioned (their grafted
  gradient), the filter the output side uses by default."""
  kwargs = dict(kwargs)
  momentum_first = kwargs.pop("momentum_first", False)
  if not kwargs.pop("condition_embeddings", True):
    kwargs["kernel_filter"] = scsgd_jax.output_kernel_filter
  if not momentum_first:
    return Optimizer(scsgd_jax.scsgd_two_sided(lr, seed=config.seed, **kwargs), True, needs_output_grads=True)
  momentum = kwargs.pop("momentum", inspect.signature(scsgd_jax.scsgd_two_sided).parameters["momentum"].default)
  tx = optax.chain(optax.trace(momentum, nesterov=True),
                   scsgd_jax.scsgd_two_sided(lr, momentum=0.0, seed=config.seed, **kwargs))
  return Optimizer(tx, True, needs_output_grads=True)


# name -> the arguments its builder fixes (written out in the resolved settings)
FIXED = {"scsgd_two_sided_lean": {"magnitude": "sign", "split_budget": True}}


def _scsgd_two_sided_lean(lr, kwargs, config, forward):
  """Two-sided conditioning at Adam's memory (issue 20): ``scsgd_jax.scsgd_two_sided`` with the stateless sign
  magnitude (distributed Shampoo's SQRT_N grafting) and the two sides splitting the memory rule's budget."""
  return _scsgd_two_sided(lr, {**kwargs, **FIXED["scsgd_two_sided_lean"]}, config, forward)


# name -> builder(learning rate schedule, the sub-config as a dict, the whole config, the model's Forward)
BUILDERS = {
    "scsgd": _scsgd,
    "sgd": _optax(optax.sgd),
    "adam": _optax(optax.adam),
    "adamw": _optax(peers.adamw),
    "nadamw": _optax(peers.nadamw),
    "scsgd_adamw": _scsgd_adamw,
    "scsgd_graft": _scsgd_graft,
    "scsgd_muon": _scsgd_muon,
    "scsgd_muon_fresh": _scsgd_muon,  # the same, its recipe refreshing the statistics more often (peers.py)
    "scsgd_two_sided": _scsgd_two_sided,
    "scsgd_two_sided_lean": _scsgd_two_sided_lean,
    # peers from other packages (the optional `bench` extra), with their patches: experiments/peers.py
    "muon": _muon,
    "shampoo": _optax(peers.shampoo),
    "shampoo_input": _optax(peers.shampoo_input),
    "sketchy": _optax(peers.sketchy),
    "kfac": _kfac,
}
OPTIMIZERS = tuple(BUILDERS)
# name -> the function whose keyword arguments its sub-config holds
FUNCTIONS = {"scsgd": scsgd_jax.scsgd, "sgd": optax.sgd, "adam": optax.adam, "adamw": peers.adamw,
             "nadamw": peers.nadamw, "scsgd_adamw": scsgd_jax.scale_by_sketched_conditioning,
             "scsgd_graft": scsgd_jax.scale_by_sketched_conditioning,
             "scsgd_muon": scsgd_jax.scale_by_sketched_conditioning,
             "scsgd_muon_fresh": scsgd_jax.scale_by_sketched_conditioning,
             "scsgd_two_sided": scsgd_jax.scale_by_sketched_conditioning,  # both sides' arguments
             "scsgd_two_sided_lean": scsgd_jax.scale_by_sketched_conditioning,
             "muon": peers.muon, "shampoo": peers.shampoo, "shampoo_input": peers.shampoo_input,
             "sketchy": peers.sketchy, "kfac": peers.kfac}
# name -> (prefix, function): a composite's second part, whose arguments its sub-config holds prefixed
# (their defaults are written out in the resolved settings). scsgd_adamw's AdamW part is not listed: its
# committed rows' records predate this, and its recipe states every AdamW setting it changes.
PREFIXED = {"scsgd_graft": ("graft_", scsgd_jax.scale_by_normalized_rms),
            "scsgd_two_sided": ("graft_", scsgd_jax.scale_by_normalized_rms)}
NOT_IN_SUB_CONFIG = ("learning_rate", "seed", "apply_fn", "example_batch")  # from config.schedule / .seed / the model


def _placeholder_type(param: inspect.Parameter) -> Any:
  if isinstance(param.default, (bool, int, float, str)):
    return type(param.default)
  text = str(param.annotation)
  if param.default is None and "Callable" not in text and "Mapping" not in text:
    return float if ("float" in text or "complex" in text) else int if "int" in text else None
  return None


def sub_config(name: str, **values) -> ml_collections.ConfigDict:
  """The sub-config of optimizer ``name``: every scalar keyword argument of its function as a placeholder.

  A placeholder left ``None`` means "the library's default" (the factory does not pass it), so the
  config never restates a default, yet ``--config.optimizer.<name>.<arg>=...`` works on the command
  line for every argument. ``values`` are the settings that differ from the defaults.
  """
  fields = {}
  for arg, param in peers.signature(FUNCTIONS[name]).parameters.items():
    kind = _placeholder_type(param)
    if arg not in NOT_IN_SUB_CONFIG and kind is not None:
      fields[arg] = ml_collections.config_dict.placeholder(kind)
  config = ml_collections.ConfigDict(fields)
  for arg, value in values.items():
    config[arg] = value
  return config


def complete(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` with each optimizer sub-config it names (and that of ``optimizer.name``) completed by
  :func:`sub_config`'s placeholders; the values a config file sets are kept. Config files are data:
  they state only what differs from the defaults, and the command line then reaches every argument."""
  if "optimizer" not in config:
    return config
  o = config.optimizer
  for name in [k for k in o.keys() if k in FUNCTIONS] + ([o.name] if o.get("name") in FUNCTIONS else []):
    given = o[name].to_dict() if name in o else {}
    o[name] = sub_config(name, **given)
  return config


def variant(config: ml_collections.ConfigDict, settings: dict) -> ml_collections.ConfigDict:
  """A copy of run config ``config`` whose optimizer is ``settings["name"]`` with the other ``settings`` set in
  its sub-config (the benchmarks' variants: ``{"name": "scsgd", "stagger": False}``)."""
  cfg = ml_collections.ConfigDict(config.to_dict())
  values = dict(settings)
  cfg.optimizer.name = values.pop("name")
  cfg = complete(cfg)
  for key, value in values.items():
    cfg.optimizer[cfg.optimizer.name][key] = value
  return cfg


def resolved_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The settings of ``config.optimizer.name`` as it runs: every argument of its sub-config, a placeholder
  left ``None`` replaced by the library's default (what a run records, so a changed default is seen)."""
  o = config.optimizer
  given = sub_config(o.name, **(o[o.name].to_dict() if o.name in o else {})).to_dict()
  params = peers.signature(FUNCTIONS[o.name]).parameters
  out = {k: (v if v is not None or k not in params else params[k].default) for k, v in given.items()}
  if FUNCTIONS[o.name] in (scsgd_jax.scsgd, scsgd_jax.scale_by_sketched_conditioning):
    out.update(scsgd_jax.resolve_static_args(**{k: out.get(k) for k in scsgd_jax.STATIC_ARGS}))
  out.update(FIXED.get(o.name, {}))
  if o.name in PREFIXED:
    prefix, fn = PREFIXED[o.name]
    for arg, param in inspect.signature(fn).parameters.items():
      if param.default is not inspect.Parameter.empty:
        out.setdefault(prefix + arg, param.default)
  return out


def versions(name: str) -> dict[str, str]:
  """The versions of the packages a run of optimizer ``name`` depends on."""
  return machine.package_versions(["scsgd-jax", "jax", "jaxlib", "optax", "flax", *peers.PACKAGES.get(name, ())])


def create(config: ml_collections.ConfigDict, forward: Forward | None = None) -> Optimizer:
  """The optimizer ``config.optimizer.name`` with its sub-config; with ``weight_decay > 0``, ``wd * w``
  is added to every gradient first, as Caffe's solver does (so SCSGD conditions the decayed gradient).
  ``forward``: the model, for an optimizer that runs it (``train.forward(config)``)."""
  o = config.optimizer
  kwargs = {k: v for k, v in (o[o.name].to_dict() if o.name in o else {}).items() if v is not None}
  opt = BUILDERS[o.name](learning_rate(config), kwargs, config, forward)
  if o.weight_decay:
    return opt._replace(tx=optax.chain(optax.add_decayed_weights(o.weight_decay), opt.tx))
  return opt
