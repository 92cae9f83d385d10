"""One zoo cell: a workload trained by one row, one compiled step for every rate and seed of a linear row, one per
rate of any other (:mod:`rows`)."""

from __future__ import annotations

import functools
import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from experiments.zoo import rows as rows_lib
from experiments.zoo import workloads as wl

EVAL_EVERY = 20  # held-out loss every this many steps (the curve that iterations-to-target reads)
HELD_OUT = {"mnist": 1000, "tiny_shakespeare": 128}  # held-out examples (images, 64-character windows)


SMOOTH = 10  # training losses averaged before the divergence rule reads them


def diverged_by(losses: list[float], final_curve: list) -> bool:
  """The zoo's divergence rule: a non-finite training loss, the mean of the last ``SMOOTH`` training losses a nat
  above the first, or (``final_curve``: the run's held-out curve at its end) a final held-out loss a nat above the
  first training loss or not finite. One batch's spike is noise; a held-out loss early in training is not read
  (BatchNorm's running averages lag there)."""
  start, recent = losses[0], losses[-SMOOTH:]
  if not all(math.isfinite(l) for l in recent) or sum(recent) / len(recent) > start + 1.0:
    return True
  return bool(final_curve) and not final_curve[-1][1] <= start + 1.0


class Cell:
  """Workload ``name`` under row ``row`` (a zoo row's name; ``definition``: another :class:`rows.Row` under that
  name): :meth:`run` trains one (rate, seed)."""

  def __init__(self, name: str, row: str, data_dir: str, definition: Optional[rows_lib.Row] = None):
    self.w, self.row, self.definition = wl.workload(name), row, definition or rows_lib.row(row)
    self.data = wl.load(self.w.dataset, data_dir)
    self.bound = wl.Bound(self.w, wl.example(self.w))
    self.axes = self.bound.input_axes(wl.batch(self.data.train, self.w.batch, 0, 0)[0])
    self.capture = row.startswith("scsgd")
    self.held_out = wl.held_out(self.data.validation, HELD_OUT[self.w.dataset])
    self._compiled, self._eval = {}, jax.jit(self.bound.evaluate)

  def _tx_and_step(self, rate: float):
    """The row's optimizer for a run at peak ``rate`` (:func:`rows.build_row`) and its compiled step."""
    key = None if self.definition.linear else rate
    if key not in self._compiled:
      tx = rows_lib.build_row(self.definition, self.w, self.axes, 1.0 if key is None else rate)
      self._compiled[key] = tx, jax.jit(functools.partial(self._train_step, tx))
    return self._compiled[key]

  def _train_step(self, tx, params, extra, opt_state, x, y, key, rate):
    (loss, (inputs, extra)), grads = jax.value_and_grad(self.bound.loss, has_aux=True)(
        params, extra, x, y, key, self.capture)
    kwargs = {"layer_inputs": inputs} if self.capture else {}
    if self.definition.linear:
      kwargs["rate"] = rate
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), extra, opt_state, loss

  def run(self, rate: float, seed: int, steps: Optional[int] = None) -> dict:
    """Trains the workload's ``steps`` (or ``steps``) at peak ``rate`` (batch order and init from ``seed``): the
    held-out curve, the final held-out loss, and whether it diverged (:func:`diverged_by`, stopped there)."""
    params, extra = self.bound.start(seed)
    tx, train_step = self._tx_and_step(rate)
    opt_state = tx.init(params)
    curve, losses, first, diverged, start = [], [], None, False, time.time()
    steps = self.w.steps if steps is None else steps
    for step in range(steps):
      x, y = wl.batch(self.data.train, self.w.batch, step, seed)
      params, extra, opt_state, loss = train_step(params, extra, opt_state, x, y, jax.random.PRNGKey(step),
                                                  jnp.float32(rate))
      loss = float(loss)
      first = loss if first is None else first
      losses.append(loss)
      if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
        curve.append([step + 1, float(self._eval(params, extra, *self.held_out))])
      diverged = diverged_by(losses, curve if step + 1 == steps else [])
      if diverged:
        break
    final = curve[-1][1] if curve and not diverged else None
    return {"rate": rate, "seed": seed, "final_loss": final, "diverged": diverged, "first_loss": first,
            "curve": curve, "train_losses": losses, "seconds": round(time.time() - start, 2)}
