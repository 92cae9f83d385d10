"""The optimizers of the experiments: one factory from ``config.optimizer``.

``config.optimizer.name`` picks one; ``config.optimizer[name]`` holds that optimizer's keyword
arguments beyond the learning rate, passed with ``**`` (kfac-jax examples' shape), so a sub-config
states only what differs from the library's own defaults. The learning rate comes from
``config.schedule`` (the paper's Caffe "inv" policy) for every optimizer whose sub-config does not
name its own ``learning_rate``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import ml_collections
import optax

import scsgd_jax


class Optimizer(NamedTuple):
  """A transformation and what its ``update`` needs from the forward pass."""

  tx: optax.GradientTransformation
  needs_layer_inputs: bool  # True: pass ``layer_inputs=`` (captured kernel inputs) to ``tx.update``


def caffe_inv_schedule(base: float, gamma: float, power: float) -> optax.Schedule:
  """Caffe's "inv" policy, the paper's ``eta_t = base (1 + gamma t)^(-power)`` (0.01, 1e-4, 0.75)."""
  return lambda t: base * (1.0 + gamma * t) ** (-power)


SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    "inv": caffe_inv_schedule,
    "constant": lambda base: optax.constant_schedule(base),
}


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule:
  s = dict(config.schedule)
  return SCHEDULES[s.pop("name")](**s)


def _scsgd(lr, kwargs, config):
  return Optimizer(scsgd_jax.scsgd(lr, seed=config.seed, **kwargs), True)


def _optax(fn):
  return lambda lr, kwargs, config: Optimizer(fn(**{"learning_rate": lr, **kwargs}), False)


# name -> builder(learning rate schedule, the sub-config as a dict, the whole config)
BUILDERS = {
    "scsgd": _scsgd,
    "sgd": _optax(optax.sgd),
    "adam": _optax(optax.adam),
}
OPTIMIZERS = tuple(BUILDERS)


def create(config: ml_collections.ConfigDict) -> Optimizer:
  """The optimizer ``config.optimizer.name`` with its sub-config; with ``weight_decay > 0``, ``wd * w``
  is added to every gradient first, as Caffe's solver does (so SCSGD conditions the decayed gradient)."""
  o = config.optimizer
  kwargs = dict(o[o.name]) if o.name in o else {}
  opt = BUILDERS[o.name](learning_rate(config), kwargs, config)
  if o.weight_decay:
    return opt._replace(tx=optax.chain(optax.add_decayed_weights(o.weight_decay), opt.tx))
  return opt
