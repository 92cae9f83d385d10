"""Development runs (variants of SCSGD on transformers), on synthetic data only.

  python -m experiments.studies.develop --config configs/studies/develop.py --results_dir experiments/results/develop

The head to head's char transformer learns a random order-2 Markov source over the vocabulary (each
pair of previous symbols has its own next-symbol distribution, drawn from a Dirichlet); every window
is an independent stretch of the chain. Each optimizer of ``config.develop.optimizers`` runs at its
authors' settings (``registry.recipe``, the benchmark's) under the head to head's tuning
(``experiments.head_to_head.benchmark.tune``): its rate grid (``benchmark.grid`` x its authors' rate) on seed 0,
grown past a winning end, then ``benchmark.seeds`` at the chosen rate. Reported: every run's final
held-out loss and each optimizer's median over the seeds, against the source's own (the best any
model can do on the same windows) and a unigram model's. Each run is written to
``<results_dir>/runs/`` as it finishes and found there on the next invocation (same settings), so an
interrupted invocation resumes. Nothing here is a benchmark task, so settings may be chosen on it
(the head to head's rule); the head to head then confirms them.
"""

from __future__ import annotations

import ast
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import flags
from flax import nnx

from experiments.head_to_head import benchmark
from experiments.run import cli
from experiments.studies import scaffold
from experiments.run import models
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.run import report
from experiments.run import step as step_lib

FLAGS = flags.FLAGS


def markov_source(vocab: int, concentration: float, seed: int) -> np.ndarray:
  """``p[a * vocab + b, c]``: the probability of ``c`` after ``a, b``."""
  return np.random.default_rng(seed).dirichlet(np.full(vocab, concentration), size=vocab * vocab)


def sample_windows(table: np.ndarray, num: int, length: int, rng: np.random.Generator) -> np.ndarray:
  """``num`` independent stretches of ``length`` symbols of the chain, from a uniform first pair."""
  vocab = table.shape[1]
  cdf = np.cumsum(table, axis=1)
  out = np.empty((num, length), np.int32)
  out[:, :2] = rng.integers(0, vocab, (num, 2))
  for t in range(2, length):
    ctx = out[:, t - 2] * vocab + out[:, t - 1]
    out[:, t] = np.minimum((cdf[ctx] < rng.random(num)[:, None]).sum(axis=1), vocab - 1)
  return out


def source_loss(table: np.ndarray, windows: np.ndarray) -> float:
  """The source's own mean negative log-likelihood of the targets with a full context (positions >= 1)."""
  vocab = table.shape[1]
  ctx = windows[:, :-2] * vocab + windows[:, 1:-1]
  return float(-np.log(table[ctx, windows[:, 2:]]).mean())


def _heldout_loss(model_fn, params, rest, windows: np.ndarray) -> float:
  x, y = windows[:, :-1], windows[:, 1:]
  logits = model_fn(params, rest, jnp.asarray(x))
  return float(optax.softmax_cross_entropy_with_integer_labels(logits[:, 1:], jnp.asarray(y[:, 1:])).mean())


def run(config: ml_collections.ConfigDict, name: str, rate: float, seed: int, table: np.ndarray,
        heldout: np.ndarray) -> dict:
  """One run: ``name`` at peak ``rate`` on ``seed`` (initialisation and batches); its final held-out loss
  (inf if it diverged)."""
  d = config.develop
  entry = registry.entry(name)
  settings = {**entry.recipe(config.benchmark.kind).settings, **probe_settings(d.settings)}  # a probe's on top
  if entry.adam_rate:  # its AdamW part at AdamW's authors' rate (the head to head: AdamW's tuned)
    settings[entry.adam_rate] = registry.recipe("adamw", config.benchmark.kind).learning_rate
  run_config = ml_collections.ConfigDict(config.to_dict())
  run_config.schedule.base = rate
  run_config.seed = seed
  opt = optimizers.create(optimizers.variant(run_config, {"name": name, **settings}))
  model = models.MODELS[config.model](nnx.Rngs(seed), d.vocab, (d.context,))
  graphdef, params, rest = step_lib.split(model)
  step = step_lib.make_train_step(graphdef, opt.tx, opt.capture, config.max_rows or None)
  opt_state = opt.tx.init(params)
  apply = jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x))
  rng = np.random.default_rng(seed + 1)
  key = jax.random.PRNGKey(seed)
  for i in range(config.num_steps):
    batch = sample_windows(table, config.batch_size, d.context + 1, rng)
    params, rest, opt_state, _, _ = step(params, rest, opt_state, jnp.asarray(batch[:, :-1]),
                                         jnp.asarray(batch[:, 1:]), jax.random.fold_in(key, i))
  final = _heldout_loss(apply, params, rest, heldout)
  return {"optimizer": name, "learning_rate": rate, "seed": seed, "settings": settings,
          "heldout_loss": final if np.isfinite(final) else float("inf")}


