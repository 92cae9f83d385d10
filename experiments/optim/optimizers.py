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
from experiments.run import machine
from experiments.optim import options
from experiments.optim import peers
from experiments.optim import registry
from experiments.optim.schedules import learning_rate


class Optimizer(NamedTuple):
  """A transformation and what its training step captures for ``tx.update`` (``registry.CAPTURES``)."""

  tx: optax.GradientTransformation
  capture: str


class Forward(NamedTuple):
  """The model, for an optimizer that runs it itself (K-FAC): ``apply_fn(params, inputs) -> logits``
  and a batch of the right shapes (values unused)."""

  apply_fn: Callable
  example_batch: tuple


OPTIMIZERS = tuple(registry.REGISTRY)
NOT_IN_SUB_CONFIG = ("learning_rate", "seed", "apply_fn", "example_batch")  # from config.schedule / .seed / the model


def _placeholder_type(param: inspect.Parameter) -> Any:
  if isinstance(param.default, (bool, int, float, str)):
    return type(param.default)
  if param.annotation in (bool, int, float, str):  # an option's field (experiments.optim.options)
    return param.annotation
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
  for arg, param in peers.signature(registry.entry(name).function).parameters.items():
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
  for name in [k for k in o.keys() if k in registry.REGISTRY] + ([o.name] if o.get("name") in registry.REGISTRY else []):
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
  e = registry.entry(o.name)
  params = peers.signature(e.function).parameters
  out = {k: (v if v is not None or k not in params else params[k].default) for k, v in given.items()}
  if e.function in (scsgd_jax.scsgd, scsgd_jax.scale_by_sketched_conditioning):
    out = options.resolved(out)
  out.update(e.fixed)
  if e.prefixed:
    prefix, fn = e.prefixed
    for arg, param in inspect.signature(fn).parameters.items():
      if param.default is not inspect.Parameter.empty:
        out.setdefault(prefix + arg, param.default)
  return out


def versions(name: str) -> dict[str, str]:
  """The versions of the packages a run of optimizer ``name`` depends on."""
  return machine.package_versions(["scsgd-jax", "jax", "jaxlib", "optax", "flax", *registry.entry(name).packages])


def create(config: ml_collections.ConfigDict, forward: Forward | None = None, input_axes=None,
           refresh_apart: bool = False) -> Optimizer:
  """The optimizer ``config.optimizer.name`` with its sub-config; with ``weight_decay > 0``, ``wd * w``
  is added to every gradient first, as Caffe's solver does (so SCSGD conditions the decayed gradient).
  ``forward``: the model, for an optimizer that runs it (``train.forward(config)``). ``input_axes``: the
  model's layouts (``scsgd_jax.input_axes_nnx``), given to an optimizer that conditions on the captured
  inputs, as the README's recipe does, so that it plans every kernel at ``init``. ``refresh_apart``: its
  refreshes run apart from the step (``scsgd_jax.Refresh(apart=True)``; the caller runs
  ``scsgd_jax.refresh_conditioners``), for the studies that time the two programs."""
  o = config.optimizer
  kwargs = {k: v for k, v in (o[o.name].to_dict() if o.name in o else {}).items() if v is not None}
  e = registry.entry(o.name)
  if input_axes is not None and e.capture in ("inputs", "two_sided"):
    kwargs["input_axes"] = input_axes
  if refresh_apart:
    kwargs = options.with_refresh_apart(kwargs)
  tx = e.build(learning_rate(config), kwargs, config, forward)
  if o.weight_decay:
    tx = optax.chain(optax.add_decayed_weights(o.weight_decay), tx)
  return Optimizer(tx, e.capture)
