"""Every config value checked before data is read or anything compiles: one line naming the key.

The optimizer's own arguments are checked by the library that owns them (the optimizer is built and its
state traced from shapes); the model is traced on a batch of the dataset, so a model that cannot read it
is named before any data is read.
"""

from __future__ import annotations

import math

import jax
import ml_collections
from flax import nnx

from experiments.run import build as build_lib
from experiments.run import data as data_lib
from experiments.run import errors
from experiments.run import models
from experiments.optim import optimizers
from experiments.optim import options
from experiments.optim import schedules

ConfigError = errors.ConfigError


def check(ok: bool, key: str, message: str) -> None:
  """A :class:`ConfigError` ``config.<key> <message>`` unless ``ok``."""
  if not ok:
    raise ConfigError(f"config.{key}{'' if message.startswith('=') else ' '}{message}")


def _library_key(sub: str, kwargs: dict, e: Exception) -> str:
  """The sub-config key a library's argument error names: the one mentioned first in its message."""
  text = str(e)
  found = []
  for key in kwargs:
    at = [i for i in (0 if text.startswith(key) else -1, text.find(f"{key}="), text.find(f" {key} "),
                      text.find(f"Conditioning.{key} ")) if i >= 0]
    if key in options.FLAT:  # a library option's field, named as the option names it ("Statistics.ema_rate")
      option, field = options.FLAT[key]
      at += [i for i in (text.find(f"{options.OPTIONS[option].__name__}.{field}"), text.find(f"'{field}'")) if i >= 0]
    if at:
      found.append((min(at), key))
  return f"{sub}.{min(found)[1]}" if found else sub


_VALIDATED: set[str] = set()  # configs already checked in this process (entry points check every run's first)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks every value of ``config`` before data is read or anything compiles.

  Raises :class:`ConfigError` whose message starts with the key: ``config.<key> ...``. The
  optimizer's own arguments are checked by the library that owns them: the optimizer is built
  and its state traced from shapes (``jax.eval_shape``; nothing runs).
  """
  key = config.to_json_best_effort(sort_keys=True)
  if key in _VALIDATED:
    return
  _validate(config)
  _VALIDATED.add(key)


def _validate(config: ml_collections.ConfigDict) -> None:
  for key, value in _leaves(config.to_dict()):
    check(not isinstance(value, float) or math.isfinite(value), key, f"must be a finite number, got {value!r}.")
  try:
    data_lib.check_dataset_name(config.dataset)
  except ValueError as e:
    raise ConfigError(f"config.dataset: {e}") from None
  check(config.model in models.MODELS, "model", f"is {config.model!r}, not one of {sorted(models.MODELS)}.")
  _check_model_reads_dataset(config)
  o = config.optimizer
  check(o.name in optimizers.OPTIMIZERS, "optimizer.name",
         f"is {o.name!r}, not one of {list(optimizers.OPTIMIZERS)}.")
  for key in ("num_steps", "batch_size", "train_log_every", "eval_every", "checkpoint_every", "eval_batch_size"):
    check(isinstance(config[key], int) and config[key] > 0, key, f"must be a positive int, got {config[key]!r}.")
  for key in ("max_train_examples", "max_test_examples"):
    check(config[key] == -1 or config[key] > 0, key, f"must be -1 (all) or positive, got {config[key]!r}.")
  check(config.max_train_examples == -1 or config.batch_size <= config.max_train_examples, "batch_size",
         f"={config.batch_size} is larger than config.max_train_examples={config.max_train_examples}.")
  check(config.batch_size % jax.device_count() == 0, "batch_size",
         f"={config.batch_size} must divide over the {jax.device_count()} devices (data parallel).")
  check(config.max_rows >= 0, "max_rows", f"must be >= 0 (0: every row), got {config.max_rows!r}.")
  check(config.checkpoint_every % config.train_log_every == 0, "checkpoint_every",
         f"={config.checkpoint_every} must be a multiple of config.train_log_every={config.train_log_every} "
         "so a resumed run logs the same windows.")
  s = config.schedule
  check(s.name in schedules.SCHEDULES, "schedule.name",
         f"is {s.name!r}, not one of {sorted(schedules.SCHEDULES)}.")
  check(s.base > 0, "schedule.base", f"(the learning rate) must be positive, got {s.base!r}.")
  if o.name in o and "learning_rate" in o[o.name]:
    lr = o[o.name].learning_rate
    check(lr > 0, f"optimizer.{o.name}.learning_rate", f"must be positive, got {lr!r}.")
  check(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay!r}.")
  try:
    optimizers.learning_rate(config)(0)
  except TypeError as e:
    raise ConfigError(f"config.schedule: {e}") from None
  sub, kwargs = f"optimizer.{o.name}", dict(o[o.name]) if o.name in o else {}
  try:
    build_lib.abstract_state(build_lib.build(config, abstract=True))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.{_library_key(sub, kwargs, e)}: {str(e).splitlines()[0]}") from None


def _leaves(d: dict, prefix: str = ""):
  for k, v in d.items():
    if isinstance(v, dict):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def _check_model_reads_dataset(config: ml_collections.ConfigDict) -> None:
  """The model traced (shapes only) on a batch of the dataset: a mismatch names both, before any data is read."""
  inputs, labels = data_lib.example_batch(config.dataset, 2)
  _, num_classes = data_lib.DATASETS[config.dataset]
  what = f"{inputs.shape[1:]} {inputs.dtype}"
  try:
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_lib.model(config)), nnx.Param)
    logits = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), params, inputs)
  except Exception as e:  # whatever the model raises on inputs it cannot read
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    raise ConfigError(f"config.model: {config.model!r} cannot read dataset {config.dataset!r} (examples {what}): "
                      f"{type(e).__name__}: {first}") from None
  expected = labels.shape + (num_classes,)
  check(logits.shape == expected, "model",
         f"{config.model!r} gives outputs {logits.shape[1:]} on dataset {config.dataset!r} (examples {what}), "
         f"expected {expected[1:]}.")
