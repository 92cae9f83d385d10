"""The warm start measured: bias-corrected statistics + doubling refreshes vs the paper's C_0 = I.

  python -m experiments.paper.warm_start --config configs/warm_start.py --workdir workdir/warm_start \
      --results_dir experiments/results/warm_start --data_dir ../shared/tfds

1. Convex: multinomial logistic regression on MNIST pixels (n = 785, the convex experiment's
   problem), batch 64, constant step (each method's best of one grid by final loss), 500 steps,
   full conditioner ``A = C^{1/2}`` with dense statistics; iterations until the full training loss
   first falls below each level, for SGD, the paper's start and the warm start.
2. LeNet/MNIST, the paper's recipe (configs/mnist.py): test loss at 250 and 500 iterations for
   SGD, scsgd with ``warm_start=False`` and scsgd at its defaults.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import flags

import scsgd_jax
from experiments.run import cli
from experiments.run import metrics
from experiments.paper.convex import problem as convex
from experiments.run import machine
from experiments.run import report
from experiments.run import train

LEVELS = (1.0, 0.6, 0.4, 0.3, 0.25)
STEP_SIZES = (0.03, 0.1, 0.3, 1.0, 3.0)
FLAGS = flags.FLAGS


def _convex_run(x, y, tx, steps, batch, seed=0):
  n, classes = x.shape[1], int(y.max()) + 1
  params = {"w": {"kernel": jnp.zeros((n, classes), jnp.float32)}}
  state = tx.init(params)
  xj, yj = jnp.asarray(x), jnp.asarray(y)

  @jax.jit
  def step(params, state, idx):
    xb, yb = xj[idx], yj[idx]
    g = jax.grad(lambda p: convex.loss_fn(p["w"]["kernel"], xb, yb))(params)
    u, state = tx.update(g, state, params, layer_inputs={"w": {"kernel": xb}})
    return optax.apply_updates(params, u), state

  full_loss = jax.jit(lambda p: convex.loss_fn(p["w"]["kernel"], xj, yj))
  rng = np.random.default_rng(seed)
  curve = []
  for t in range(steps):
    params, state = step(params, state, jnp.asarray(rng.integers(0, x.shape[0], batch)))
    if t % 5 == 4:
      curve.append((t + 1, float(full_loss(params))))
  return curve


def convex_part(convex_config, data_dir: str, steps: int = 500, batch: int = 64) -> dict:
  config = ml_collections.ConfigDict(convex_config.to_dict())
  config.data_dir = data_dir
  x, y = convex.load_features(config)
  x, y = x.astype(np.float32), y.astype(np.int32)
  FULL, DENSE = scsgd_jax.Conditioner(kind="full"), scsgd_jax.Statistics(kind="dense")
  methods = {
      "sgd":
          lambda lr: optax.sgd(lr),
      "scsgd_paper_start":
          lambda lr: optax.chain(
              scsgd_jax.scale_by_sketched_conditioning(scsgd_jax.Conditioning(
                  conditioner=FULL, statistics=DENSE, refresh=scsgd_jax.Refresh(warm_start=False))), optax.sgd(lr)),
      "scsgd_warm_start":
          lambda lr: optax.chain(scsgd_jax.scale_by_sketched_conditioning(
              scsgd_jax.Conditioning(conditioner=FULL, statistics=DENSE)), optax.sgd(lr)),
  }
  out = {}
  for name, make in methods.items():
    runs = {lr: _convex_run(x, y, make(lr), steps, batch) for lr in STEP_SIZES}
    finite = {lr: c for lr, c in runs.items() if np.isfinite(c[-1][1])}
    best_lr = min(finite, key=lambda lr: finite[lr][-1][1])
    curve = finite[best_lr]
    out[name] = {
        "step_size": best_lr, "final_loss": curve[-1][1],
        "iterations_to": {str(level): next((t for t, v in curve if v <= level), None) for level in LEVELS},
        "loss_at": {str(t): v for t, v in curve if t in (25, 50, 100, 250, 500)},
    }
    print(name, json.dumps(out[name]), flush=True)
  return out


def lenet_part(lenet_config, data_dir: str, workdir: str, steps: int = 500) -> dict:
  variants = {
      "sgd": ("sgd", {}),
      "scsgd_paper_start": ("scsgd", {"warm_start": False}),
      "scsgd_warm_start": ("scsgd", {}),
  }
  out = {}
  for name, (opt, overrides) in variants.items():
    cfg = ml_collections.ConfigDict(lenet_config.to_dict())
    cfg.data_dir = data_dir
    cfg.num_steps, cfg.eval_every, cfg.checkpoint_every, cfg.progress_bar = steps, 250, steps, False
    cfg.optimizer.name = opt
    cfg.optimizer.scsgd.update(overrides)
    run_dir = os.path.join(workdir, name)
    train.train_and_evaluate(cfg, run_dir)
    rows = metrics.read(os.path.join(run_dir, train.METRICS_FILE))
    out[name] = {str(r["step"]): {"test_loss": r["test_loss"], "test_error": r["test_error"]}
                 for r in rows if "test_loss" in r}
    print(name, json.dumps(out[name]), flush=True)
  return out


def write_markdown(result: dict, out_dir: str) -> str:
  lines = report.header("Warm start vs the paper's C_0 = I", result["command"], result["machine"]) + [
           "## Convex: MNIST logistic regression (n = 785), batch 64, A = C^{1/2}, each method's best constant step",
           "", "| method | step | " + " | ".join(f"iters to loss {lv}" for lv in LEVELS) + " | loss at 50 | final (500) |",
           "| --- | --- | " + " | ".join("---" for _ in LEVELS) + " | --- | --- |"]
  for name, r in result["convex"].items():
    its = " | ".join(str(r["iterations_to"][str(lv)]) for lv in LEVELS)
    lines.append(f"| {name} | {r['step_size']} | {its} | {r['loss_at'].get('50', float('nan')):.4f} | {r['final_loss']:.4f} |")
  lines += ["", "## LeNet/MNIST, the paper's recipe: test loss / error", "",
            "| method | 250 | 500 |", "| --- | --- | --- |"]
  for name, r in result["lenet"].items():
    cells = [f"{r[s]['test_loss']:.4f} / {100 * r[s]['test_error']:.2f}%" if s in r else "-" for s in ("250", "500")]
    lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
  return report.write_markdown(out_dir, lines)


def main(argv):
  del argv
  config = cli.config()
  result = {"command": cli.command_line(), "machine": machine.describe()}
  result["convex"] = convex_part(config.convex, config.data_dir, config.convex_steps, config.convex_batch)
  result["lenet"] = lenet_part(config.lenet, config.data_dir, FLAGS.workdir, config.lenet_steps)
  report.write_results(FLAGS.results_dir, result, result["command"], machine=result["machine"])
  print(open(write_markdown(result, FLAGS.results_dir)).read())


if __name__ == "__main__":
  cli.define_flags(workdir=True)
  cli.run(main)
