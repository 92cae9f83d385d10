"""Training and evaluation loop (Flax-examples shape): ``train_and_evaluate(config, workdir)``.

The step (``step.py``), evaluation and the loop, on every device (``devices.py``). The config is checked first
(``validate.py``), the workdir kept safe by ``workdir.py`` (lock, recorded config, stop signals,
write failures), the model and optimizer built by ``build.py``, checkpoints read and written by
``checkpoints.py``: a run never loses or mixes work (the guarantees are in ``experiments/README.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from experiments.run import build as build_lib
from experiments.run import checkpoints as ckpt_lib
from experiments.run import data as data_lib
from experiments.run import devices as devices_lib
from experiments.run import errors
from experiments.run import loop as loop_lib
from experiments.optim import optimizers
from experiments.run import validate
from experiments.run import workdir as workdir_lib

METRICS_FILE = loop_lib.METRICS_FILE


def make_eval_fn(graphdef, placement: devices_lib.DataParallel | None = None):
  @jax.jit
  def eval_batch(params, images, labels):
    logits = nnx.merge(graphdef, params)(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(loss), jnp.sum(jnp.argmax(logits, -1) != labels)

  def evaluate(params, split: data_lib.Split, batch_size: int) -> dict[str, float]:
    total_loss, total_err, n = 0.0, 0.0, len(split.labels)
    for start in range(0, n, batch_size):
      inputs, labels = split.inputs[start:start + batch_size], split.labels[start:start + batch_size]
      if placement is not None:
        inputs, labels = placement.place(inputs), placement.place(labels)
      l, e = eval_batch(params, inputs, labels)
      total_loss += float(l)
      total_err += float(e)
    predictions = split.labels.size  # one per example, or per position of a text window
    return {"test_loss": total_loss / predictions, "test_error": total_err / predictions}

  return evaluate


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str, split: str) -> dict[str, float]:
  """The newest checkpoint of ``workdir`` (a run of ``config``) evaluated on ``split`` of its dataset:
  ``{"step", "loss", "error"}``."""
  built = build_lib.build(config)
  abstract = build_lib.abstract_state(built)
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"), os.path.join(workdir, "damaged_checkpoints"))
  try:
    restored = ckpts.restore(abstract)
  finally:
    ckpts.close()
  if restored is None:
    raise errors.WorkdirError(f"{workdir} holds no checkpoint to evaluate")
  step, state, _ = restored
  return _evaluate(config, built.graphdef, state["params"], split, step)


def evaluate_start(config: ml_collections.ConfigDict, split: str) -> dict[str, float]:
  """The parameters before the first step of a run of ``config`` (its seed's init) evaluated on ``split``:
  ``{"step": 0, "loss", "error"}``, where the run started."""
  graphdef, params = nnx.split(build_lib.model(config), nnx.Param)
  return _evaluate(config, graphdef, nnx.as_pure(params), split, 0)


def _evaluate(config, graphdef, params, split: str, step: int) -> dict[str, float]:
  data = data_lib.load_split(config.dataset, split, config.data_dir, config.max_test_examples, config.download)
  out = make_eval_fn(graphdef)(params, data, config.eval_batch_size)
  return {"step": step, "loss": out["test_loss"], "error": out["test_error"]}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       allow_config_change: bool = False) -> dict[str, Any]:
  """Trains ``config`` and writes metrics (JSON lines), checkpoints and the config into ``workdir``.

  Resumes from the newest usable checkpoint in ``workdir``: data order and sketch randomness
  depend only on (seed, step), so a resumed run continues exactly.

  Returns:
    The last metrics row (with ``train_time``: seconds spent in training steps; compilation,
    evaluation and checkpointing excluded).

  Raises:
    ConfigError: a bad config value (before anything is read, written or compiled).
    WorkdirError: the workdir is held by a live run, holds another config, or cannot be written.
    DataError: the dataset is missing or damaged.
    DivergedError: non-finite metrics (names the optimizer and the step).
    Interrupted: Ctrl-C (the run stops after the step in flight and checkpoints it; the same call
      resumes; a second Ctrl-C stops at once, keeping the last checkpoint).
  """
  workdir = workdir_lib.check_path(workdir)
  validate.validate_config(config)
  # both splits opened (nothing decoded) before anything is written: a missing one is named first
  sources = tuple(data_lib.open_split(config.dataset, split, config.data_dir, config.download)
                  for split in (config.train_split, config.eval_split))
  with workdir_lib.writing(workdir, "Nothing was written"):
    os.makedirs(workdir, exist_ok=True)
    # one live run per workdir; of a run's processes, the writer holds it for them all
    lock = workdir_lib.lock(workdir) if devices_lib.is_writer() else contextlib.nullcontext()
    lock.__enter__()
  try:
    return _train(config, workdir, allow_config_change, sources)
  finally:
    lock.__exit__(None, None, None)


def _as_read_back(value):
  """``value`` as the record's JSON reads back: tuples (Newton-Schulz coefficient rows) as lists."""
  if isinstance(value, dict):
    return {k: _as_read_back(v) for k, v in value.items()}
  return [_as_read_back(v) for v in value] if isinstance(value, (tuple, list)) else value


def record(config: ml_collections.ConfigDict) -> dict:
  """What ``config.json`` holds: the config, the optimizer's resolved settings and the package versions."""
  recorded = json.loads(config.to_json_best_effort())
  for name, sub in recorded.get("optimizer", {}).items():  # a placeholder left None is the default: as absent
    if isinstance(sub, dict):
      recorded["optimizer"][name] = {k: v for k, v in sub.items() if v is not None}
  return {**recorded,
          workdir_lib.RESOLVED_KEY: {f"optimizer.{config.optimizer.name}": _as_read_back(
              optimizers.resolved_settings(config))},
          workdir_lib.VERSIONS_KEY: optimizers.versions(config.optimizer.name)}


def _train(config, workdir: str, allow_config_change: bool, sources) -> dict[str, Any]:
  recorded = record(config)
  workdir_lib.check_config(workdir, recorded, allow_config_change)
  return loop_lib.train(config, workdir, recorded, sources, make_eval_fn)
