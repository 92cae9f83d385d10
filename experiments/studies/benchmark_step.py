"""Step cost: SCSGD against Nesterov SGD, AdamW and Muon on the models users train, and where SCSGD's
extra time goes.

  python -m experiments.studies.benchmark_step --config configs/studies/benchmark_step.py [--results_dir experiments/results]

Per model, every variant's jitted training step (forward, backward, update; SCSGD's with the capture) is
built through the experiments' optimizer factory and timed **in a pass of its own with Nesterov SGD's step,
the two interleaved step by step** in one process, so the machine's drift hits both alike and no third
program evicts the caches a user's one training program finds warm (with eleven variants interleaved in one
pass, every step started cold, which cost the variants with more state most). Each step is synced
and timed, with Python's garbage collector off (as ``timeit``). Every round runs the pair in a fresh random
order (``order_seed``), so neither is tied to a place in the round at any position of the window. Reported
per variant, as ratios to SGD's figure of the same pass:

- ``median``: the median step;
- ``window_mean``: for each position of the refresh window (``update_every`` steps) the median over the
  windows timed, then their mean: the cost per step with the refreshes in their true proportion, robust
  to the machine's random stalls (a refresh repeats at its position, a stall does not);
- ``slowest_position_over_median``: the slowest of those positions over the variant's median;
- ``per_window_vs_sgd``: each window's mean step over SGD's in the same window, the spread a reader reads
  the ratios' noise from. ``sgd_again``, a second copy of SGD's step, is the A/A control: any distance of
  its ratios from 1.0 is noise (or an order effect), not cost.

With ``--config.compile_only=True`` it measures instead what a user waits for before the first step: each
variant's lowering and compilation of its training step (:func:`first_step_seconds`), written to
``benchmark_compile.json``.

SCSGD's extra time is split by phase (:func:`phases`) from the ratios of variants, in ms of SGD's median
step of SCSGD's pass: ``capture`` (SGD's step that also computes the captured rows), ``apply`` (SCSGD with
the statistics never folded, its median, less the capture variant's), ``refresh`` (that variant's window
mean less its median) and ``fold`` (SCSGD's window mean less that variant's).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

import scsgd_jax
from experiments.studies import scaffold
from experiments.run import models
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.run import step as step_lib

BASELINE = "sgd"
CONTROL = "sgd_again"  # the A/A control: SGD's step timed against itself


def _model(name: str, shape: tuple, classes: int) -> nnx.Module:
  rngs = nnx.Rngs(0)
  if name in models.MODELS:  # LeNet; the head to head's char transformer (GPT-2-layout 2-D attention kernels)
    return models.MODELS[name](rngs, classes, shape)
  if name.startswith("transformer_lm"):  # ~0.4M parameters at 2 layers, the Flax examples' layout
    layers = int(name.split("_")[-1]) if name[-1].isdigit() else 2  # transformer_lm_6: 6 blocks
    return models.CharTransformer(rngs=rngs, vocab=classes, d=128, heads=4, layers=layers, context=shape[0],
                                  scan="_scan" in name)  # transformer_lm_scan_6: 6 blocks in nnx.scan
  if name == "small_resnet":
    return models.SmallResNet(rngs=rngs, num_classes=classes, channels=shape[-1])
  if name.startswith("dense_"):  # one Dense layer (n, 1024)
    return nnx.Linear(int(name.split("_")[1]), classes, rngs=rngs)
  raise ValueError(f"unknown benchmark model {name!r}")


def jitted_step(model: nnx.Module, tx, capture: str, max_rows):
  """The experiments' training step (``step.py``, not donating its buffers: every variant keeps its own) on
  ``model``'s pure state, and that state: ``(step, params, rest, opt_state)``."""
  graphdef, params, rest = step_lib.split(model)
  return step_lib.make_train_step(graphdef, tx, capture, max_rows, donate=False), params, rest, tx.init(params)


def input_axes(model: nnx.Module, name: str, shape: tuple, classes: int) -> dict:
  """The model's layouts as the README's recipe reads them, given one input (the kernels that read one array, an
  attention's query, key and value, sharing its statistics)."""
  return scsgd_jax.input_axes_nnx(model, _data(name, shape, classes, 1, 1)[0][0])


