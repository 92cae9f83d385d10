"""Training and evaluation loop (Flax-examples shape): ``train_and_evaluate(config, workdir)``."""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from tqdm.auto import tqdm

import scsgd_jax
from experiments import data as data_lib
from experiments import models
from experiments import optimizers

METRICS_FILE = "metrics.jsonl"


class ConfigError(ValueError):
  """A config that cannot run (unknown dataset, model or optimizer, bad cadences)."""


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks a config before any data is read or any work compiled; raises :class:`ConfigError`."""
  try:
    data_lib.check_dataset_name(config.dataset)
  except ValueError as e:
    raise ConfigError(f"config.dataset: {e}") from None
  if config.model not in models.MODELS:
    raise ConfigError(f"config.model: unknown model {config.model!r}; choose one of {sorted(models.MODELS)}.")
  if config.optimizer.name not in optimizers.OPTIMIZERS:
    raise ConfigError(
        f"config.optimizer.name: unknown optimizer {config.optimizer.name!r}; choose one of {optimizers.OPTIMIZERS}.")
  for key in ("num_steps", "batch_size", "train_log_every", "eval_every", "checkpoint_every"):
    if int(config[key]) <= 0:
      raise ConfigError(f"config.{key} must be positive, got {config[key]}.")
  if config.checkpoint_every % config.train_log_every:
    raise ConfigError(
        f"config.checkpoint_every={config.checkpoint_every} must be a multiple of "
        f"config.train_log_every={config.train_log_every} so a resumed run logs the same windows.")


def _logits_and_inputs(graphdef, params, images, key, capture: bool, max_rows):
  model = nnx.merge(graphdef, params)
  if capture:
    return scsgd_jax.capture_nnx(model, images, rng=key, max_rows=max_rows)
  return model(images), None


def make_train_step(graphdef, tx: optax.GradientTransformation, *, capture: bool, max_rows):
  """The jitted step: loss and captured layer inputs from one forward pass, then ``tx.update``."""

  def loss_fn(params, images, labels, key):
    logits, layer_inputs = _logits_and_inputs(graphdef, params, images, key, capture, max_rows)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    err = jnp.mean(jnp.argmax(logits, -1) != labels)
    return loss, (err, layer_inputs)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, images, labels, key):
    (loss, (err, layer_inputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, images, labels, key)
    extra = {"layer_inputs": layer_inputs} if capture else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, err

  return train_step


def make_eval_fn(graphdef):
  @jax.jit
  def eval_batch(params, images, labels):
    logits = nnx.merge(graphdef, params)(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(loss), jnp.sum(jnp.argmax(logits, -1) != labels)

  def evaluate(params, split: data_lib.Split, batch_size: int) -> dict[str, float]:
    total_loss, total_err, n = 0.0, 0.0, len(split.labels)
    for start in range(0, n, batch_size):
      l, e = eval_batch(params, split.images[start:start + batch_size], split.labels[start:start + batch_size])
      total_loss += float(l)
      total_err += float(e)
    return {"test_loss": total_loss / n, "test_error": total_err / n}

  return evaluate


def _read_metrics(path: str, up_to_step: int) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r["step"] <= up_to_step]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains ``config`` and writes metrics (JSON lines), checkpoints and the config into ``workdir``.

  Resumes from the newest checkpoint in ``workdir`` if there is one: data order and
  sketch randomness depend only on (seed, step), so a resumed run continues exactly.

  Returns:
    The last metrics row (with ``train_time``: seconds spent in training steps; compilation,
    evaluation and checkpointing excluded).
  """
  validate_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=1))

  train = data_lib.load_split(config.dataset, "train", config.data_dir, config.max_train_examples, config.download)
  test = data_lib.load_split(config.dataset, "test", config.data_dir, config.max_test_examples, config.download)
  _, num_classes = data_lib.DATASETS[config.dataset]

  model = models.create_model(config.model, seed=config.seed, num_classes=num_classes,
                              channels=train.images.shape[-1])
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.as_pure(params)
  tx = optimizers.create_optimizer(config)
  opt_state = tx.init(params)
  capture = optimizers.needs_layer_inputs(config)
  train_step = make_train_step(graphdef, tx, capture=capture, max_rows=config.max_rows or None)
  evaluate = make_eval_fn(graphdef)

  ckpt = ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  step, train_time = 0, 0.0
  if ckpt.latest_step() is not None:
    target = {"params": params, "opt_state": opt_state, "train_time": 0.0}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = ckpt.restore(ckpt.latest_step(), args=ocp.args.StandardRestore(abstract))
    params, opt_state = restored["params"], restored["opt_state"]
    step, train_time = int(ckpt.latest_step()), float(restored["train_time"])
    logging.info("resumed %s from step %d", workdir, step)
  metrics_path = os.path.join(workdir, METRICS_FILE)
  rows = _read_metrics(metrics_path, step)
  with open(metrics_path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")

  base_key = jax.random.PRNGKey(config.seed)
  sum_loss, sum_err, window = jnp.zeros(()), jnp.zeros(()), 0
  last: dict[str, Any] = rows[-1] if rows else {}
  bar = tqdm(total=config.num_steps, initial=step, desc=f"{config.dataset}/{config.optimizer.name}",
             disable=not config.progress_bar, mininterval=2.0)
  t0 = None
  with open(metrics_path, "a") as metrics_file:
    while step < config.num_steps:
      idx = data_lib.batch_indices(len(train.labels), config.batch_size, step, config.seed)
      params, opt_state, loss, err = train_step(
          params, opt_state, train.images[idx], train.labels[idx], jax.random.fold_in(base_key, step))
      if t0 is None:  # the first step compiles: keep it out of the timing
        jax.block_until_ready(loss)
        t0 = time.perf_counter()
      sum_loss, sum_err, window = sum_loss + loss, sum_err + err, window + 1
      step += 1
      bar.update(1)
      log_train = step % config.train_log_every == 0
      log_test = step % config.eval_every == 0 or step == config.num_steps
      if not (log_train or log_test or step % config.checkpoint_every == 0):
        continue
      jax.block_until_ready(params)
      now = time.perf_counter()
      train_time += now - t0
      row: dict[str, Any] = {"step": step, "train_time": train_time}
      if log_train:
        row["train_loss"] = float(sum_loss) / window
        row["train_error"] = float(sum_err) / window
        sum_loss, sum_err, window = jnp.zeros(()), jnp.zeros(()), 0
      if log_test:
        row.update(evaluate(params, test, config.eval_batch_size))
      if not all(np.isfinite(v) for v in row.values()):
        raise FloatingPointError(f"non-finite metrics at step {step}: {row}")
      metrics_file.write(json.dumps(row) + "\n")
      metrics_file.flush()
      last = row
      if "test_loss" in row:
        bar.set_postfix(test_loss=f"{row['test_loss']:.4f}", test_err=f"{row['test_error']:.4f}")
      if step % config.checkpoint_every == 0 or step == config.num_steps:
        ckpt.save(step, args=ocp.args.StandardSave(
            {"params": params, "opt_state": opt_state, "train_time": train_time}))
        # Finish the (otherwise asynchronous) save before timing resumes, so background checkpoint
        # threads do not slow the next timed steps of one optimizer more than another's.
        ckpt.wait_until_finished()
      t0 = time.perf_counter()
      if config.stop_after_steps and step >= config.stop_after_steps:  # for tests of resumption
        break
  ckpt.wait_until_finished()
  bar.close()
  return last