def probe_settings(text: str) -> dict:
  """``'update_every=10,ema_rate=0.2'`` as ``{'update_every': 10, 'ema_rate': 0.2}`` (Python literals, read as a
  call's keyword arguments, so a value may be a tuple: ``'muon_ns_coeffs=((3.4, -4.8, 2.0), (3.0, -3.2, 1.2))'``)."""
  if not text.strip():
    return {}
  try:
    call = ast.parse(f"f({text})", mode="eval").body
  except SyntaxError:
    call = None
  if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
    items = [t.strip() for t in text.split(",") if t.strip() and "=" not in t]
    raise ValueError(f"config.develop.settings: {(items[0] if items else text)!r} is not 'name=value' "
                     "(e.g. 'update_every=10').")
  out = {}
  for k in call.keywords:
    try:
      out[k.arg] = ast.literal_eval(k.value)
    except ValueError:
      raise ValueError(f"config.develop.settings: {k.arg}={ast.unparse(k.value)} is not a Python literal "
                       "(quote a string: name='value').") from None
  return out


def _settings(config) -> dict:
  """What decides a run besides its optimizer, rate and seed (JSON-normal, as a record holds it)."""
  out = json.loads(json.dumps(config.to_dict()))
  del out["seed"], out["develop"]["optimizers"]
  if not out["develop"].get("settings"):  # no probe: the records made before probes existed stay valid
    out["develop"].pop("settings", None)
  out["benchmark"] = {"kind": out["benchmark"]["kind"]}
  return out


def _cached_run(config, name: str, rate: float, seed: int, table, heldout, results_dir: str, command: str) -> dict:
  """``run``, or its record under ``<results_dir>/runs/`` if one was written with today's settings."""
  path = os.path.join(results_dir, "runs", f"{name}_lr{rate:g}_seed{seed}.json")
  settings = _settings(config)
  if os.path.exists(path):
    with open(path) as f:
      rec = json.load(f)
    if rec.get("develop_config") == settings:
      return rec
  rec = run(config, name, rate, seed, table, heldout)
  rec["develop_config"] = settings
  report.write_results(os.path.dirname(path), rec, command, filename=os.path.basename(path))
  print(f"{name} lr {rate:g} seed {seed}: held-out loss {rec['heldout_loss']:.4f}", flush=True)
  return rec


def develop(config: ml_collections.ConfigDict, results_dir: str, command: str) -> dict:
  """Every run of ``config.develop``; writes and returns the record (``<results_dir>/develop.json``)."""
  d = config.develop
  table = markov_source(d.vocab, d.concentration, d.source_seed)
  heldout = sample_windows(table, d.heldout_windows, d.context + 1, np.random.default_rng(d.source_seed + 1))
  counts = np.bincount(heldout[:, 2:].ravel(), minlength=d.vocab) + 1.0
  anchors = {"source": source_loss(table, heldout),
             "unigram": float(-np.log(counts / counts.sum())[heldout[:, 2:]].mean())}
  b = config.benchmark
  runs, best = [], {}
  for name in d.optimizers:
    one = lambda lr, seed, name=name: _cached_run(config, name, lr, seed, table, heldout, results_dir, command)
    grid = {}  # seed 0's records by rate, as the tuning runs them
    tried = benchmark.tune(lambda lr: grid.setdefault(lr, one(lr, 0))["heldout_loss"],
                           benchmark.learning_rates(config, name), b.extend_edge)
    chosen = min(tried, key=lambda lr: (tried[lr], lr))
    runs += [grid[lr] for lr in tried]
    seeds = [one(chosen, seed) for seed in b.seeds if seed != 0]
    runs += seeds
    losses = [tried[chosen]] + [r["heldout_loss"] for r in seeds]
    best[name] = {"learning_rate": chosen, "heldout_losses": losses, "median": float(np.median(losses)),
                  "at_grid_end": chosen in (min(tried), max(tried))}
  written = {"develop_config", "command", "machine", *report.provenance()}  # what each run's own file adds
  runs = [{k: v for k, v in r.items() if k not in written} for r in runs]
  record = {"anchors": anchors, "config": config.to_dict(), "runs": runs, "best": best}
  path = report.write_results(results_dir, record, command, filename="develop.json")
  print(f"source {anchors['source']:.4f}, unigram {anchors['unigram']:.4f} (held-out, positions >= 1)")
  for k, v in sorted(best.items(), key=lambda kv: kv[1]["median"]):
    print(f"{k:12s} chosen lr {v['learning_rate']:g}: median {v['median']:.4f} over seeds "
          f"({', '.join(f'{x:.4f}' for x in v['heldout_losses'])})" + (" at a grid end" if v["at_grid_end"] else ""))
  print(f"written {path}")
  return record


def study(config: ml_collections.ConfigDict, results_dir: str) -> None:
  develop(config, results_dir, cli.command_line())  # writes its own record, run by run


if __name__ == "__main__":
  scaffold.run(study, results_dir=None)