def _data(model_name: str, shape: tuple, classes: int, batch: int, n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  if len(shape) == 1 and not model_name.startswith("dense_"):  # tokens: next-token targets at every position
    x = rng.integers(0, classes, (n, batch) + shape).astype(np.int32)
    return x, np.roll(x, -1, axis=-1)
  x = rng.standard_normal((n, batch) + shape).astype(np.float32)
  return x, rng.integers(0, classes, (n, batch)).astype(np.int32)


def _interleaved(config, variants: dict[str, list], period: int, xs, ys) -> dict[str, np.ndarray]:
  """Every variant's step times (ms, warm-up window dropped), the variants run interleaved step by step."""
  key = jax.random.PRNGKey(0)
  total = period * (config.windows + 1)  # the first window is warm-up (compilation, warm-start refreshes)
  names = list(variants)
  times = {name: [] for name in names}
  order = np.random.default_rng(config.order_seed)
  gc.collect()
  gc.disable()  # as timeit does: a collection would land on whichever step is running
  try:
    for i in range(total):
      # each round in a fresh random order: no variant is tied to a place in the round at any window position
      for name in (names[j] for j in order.permutation(len(names))):
        v = variants[name]
        t = time.perf_counter()
        params, rest, opt_state, loss, _ = v[0](*v[1], xs[i % 4], ys[i % 4], jax.random.fold_in(key, i))
        jax.block_until_ready(loss)
        times[name].append(time.perf_counter() - t)
        v[1] = [params, rest, opt_state]
  finally:
    gc.enable()
  return {name: 1e3 * np.asarray(t[period:]) for name, t in times.items()}


def _figures(timed: np.ndarray, base: np.ndarray, period: int, windows: int) -> dict[str, Any]:
  """A variant's figures from its step times and SGD's of the same pass."""
  by_position = lambda t: np.median(t.reshape(windows, period), axis=0)  # each position's median over the windows
  positions = by_position(timed)
  median, window_mean = float(np.median(timed)), float(positions.mean())
  # the run's own noise: the ratio window by window (each window's mean step over SGD's in that window)
  per_window = timed.reshape(windows, period).mean(axis=1) / base.reshape(windows, period).mean(axis=1)
  return {"median_ms": median, "window_mean_ms": window_mean,
          "slowest_position_over_median": float(positions.max() / median),
          "median_vs_sgd": median / float(np.median(base)),
          "window_mean_vs_sgd": window_mean / float(by_position(base).mean()),
          "per_window_vs_sgd": [float(r) for r in per_window]}


def phases(out: dict[str, Any]) -> dict[str, float]:
  """SCSGD's extra ms per step by phase, from the ratios to SGD's step (in ms of SGD's median step of SCSGD's
  pass). Medians only of steps alike (SGD's with the capture; SCSGD never folding, whose refreshes are a few
  positions of the window): SCSGD's own median falls between its folding and its other steps, so the fold
  is read from window means. The four add up to SCSGD's window-mean ratio less 1."""
  cap, nofold, full = (out[k] for k in ("sgd_capture", "scsgd_no_fold", "scsgd"))
  sgd = full["sgd_median_ms"]
  return {"capture": (cap["median_vs_sgd"] - 1.0) * sgd,
          "apply": (nofold["median_vs_sgd"] - cap["median_vs_sgd"]) * sgd,
          "refresh": (nofold["window_mean_vs_sgd"] - nofold["median_vs_sgd"]) * sgd,
          "fold": (full["window_mean_vs_sgd"] - nofold["window_mean_vs_sgd"]) * sgd}


def first_step_seconds(fn, args) -> tuple[dict[str, float], Any]:
  """What a user waits for before the first step: tracing and lowering, then XLA's compilation (seconds); and the
  compiled program."""
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}, compiled


