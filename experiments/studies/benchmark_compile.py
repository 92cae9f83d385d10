"""What a user waits for before the first step, and how it grows with depth: each optimizer's first training step
and its update alone, lowered and compiled in fresh processes, and the update's compiled program counted.

  python -m experiments.studies.benchmark_compile --config configs/studies/benchmark_compile.py [--results_dir ...]

For each model (the step benchmark's TransformerLM, unscanned, at 2 and 6 blocks) and optimizer (its registry
recipe for a transformer, as the head to head runs it), ``repeats`` fresh Python processes each build the model
and the optimizer and measure:

- ``step_s``: lowering + compilation of the jitted training step (forward, backward, capture, update);
- ``update_s``: the same of ``tx.update`` alone, on the step's own arguments (their shapes traced from the step);
- ``update_kernels``: the instructions of the compiled update's optimized HLO outside fusion bodies, less the
  free ones (parameters, constants, tuples, bitcasts): a stand-in for the kernels a GPU launches per step
  (deterministic, so one process's count is every process's).

An optimizer named ``<name>+apart`` is ``<name>``'s recipe with its refreshes apart from the step
(``scsgd_jax.Refresh(apart=True)``); its rows also give ``refresh_s`` and ``refresh_kernels``, the same of the
refresh's own program, ``jax.jit(scsgd_jax.refresh_conditioners)`` on the optimizer's state.

Reported: medians over the processes, each optimizer's step over SGD's (and the Muon rows' over Muon's), and per
optimizer its 6-block figures over its 2-block ones (``depth_ratio``), for the update's seconds and kernels, and
for the kernels the optimizer adds to its base optimizer's update (``added_kernels``: SCSGD's over Nesterov SGD's,
SCSGD in front of AdamW over AdamW's, the eigenbasis rows over Adam's or Muon's), the part a banked engine keeps
flat. Timings are of this machine and load; ratios of one run only.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from typing import Any

import jax
import ml_collections
import optax

import scsgd_jax
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.run import step as step_lib
from experiments.studies import benchmark_step
from experiments.studies import scaffold

FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"})
INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = .*?\s([\w\-]+)\(")
APART = "+apart"  # an optimizer's recipe with its refreshes apart from the step
COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def kernels(hlo: str) -> int:
  """The instructions of an optimized HLO module outside fusion bodies (its entry and control flow's
  computations), less the free ones: the programs a GPU would launch."""
  count, computation = 0, ""
  for line in hlo.splitlines():
    found = COMPUTATION.match(line)
    if found:
      computation = found.group(1)
      continue
    op = INSTRUCTION.match(line)
    if op and not computation.startswith(("fused_", "wrapped_")) and op.group(1) not in FREE:
      count += 1
  return count


def _spied(tx: optax.GradientTransformation, seen: dict):
  """``tx`` whose ``update`` records the shapes of its arguments when the step is traced."""
  shapes = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

  def update(updates, state, params=None, **extra):
    seen.update(args=shapes((updates, state, params)), extra=shapes(extra))
    return tx.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def measure(config: ml_collections.ConfigDict, model_name: str, name: str) -> dict[str, float]:
  """One process's figures for ``name`` on ``model_name`` (see the module docstring)."""
  spec = config.model.to_dict()
  shape, classes = tuple(spec["shape"]), spec["classes"]
  model = benchmark_step._model(model_name, shape, classes)
  base = name.removesuffix(APART)
  settings = {"name": base, **registry.recipe(base, spec["kind"]).settings}
  opt = optimizers.create(optimizers.variant(config.run, settings),
                          input_axes=benchmark_step.input_axes(model, model_name, shape, classes),
                          refresh_apart=name.endswith(APART))
  seen: dict = {}
  graphdef, params, rest = step_lib.split(model)
  step = step_lib.make_train_step(graphdef, _spied(opt.tx, seen), opt.capture, config.run.max_rows or None,
                                  donate=False)
  xs, ys = benchmark_step._data(model_name, shape, classes, spec["batch"], 1)
  step_s = benchmark_step.first_step_seconds(step, (params, rest, opt.tx.init(params), xs[0], ys[0],
                                                    jax.random.PRNGKey(0)))[0]["total_s"]
  update = jax.jit(lambda args, extra: opt.tx.update(*args, **extra))
  timing, compiled = benchmark_step.first_step_seconds(update, (seen["args"], seen["extra"]))
  out = {"step_s": step_s, "update_s": timing["total_s"], "update_kernels": kernels(compiled.as_text())}
  if name.endswith(APART):
    timing, compiled = benchmark_step.first_step_seconds(jax.jit(scsgd_jax.refresh_conditioners),
                                                         (seen["args"][1],))
    out.update(refresh_s=timing["total_s"], refresh_kernels=kernels(compiled.as_text()))
  return out


def _fresh(model_name: str, name: str) -> dict[str, float]:
  """:func:`measure` in a fresh Python process (this command with ``--config.child``)."""
  argv = [sys.executable, "-m", "experiments.studies.benchmark_compile", *sys.argv[1:],
          f"--config.child={model_name}:{name}"]
  out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def _ratios(rows: dict[str, dict[str, dict]], config) -> dict[str, Any]:
  """Each optimizer's step over SGD's (and over Muon's; a refresh apart: with its program's, over SGD's step), and
  its 6-block figures over its 2-block ones."""
  small, deep = config.models
  out: dict[str, Any] = {"step_vs_sgd": {}, "step_vs_muon": {}, "depth_ratio": {}}
  for model in config.models:
    out["step_vs_sgd"][model] = {n: r["step_s"] / rows[model]["sgd"]["step_s"] for n, r in rows[model].items()}
    out.setdefault("step_and_refresh_vs_sgd", {})[model] = {
        n: (r["step_s"] + r["refresh_s"]) / rows[model]["sgd"]["step_s"] for n, r in rows[model].items()
        if "refresh_s" in r}
    if "muon" in rows[model]:
      out["step_vs_muon"][model] = {n: r["step_s"] / rows[model]["muon"]["step_s"] for n, r in rows[model].items()
                                    if "muon" in n}
  for n in rows[small]:
    base = config.bases.get(n.removesuffix(APART))
    added = lambda m: rows[m][n]["update_kernels"] - (rows[m][base]["update_kernels"] if base else 0)
    out["depth_ratio"][n] = {
        "update_s": rows[deep][n]["update_s"] / rows[small][n]["update_s"],
        "update_kernels": rows[deep][n]["update_kernels"] / rows[small][n]["update_kernels"],
        **({"added_kernels": added(deep) / added(small), "added": [added(small), added(deep)]} if base else {})}
  return out


def study(config: ml_collections.ConfigDict, results_dir: str):
  del results_dir
  if config.child:
    model_name, name = config.child.split(":")
    print(json.dumps(measure(config, model_name, name)), flush=True)
    return None
  runs = {m: {n: [_fresh(m, n) for _ in range(config.repeats)] for n in config.optimizers} for m in config.models}
  rows = {m: {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in by.items()}
          for m, by in runs.items()}
  for m, by in rows.items():
    print(m, {n: f"step {r['step_s']:.1f} s, update {r['update_s']:.1f} s, {r['update_kernels']} kernels"
              for n, r in by.items()}, flush=True)
  results = {"setup": config.to_dict(), "medians": rows, "ratios": _ratios(rows, config), "processes": runs}
  print(json.dumps(results["ratios"], indent=1), flush=True)
  return results, config.results_file


if __name__ == "__main__":
  scaffold.run(study)
