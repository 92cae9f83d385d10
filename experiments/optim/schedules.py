"""The learning-rate schedules a config names (``config.schedule``), as optax schedules: one module that both the
registry (Muon's AdamW part follows the run's schedule) and the optimizers' factory read."""

from __future__ import annotations

import inspect
from typing import Callable

import ml_collections
import optax


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