def _variants(config, name: str, shape: tuple, classes: int, kind: str | None = None) -> dict[str, list]:
  """Every variant's jitted step on a fresh copy of the model, and its state. ``kind`` (a model's, from
  :data:`registry.KINDS`): each variant runs its registry recipe for that kind, as the head to head's tables
  run it (e.g. Muon's head left to its AdamW part on a transformer), the variant's own settings on top; ``None``:
  the run config's settings alone (LeNet's)."""
  variants: dict[str, list] = {}
  for vname, variant in config.variants.items():
    variant = dict(variant)
    capture = variant.pop("capture", None)
    share = variant.pop("share", True)  # False: each kernel its own statistics, the attention's q/k/v too
    if kind is not None:
      variant = {**registry.recipe(variant["name"], kind).settings, **variant}
    model = _model(name, shape, classes)
    axes = input_axes(model, name, shape, classes) if share else scsgd_jax.input_axes_nnx(model)
    opt = optimizers.create(optimizers.variant(config.run, variant), input_axes=axes)
    tx, capture = opt.tx, capture or opt.capture
    fn, params, rest, opt_state = jitted_step(model, tx, capture, config.run.max_rows or None)
    variants[vname] = [fn, [params, rest, opt_state]]
  return variants


def compile_model(config: ml_collections.ConfigDict, name: str, spec: dict) -> dict[str, Any]:
  """Each variant's first-step lowering and compilation, in the config's order, and its ratio to SGD's."""
  shape, classes, batch = tuple(spec["shape"]), spec["classes"], spec["batch"]
  xs, ys = _data(name, shape, classes, batch, 1)
  out = {}
  for vname, (fn, state) in _variants(config, name, shape, classes, spec.get("kind")).items():
    out[vname] = first_step_seconds(fn, (*state, xs[0], ys[0], jax.random.PRNGKey(0)))[0]
  for figures in out.values():
    figures["total_vs_sgd"] = figures["total_s"] / out[BASELINE]["total_s"]
  return out


def run_model(config: ml_collections.ConfigDict, name: str, spec: dict) -> dict[str, Any]:
  shape, classes, batch = tuple(spec["shape"]), spec["classes"], spec["batch"]
  period = scsgd_jax.Refresh().every  # the library's refresh period
  xs, ys = _data(name, shape, classes, batch, 4)
  variants = _variants(config, name, shape, classes, spec.get("kind"))
  out, sgd_times = {}, None
  for vname in variants:
    if vname == BASELINE:
      continue
    times = _interleaved(config, {BASELINE: variants[BASELINE], vname: variants[vname]}, period, xs, ys)
    out[vname] = _figures(times[vname], times[BASELINE], period, config.windows)
    out[vname]["sgd_median_ms"] = float(np.median(times[BASELINE]))  # SGD's step in this variant's pass
    if sgd_times is None or vname == CONTROL:
      sgd_times = times[BASELINE]
  # SGD's own figures (its slowest position, its spread): from the A/A control's pass
  out = {BASELINE: _figures(sgd_times, sgd_times, period, config.windows), **out}
  for vname in out:
    # what each conditioning transformation planned (two-sided: the input side, then the output side)
    state = variants[vname][1]
    sides = [s for s in jax.tree.leaves(state[2], is_leaf=lambda x: hasattr(x, "summary")) if hasattr(s, "summary")]
    for label, side in zip(("kernels", "output_kernels"), sides):
      out[vname][label] = side.summary()
  if {"sgd_capture", "scsgd_no_fold", "scsgd"} <= set(out):
    out["phases_ms_per_step"] = phases(out)
  return out


def study(config: ml_collections.ConfigDict, results_dir: str):
  only = [m for m in config.only.split(",") if m]
  results = {
      "setup": {
          "update_every": scsgd_jax.Refresh().every,
          "windows": config.windows,
          "variants": config.variants.to_dict(),
          "models": config.models.to_dict(),
          "run": config.run.to_dict()
      },
      "models": {}
  }
  models = {**config.models, **(config.compile_models if config.compile_only else {})}
  for name, spec in models.items():
    if only and name not in only:
      continue
    if config.compile_only:
      r = results["models"][name] = compile_model(config, name, spec.to_dict())
      print(name, {k: f"{v['total_s']:.1f} s ({v['total_vs_sgd']:.2f}x)" for k, v in r.items()}, flush=True)
      continue
    results["models"][name] = run_model(config, name, spec.to_dict())
    r = results["models"][name]
    print(name, {k: round(v["window_mean_vs_sgd"], 3) for k, v in r.items() if "window_mean_vs_sgd" in v},
          r.get("phases_ms_per_step"), flush=True)
  return results, "benchmark_compile.json" if config.compile_only else "benchmark_step.json"


if __name__ == "__main__":
  scaffold.run(study)
