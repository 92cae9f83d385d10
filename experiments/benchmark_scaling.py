"""Wide layers and many kernels: step time and state memory of scsgd's statistics, same process.

  python -m experiments.benchmark_scaling --config configs/benchmark_scaling.py [--results_dir experiments/results]

Part 1, one Dense layer ``(n, 1024)``, batch 256, float32, n in {256, 1024, 4096, 16384}: for
Nesterov SGD, Adam, and scsgd with dense (the paper's ``n x n`` EMA) and streaming (Nystrom,
``O(n r)``) statistics at rank 32 and at the default (memory-chosen) statistics: the median time of
a plain step (10 synced steps), the time of a refresh step, the mean step time over a refresh
period (``(49 plain + 1 refresh) / 50``), each as a ratio to SGD's median step measured just before,
and the optimizer-state bytes against Adam's (from shapes, ``jax.eval_shape``).

Part 2, a character transformer (2 pre-LayerNorm blocks, d = 64, 4 heads, context 64, batch 32,
14 conditioned kernels): p50 and max step time over 200 steps after the warm-up (steps 50-249),
with the kernels' refreshes staggered over the window (default) and all at once, against SGD; the
warm-up's slowest step is reported too. The three run interleaved step by step, so the machine's
drift hits all alike. SGD has no refresh, so its own max / p50 is the machine's timing noise, the
floor for the others; ``slowest_window_position_over_p50`` takes, for each of the 50 positions in
the refresh window, the median over the 4 windows timed, and reports the slowest position against
p50: a refresh's cost repeats at its position, the machine's random stalls do not.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

import scsgd_jax
from experiments import cli
from experiments import machine
from experiments import report
from experiments import models

P, BATCH, RANK, PERIOD = 1024, 256, 32, 50
FLAGS = flags.FLAGS


def _bytes(tree) -> int:
  return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def _dense_variants():
  lr = 0.01
  common = dict(rank=RANK, update_every=PERIOD, warm_start=False)
  return {
      "sgd": (optax.sgd(lr, momentum=0.9, nesterov=True), False),
      "adam": (optax.adam(1e-3), False),
      "scsgd_dense": (scsgd_jax.scsgd(lr, statistics="dense", conditioner="sketched", **common), True),
      "scsgd_streaming": (scsgd_jax.scsgd(lr, statistics="streaming", **common), True),
      "scsgd_default": (scsgd_jax.scsgd(lr, **common), True),
  }


def _time(fn, *args):
  t = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - t, out


def dense_layer(n: int, plain_steps: int = 10) -> dict:
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.standard_normal((BATCH, n)) / np.sqrt(n), jnp.float32)
  y = jnp.asarray(rng.standard_normal((BATCH, P)), jnp.float32)
  params = {"dense": {"kernel": jnp.asarray(rng.standard_normal((n, P)) / np.sqrt(n), jnp.float32)}}
  adam_bytes = _bytes(jax.eval_shape(optax.adam(1e-3).init, params))
  out = {}
  for name, (tx, needs_inputs) in _dense_variants().items():
    state_shapes = jax.eval_shape(tx.init, params)
    entry = {"state_bytes": _bytes(state_shapes), "state_vs_adam": _bytes(state_shapes) / adam_bytes}
    if name.startswith("scsgd"):
      entry["statistics_bytes"] = _bytes(state_shapes[0].statistics)
      f = state_shapes[0].factors.get("dense/kernel")
      entry["factor_rank"] = None if f is None else f.rank

    @jax.jit
    def step(params, state, x, y, tx=tx, needs_inputs=needs_inputs):
      g = jax.grad(lambda p: jnp.mean((x @ p["dense"]["kernel"] - y) ** 2))(params)
      extra = {"layer_inputs": {"dense": {"kernel": x}}} if needs_inputs else {}
      u, state = tx.update(g, state, params, **extra)
      return optax.apply_updates(params, u), state

    p, s = params, tx.init(params)
    compile_s, (p, s) = _time(step, p, s, x, y)  # count 0: compile (and a refresh)
    times = []
    for _ in range(plain_steps):
      t, (p, s) = _time(step, p, s, x, y)
      times.append(t)
    entry["plain_ms"] = 1e3 * float(np.median(times))
    if name.startswith("scsgd"):
      s = (s[0]._replace(count=jnp.asarray(PERIOD, jnp.int32)), *s[1:])  # the next step refreshes
      t, _ = _time(step, p, s, x, y)
      entry["refresh_ms"] = 1e3 * t
    else:
      entry["refresh_ms"] = entry["plain_ms"]
    entry["period_mean_ms"] = ((PERIOD - 1) * entry["plain_ms"] + entry["refresh_ms"]) / PERIOD
    entry["first_step_s"] = compile_s
    out[name] = entry
  base = out["sgd"]["plain_ms"]
  for entry in out.values():
    entry["plain_vs_sgd"] = entry["plain_ms"] / base
    entry["period_mean_vs_sgd"] = entry["period_mean_ms"] / base
  return out


# ---------------------------------------------------------------- a transformer with many kernels

VOCAB, CTX, TBATCH = 65, 64, 32


def transformer(steps: int = 200, warmup: int = PERIOD) -> dict:
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, VOCAB, (warmup + steps, TBATCH, CTX + 1)), jnp.int32)
  variants = {
      "sgd": (optax.sgd(0.1, momentum=0.9, nesterov=True), False),
      "scsgd_staggered": (scsgd_jax.scsgd(0.1), True),
      "scsgd_all_at_once": (scsgd_jax.scsgd(0.1, stagger=False), True),
  }
  built = {}
  for name, (tx, capture) in variants.items():
    model = models.CharTransformer(rngs=nnx.Rngs(0), vocab=VOCAB, context=CTX)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch, key, capture=capture):
      x, y = batch[:, :-1], batch[:, 1:]

      def loss_fn(m):
        logits, li = scsgd_jax.capture_nnx(m, x, rng=key) if capture else (m(x), None)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), li

      (loss, li), g = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      opt.update(model, g, **({"layer_inputs": li} if capture else {}))
      return loss

    built[name] = (step, model, opt, capture, [])
  for i in range(warmup + steps):  # interleaved step by step, so the machine's drift hits all alike
    for step, model, opt, _, times in built.values():
      times.append(_time(step, model, opt, ids[i], jax.random.PRNGKey(i))[0])
  out = {}
  for name, (_, _, opt, capture, times) in built.items():
    timed = np.array(times[warmup:]) * 1e3
    # Median over the periods of each step position in the refresh window: a refresh's cost repeats
    # at its position, the machine's random stalls do not.
    by_phase = [np.median(timed[ph::PERIOD]) for ph in range(min(PERIOD, timed.size))]
    p50 = float(np.median(timed))
    out[name] = {
        "p50_ms": p50, "p95_ms": float(np.percentile(timed, 95)),
        "max_ms": float(timed.max()), "max_over_p50": float(timed.max() / p50),
        "p95_over_p50": float(np.percentile(timed, 95) / p50),
        "slowest_window_position_over_p50": float(max(by_phase) / p50),
        "warmup_max_ms_excluding_compile": float(1e3 * max(times[1:warmup])),
        "kernels_conditioned": len(opt.opt_state[0].factors) if capture else 0,
    }
    if capture:
      out[name]["kernels"] = opt.opt_state[0].summary()
  base = out["sgd"]["p50_ms"]
  for entry in out.values():
    entry["p50_vs_sgd"] = entry["p50_ms"] / base
  return out


def main(argv):
  del argv
  config = cli.config()
  results = {"command": cli.command_line(), "machine": machine.describe(),
             "setup": {"p": P, "batch": BATCH, "rank": RANK, "update_every": PERIOD, "dtype": "float32"},
             "dense_layer": {}, "transformer": None}
  for n in config.dims:
    results["dense_layer"][str(n)] = dense_layer(n)
    print(n, json.dumps({k: {kk: round(vv, 3) if isinstance(vv, float) else vv for kk, vv in v.items()}
                         for k, v in results["dense_layer"][str(n)].items()}), flush=True)
  results["transformer"] = transformer(config.transformer_steps)
  print(json.dumps(results["transformer"], indent=1), flush=True)
  report.write_results(FLAGS.results_dir, results, results["command"], "benchmark_scaling.json", results["machine"])


if __name__ == "__main__":
  cli.define_flags(workdir=False, data=False, results_dir=os.path.join(os.path.dirname(__file__), "results"))
  cli.run(main)
