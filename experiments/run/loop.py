"""The training loop of one run, in named steps: the data read and checked, the state restored, the run's files
written, then the steps, each boundary logging, evaluating and checkpointing as the config says (``train.py``
opens the run; the guarantees are in ``experiments/README.md``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from tqdm.auto import tqdm

from experiments.run import build as build_lib
from experiments.run import checkpoints as ckpt_lib
from experiments.run import data as data_lib
from experiments.run import devices as devices_lib
from experiments.run import errors
from experiments.run import metrics as metrics_lib
from experiments.run import step as step_lib
from experiments.run import validate
from experiments.run import workdir as workdir_lib

METRICS_FILE = "metrics.jsonl"


def read_data(config, sources) -> tuple[data_lib.Split, data_lib.Split]:
  """``(train, test)`` decoded from ``sources``, the batch size checked against the training examples (an image
  dataset's before decoding; a text's windows, known once read, after)."""
  train_src, eval_src = sources
  text = config.dataset in data_lib.TEXT
  if not text:
    available = len(train_src) if config.max_train_examples < 0 else min(len(train_src), config.max_train_examples)
    validate.check(config.batch_size <= available, "batch_size",
                   f"={config.batch_size} is larger than the {available} training examples of {config.dataset}.")
  train = data_lib.decode(train_src, config.dataset, config.train_split, config.max_train_examples)
  if text:
    validate.check(config.batch_size <= len(train.labels), "batch_size",
                   f"={config.batch_size} is larger than the {len(train.labels)} training windows of "
                   f"{config.dataset}.")
  return train, data_lib.decode(eval_src, config.dataset, config.eval_split, config.max_test_examples)


class Run:
  """One run's state between steps: the parameters, optimizer state, step, train-metrics window and timings."""

  def __init__(self, config, workdir: str, recorded: dict, data: tuple[data_lib.Split, data_lib.Split],
               evaluate_fn):
    self.config, self.workdir, self.name = config, workdir, config.optimizer.name
    self.train, self.test = data
    graphdef, params, opt, _ = build_lib.build(config)
    opt_state = opt.tx.init(params)
    self.train_step = step_lib.make_train_step(graphdef, opt.tx, opt.capture, config.max_rows or None)
    self.rest = nnx.as_pure(nnx.State({}))  # the experiments' models keep no state but their parameters
    self.placement = devices_lib.DataParallel()
    self.evaluate = evaluate_fn(graphdef, self.placement)
    self.ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"),
                                      os.path.join(workdir, "damaged_checkpoints"))
    self.step, self.progress = 0, ckpt_lib.Progress(0.0)
    self.params, self.opt_state = self._restored(params, opt_state)
    self.saved_step = self.step
    self.writer = devices_lib.is_writer()  # process 0 writes the run's files (the checkpoints: orbax, once)
    self.metrics_path = os.path.join(workdir, METRICS_FILE)
    self.last: dict[str, Any] = self._write_run_files(recorded)

  def kept(self) -> str:
    return (f"{self.workdir} keeps the checkpoint of step {self.saved_step} and its metrics" if self.saved_step
            else f"{self.workdir} holds no checkpoint yet")

  def _restored(self, params, opt_state):
    """The newest checkpoint's parameters and optimizer state (and its step and progress), else the fresh ones,
    placed on every device."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.placement.state_sharding),
                            {"params": params, "opt_state": opt_state})
    try:
      restored = self.ckpts.restore(abstract)
    except BaseException:
      self.ckpts.close()  # stops Orbax's threads before the one-line error (else they print after it)
      raise
    if restored is not None:
      self.step, state, self.progress = restored
      params, opt_state = state["params"], state["opt_state"]
      logging.info("resumed %s from step %d", self.workdir, self.step)
    return self.placement.replicate((params, opt_state))

  def _write_run_files(self, recorded: dict) -> dict[str, Any]:
    """The recorded config written, the metrics cut back to the checkpoint; the last metrics row kept."""
    config_path = os.path.join(self.workdir, workdir_lib.CONFIG_FILE)
    rows = metrics_lib.read(self.metrics_path, up_to_step=self.step)
    if self.writer:
      with workdir_lib.writing(config_path, self.kept()):
        workdir_lib.write_json_atomic(config_path, json.dumps(recorded, indent=1))
      if not metrics_lib.is_clean(self.metrics_path, rows):  # rows past the checkpoint, or a torn last line
        with workdir_lib.writing(self.metrics_path, self.kept()):
          metrics_lib.write(self.metrics_path, rows)
    return rows[-1] if rows else {}

  def loop(self) -> dict[str, Any]:
    """The steps from the restored one to ``config.num_steps``: the last metrics row."""
    config = self.config
    base_key = jax.random.PRNGKey(config.seed)
    self.train_time = self.progress.train_time
    # the train-metrics window in flight at the checkpoint (a resume between two log steps logs the same rows)
    self.sum_loss, self.sum_err = (jnp.asarray(v, jnp.float32) for v in self.progress.window[:2])
    self.window = self.progress.window[2]
    bar = tqdm(total=config.num_steps, initial=self.step, desc=f"{config.dataset}/{self.name}",
               disable=not (config.progress_bar and self.writer), mininterval=2.0)
    self.t0, self.compile_time, t_first = None, 0.0, time.perf_counter()
    failed = True
    try:
      with (workdir_lib.writing(self.metrics_path, self.kept()),
            metrics_lib.Appender(self.metrics_path) if self.writer else metrics_lib.Discard() as metrics_file,
            workdir_lib.StopRequest() as stop):
        while self.step < config.num_steps:
          loss = self._step(base_key)
          if self.t0 is None:  # the first step compiles: keep it out of the timing
            jax.block_until_ready(loss)
            self.t0 = time.perf_counter()
            self.compile_time = self.t0 - t_first
          bar.update(1)
          self._boundary(metrics_file, bar, stop.signal)
          if config.stop_after_steps and self.step >= config.stop_after_steps:  # for tests of resumption
            break
      failed = False
    except KeyboardInterrupt:
      raise workdir_lib.stopped(None, self.step, self.kept()) from None
    finally:
      bar.close()
      try:
        self.ckpts.close()
      except Exception:
        if not failed:  # else the first failure is the one to report
          raise
    return self.last

  def _step(self, base_key):
    """One training step on this step's batch; its loss."""
    config, p = self.config, self.placement
    idx = data_lib.batch_indices(len(self.train.labels), config.batch_size, self.step, config.seed)
    self.params, self.rest, self.opt_state, loss, err = self.train_step(
        self.params, self.rest, self.opt_state, p.shard_rows(self.train.inputs, idx),
        p.shard_rows(self.train.labels, idx), jax.random.fold_in(base_key, self.step))
    self.sum_loss, self.sum_err, self.window = self.sum_loss + loss, self.sum_err + err, self.window + 1
    self.step += 1
    return loss

  def _boundary(self, metrics_file, bar, stopping) -> None:
    """After a step: the train metrics, the evaluation and the checkpoint the config asks for now, and a stop
    asked for (``stopping``, read once: a signal landing later in this block is honoured at the next step's
    boundary, which then saves)."""
    config, step = self.config, self.step
    log_train = step % config.train_log_every == 0
    log_test = step % config.eval_every == 0 or step == config.num_steps
    save = step % config.checkpoint_every == 0 or step == config.num_steps or stopping is not None
    if not (log_train or log_test or save):
      return
    jax.block_until_ready(self.params)
    self.train_time += time.perf_counter() - self.t0
    row = self._row(log_train, log_test)
    if log_train or log_test or step % config.checkpoint_every == 0:
      metrics_file.append(row)
      self.last = row
    if "test_loss" in row:
      bar.set_postfix(test_loss=f"{row['test_loss']:.4f}", test_err=f"{row['test_error']:.4f}")
    if save:
      with workdir_lib.writing(self.ckpts.directory, self.kept()):
        self.ckpts.save(step, {"params": self.params, "opt_state": self.opt_state},
                        ckpt_lib.Progress(self.train_time, (float(self.sum_loss), float(self.sum_err), self.window)))
      self.saved_step = step
    if stopping is not None:
      self.ckpts.wait()  # the save is on disk before the run says so
      raise workdir_lib.stopped(stopping, step, self.kept())
    self.t0 = time.perf_counter()

  def _row(self, log_train: bool, log_test: bool) -> dict[str, Any]:
    """The metrics row of this step (the train window's means, the evaluation); non-finite metrics stop the run."""
    row: dict[str, Any] = {"step": self.step, "train_time": self.train_time, "compile_time": self.compile_time}
    if log_train:
      row["train_loss"] = float(self.sum_loss) / self.window
      row["train_error"] = float(self.sum_err) / self.window
      self.sum_loss, self.sum_err, self.window = jnp.zeros(()), jnp.zeros(()), 0
    if log_test:
      row.update(self.evaluate(self.params, self.test, self.config.eval_batch_size))
    bad = [k for k, v in row.items() if not np.isfinite(v)]
    if bad:
      raise errors.DivergedError(self.name, self.step, (
          f"{self.name} diverged at step {self.step} ({', '.join(f'{k}={row[k]}' for k in bad)}); {self.kept()}"))
    return row


def train(config, workdir: str, recorded: dict, sources, evaluate_fn) -> dict[str, Any]:
  """The run of ``config`` in ``workdir`` (its config ``recorded``; ``evaluate_fn(graphdef, placement)`` makes its
  evaluation): the last metrics row."""
  return Run(config, workdir, recorded, read_data(config, sources), evaluate_fn).loop()
