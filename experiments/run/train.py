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
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from tqdm.auto import tqdm

from experiments.run import build as build_lib
from experiments.run import checkpoints as ckpt_lib
from experiments.run import data as data_lib
from experiments.run import devices as devices_lib
from experiments.run import errors
from experiments.run import metrics as metrics_lib
from experiments.optim import optimizers
from experiments.run import step as step_lib
from experiments.run import validate
from experiments.run import workdir as workdir_lib

METRICS_FILE = "metrics.jsonl"


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
  data = data_lib.load_split(config.dataset, split, config.data_dir, config.max_test_examples, config.download)
  out = make_eval_fn(built.graphdef)(state["params"], data, config.eval_batch_size)
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
  name = config.optimizer.name
  train_src, eval_src = sources
  text = config.dataset in data_lib.TEXT  # one record holds the text: its examples are windows, known once read
  if not text:  # checked before decoding
    available = len(train_src) if config.max_train_examples < 0 else min(len(train_src), config.max_train_examples)
    validate.check(config.batch_size <= available, "batch_size",
           f"={config.batch_size} is larger than the {available} training examples of {config.dataset}.")
  train = data_lib.decode(train_src, config.dataset, config.train_split, config.max_train_examples)
  if text:
    validate.check(config.batch_size <= len(train.labels), "batch_size",
           f"={config.batch_size} is larger than the {len(train.labels)} training windows of {config.dataset}.")
  test = data_lib.decode(eval_src, config.dataset, config.eval_split, config.max_test_examples)
  graphdef, params, opt, _ = build_lib.build(config)
  opt_state = opt.tx.init(params)
  train_step = step_lib.make_train_step(graphdef, opt.tx, opt.capture, config.max_rows or None)
  rest = nnx.as_pure(nnx.State({}))  # the experiments' models keep no state but their parameters
  placement = devices_lib.DataParallel()
  evaluate = make_eval_fn(graphdef, placement)

  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"), os.path.join(workdir, "damaged_checkpoints"))
  step, progress = 0, ckpt_lib.Progress(0.0)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement.state_sharding),
                          {"params": params, "opt_state": opt_state})
  try:
    restored = ckpts.restore(abstract)
  except BaseException:
    ckpts.close()  # stops Orbax's threads before the one-line error (else they print after it)
    raise
  if restored is not None:
    step, state, progress = restored
    params, opt_state = state["params"], state["opt_state"]
    logging.info("resumed %s from step %d", workdir, step)
  params, opt_state = placement.replicate((params, opt_state))
  saved_step = step

  def kept() -> str:
    return (f"{workdir} keeps the checkpoint of step {saved_step} and its metrics" if saved_step
            else f"{workdir} holds no checkpoint yet")

  writer = devices_lib.is_writer()  # process 0 writes the run's files (the checkpoints: orbax, once)
  config_path = os.path.join(workdir, workdir_lib.CONFIG_FILE)
  metrics_path = os.path.join(workdir, METRICS_FILE)
  rows = metrics_lib.read(metrics_path, up_to_step=step)
  if writer:
    with workdir_lib.writing(config_path, kept()):
      workdir_lib.write_json_atomic(config_path, json.dumps(recorded, indent=1))
    if not metrics_lib.is_clean(metrics_path, rows):  # rows past the checkpoint, or a torn last line
      with workdir_lib.writing(metrics_path, kept()):
        metrics_lib.write(metrics_path, rows)

  base_key = jax.random.PRNGKey(config.seed)
  train_time = progress.train_time
  # the train-metrics window in flight at the checkpoint (a resume between two log steps logs the same rows)
  sum_loss, sum_err = (jnp.asarray(v, jnp.float32) for v in progress.window[:2])
  window = progress.window[2]
  last: dict[str, Any] = rows[-1] if rows else {}
  bar = tqdm(total=config.num_steps, initial=step, desc=f"{config.dataset}/{name}",
             disable=not (config.progress_bar and writer), mininterval=2.0)
  t0, compile_time = None, 0.0
  t_first = time.perf_counter()
  failed = True
  try:
    with (workdir_lib.writing(metrics_path, kept()),
          metrics_lib.Appender(metrics_path) if writer else metrics_lib.Discard() as metrics_file,
          workdir_lib.StopRequest() as stop):
      while step < config.num_steps:
        idx = data_lib.batch_indices(len(train.labels), config.batch_size, step, config.seed)
        params, rest, opt_state, loss, err = train_step(
            params, rest, opt_state, placement.shard_rows(train.inputs, idx), placement.shard_rows(train.labels, idx),
            jax.random.fold_in(base_key, step))
        if t0 is None:  # the first step compiles: keep it out of the timing
          jax.block_until_ready(loss)
          t0 = time.perf_counter()
          compile_time = t0 - t_first
        sum_loss, sum_err, window = sum_loss + loss, sum_err + err, window + 1
        step += 1
        bar.update(1)
        log_train = step % config.train_log_every == 0
        log_test = step % config.eval_every == 0 or step == config.num_steps
        # read once: a signal landing later in this block (evaluation, save) is honoured at the next
        # step's boundary, which then saves
        stopping = stop.signal
        save = step % config.checkpoint_every == 0 or step == config.num_steps or stopping is not None
        if not (log_train or log_test or save):
          continue
        jax.block_until_ready(params)
        now = time.perf_counter()
        train_time += now - t0
        row: dict[str, Any] = {"step": step, "train_time": train_time, "compile_time": compile_time}
        if log_train:
          row["train_loss"] = float(sum_loss) / window
          row["train_error"] = float(sum_err) / window
          sum_loss, sum_err, window = jnp.zeros(()), jnp.zeros(()), 0
        if log_test:
          row.update(evaluate(params, test, config.eval_batch_size))
        bad = [k for k, v in row.items() if not np.isfinite(v)]
        if bad:
          raise errors.DivergedError(name, step, (
              f"{name} diverged at step {step} ({', '.join(f'{k}={row[k]}' for k in bad)}); "
              f"{kept()}"))
        if log_train or log_test or step % config.checkpoint_every == 0:
          metrics_file.append(row)
          last = row
        if "test_loss" in row:
          bar.set_postfix(test_loss=f"{row['test_loss']:.4f}", test_err=f"{row['test_error']:.4f}")
        if save:
          with workdir_lib.writing(ckpts.directory, kept()):
            ckpts.save(step, {"params": params, "opt_state": opt_state},
                       ckpt_lib.Progress(train_time, (float(sum_loss), float(sum_err), window)))
          saved_step = step
        if stopping is not None:
          ckpts.wait()  # the save is on disk before the run says so
          raise workdir_lib.stopped(stopping, step, kept())
        t0 = time.perf_counter()
        if config.stop_after_steps and step >= config.stop_after_steps:  # for tests of resumption
          break
    failed = False
  except KeyboardInterrupt:
    raise workdir_lib.stopped(None, step, kept()) from None
  finally:
    bar.close()
    try:
      ckpts.close()
    except Exception:
      if not failed:  # else the first failure is the one to report
        raise
  return last
