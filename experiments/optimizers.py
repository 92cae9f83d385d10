"""Optimizers of the experiments, built from a config: scsgd, sgd, adam."""

from __future__ import annotations

import ml_collections
import optax

import scsgd_jax

OPTIMIZERS = ("scsgd", "sgd", "adam")


def caffe_inv_schedule(base: float, gamma: float, power: float) -> optax.Schedule:
  """Caffe's "inv" policy, the paper's ``eta_t = base (1 + gamma t)^(-power)`` (0.01, 1e-4, 0.75)."""
  return lambda t: base * (1.0 + gamma * t) ** (-power)


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule:
  s = config.schedule
  if s.name == "inv":
    return caffe_inv_schedule(s.base, s.gamma, s.power)
  if s.name == "constant":
    return optax.constant_schedule(s.base)
  raise ValueError(f"unknown schedule {s.name!r}; choose 'inv' or 'constant'.")


def needs_layer_inputs(config: ml_collections.ConfigDict) -> bool:
  return config.optimizer.name == "scsgd"


def create_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The optimizer of ``config.optimizer``; with ``weight_decay > 0``, ``wd * w`` is added to every
  gradient first, as Caffe's solver does (so SCSGD conditions the decayed gradient too)."""
  o = config.optimizer
  lr = learning_rate(config)
  if o.name == "scsgd":
    tx = scsgd_jax.scsgd(lr, momentum=o.momentum, nesterov=o.nesterov, seed=config.seed, **o.scsgd)
  elif o.name == "sgd":
    tx = optax.sgd(lr, momentum=o.momentum, nesterov=o.nesterov)
  elif o.name == "adam":
    tx = optax.adam(o.adam_learning_rate)
  else:
    raise ValueError(f"unknown optimizer {o.name!r}; choose one of {OPTIMIZERS}.")
  if o.weight_decay:
    tx = optax.chain(optax.add_decayed_weights(o.weight_decay), tx)
  return tx
