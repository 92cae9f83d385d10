"""Cost of a jitted LeNet train step (batch 64, float32): scsgd defaults vs Nesterov SGD, same process.

  python -m experiments.benchmark_step --config configs/benchmark_step.py [--results_dir experiments/results]

Each optimizer's step is the full training step (forward with capture, backward, update).
Optimizers are interleaved block by block so drift of the machine hits all alike. Reported per
optimizer: the mean step time over whole blocks of ``--block`` steps dispatched as training does
(asynchronously, one sync per block), which includes the refresh steps (every ``update_every``
steps) in their true proportion; and the median of single synced steps. Ratios are against SGD
in the same run; the target is on the block mean.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import optax
from absl import flags
from flax import nnx

import scsgd_jax
from experiments import cli
from experiments import machine
from experiments import report
from experiments import models
from experiments import train

BASELINE = "sgd"
FLAGS = flags.FLAGS


def _variants():
  lr = 0.01
  return {
      "sgd": (optax.sgd(lr, momentum=0.9, nesterov=True), False, None),
      "scsgd": (scsgd_jax.scsgd(lr), True, 256),
      "scsgd_all_patches": (scsgd_jax.scsgd(lr), True, None),
      "scsgd_paper": (scsgd_jax.scsgd(lr, statistics="dense", warm_start=False, stagger=False), True, 256),
      "scsgd_full_conditioner": (scsgd_jax.scsgd(lr, conditioner="full"), True, 256),
  }


def run(steps: int, block: int, batch: int = 64, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  images = rng.random((steps + 1, batch, 28, 28, 1), np.float32)
  labels = rng.integers(0, 10, (steps + 1, batch)).astype(np.int32)
  variants = {}
  for name, (tx, capture, max_rows) in _variants().items():
    model = models.LeNet(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.as_pure(params)
    state = tx.init(params)
    step_fn = train.make_train_step(graphdef, tx, capture=capture, max_rows=max_rows)
    key = jax.random.PRNGKey(0)
    for i in range(3):  # compile + warm-up (count 0 is a refresh step)
      params, state, loss, _ = step_fn(params, state, images[i], labels[i], jax.random.fold_in(key, i))
    jax.block_until_ready(loss)
    variants[name] = dict(fn=step_fn, params=params, state=state, times=[], blocks=[], done=3)
  names = list(variants)
  for _ in range(0, steps, block):
    for name in names:
      v = variants[name]
      # (a) a block as training runs it: async dispatch, one sync at the end; includes the block's refresh.
      t = time.perf_counter()
      for _ in range(block):
        i = v["done"] % steps
        v["params"], v["state"], loss, _ = v["fn"](v["params"], v["state"], images[i], labels[i],
                                                   jax.random.fold_in(key, v["done"]))
        v["done"] += 1
      jax.block_until_ready((v["params"], loss))
      v["blocks"].append((time.perf_counter() - t) / block)
      # (b) single synced steps, for the median step.
      for _ in range(block // 5):
        i = v["done"] % steps
        t = time.perf_counter()
        v["params"], v["state"], loss, _ = v["fn"](v["params"], v["state"], images[i], labels[i],
                                                   jax.random.fold_in(key, v["done"]))
        jax.block_until_ready((v["params"], loss))
        v["times"].append(time.perf_counter() - t)
        v["done"] += 1
  out = {}
  base_med = float(np.median(variants[BASELINE]["times"]))
  base_mean = float(np.mean(variants[BASELINE]["blocks"]))
  for name, v in variants.items():
    t = np.asarray(v["times"])
    b = np.asarray(v["blocks"])
    out[name] = {
        "mean_ms_in_blocks": 1e3 * float(np.mean(b)),
        "median_ms_synced_step": 1e3 * float(np.median(t)),
        "mean_ratio_vs_sgd": float(np.mean(b)) / base_mean,
        "median_ratio_vs_sgd": float(np.median(t)) / base_med,
        "blocks_timed": int(b.size),
        "steps_per_block": block,
        "synced_steps_timed": int(t.size),
    }
    state = v["state"][0] if name != BASELINE else None  # scsgd = chain(conditioning, sgd)
    if state is not None:
      out[name]["kernels"] = state.summary()
  return out


def main(argv):
  del argv
  config = cli.config()
  results = run(config.steps, config.block)
  record = {
      "command": cli.command_line(),
      "machine": machine.describe(),
      "model": "LeNet (paper, Section 3), batch 64, float32",
      "baseline": "optax.sgd(0.01, momentum=0.9, nesterov=True)",
      "scsgd": "scsgd_jax.scsgd(0.01) defaults: rank 32, statistics chosen by memory (each variant's 'kernels' "
               "says how), warm start, staggered refreshes every 50; scsgd_paper: statistics='dense', "
               "warm_start=False, stagger=False (the paper's recipe); full conditioner: dense statistics, C^{1/2} "
               "for every layer; capture max_rows per layer as named",
      "target": "scsgd mean_ratio_vs_sgd <= 1.25",
      "results": results,
  }
  report.write_results(FLAGS.results_dir, record, record["command"], "benchmark_step.json", record["machine"])
  for name, r in results.items():
    print(f"{name:24s} mean in blocks {r['mean_ms_in_blocks']:7.2f} ms ({r['mean_ratio_vs_sgd']:.3f}x)  "
          f"median synced step {r['median_ms_synced_step']:7.2f} ms ({r['median_ratio_vs_sgd']:.3f}x)")


if __name__ == "__main__":
  cli.define_flags(workdir=False, data=False, results_dir=os.path.join(os.path.dirname(__file__), "results"))
  cli.run(main)
