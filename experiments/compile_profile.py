"""Where the conditioning's compile time goes: its update alone, part by part, on one step benchmark model.

  python -m experiments.compile_profile --config configs/benchmark_step.py --config.only=transformer_lm

For the model (``config.only``, a step benchmark model) and SCSGD at the experiments' settings, the optimizer's
``update`` alone is jitted and compiled (the model's own forward and backward left out): once whole, once
with each part stubbed out (the fold of the captured rows into the statistics, the refresh of the factors,
the conditioning of the gradients) and once with all three stubbed (what is left: the Nesterov chain). For
each it records the seconds to lower and compile and the XLA kernels of the compiled program (the
instructions of its non-fused computations; XLA's CPU backend emits code per kernel, and the compile time
follows their number), the whole update's kernels also by part (named scopes). Writes
``compile_profile.json``. Run it alone on the machine: the seconds are timings.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import time
from typing import Any

import jax
from absl import flags
from flax import nnx

import scsgd_jax
from experiments import benchmark_step
from experiments import cli
from experiments import machine
from experiments import optimizers
from experiments import report
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import schedule
from scsgd_jax._src import transform

FLAGS = flags.FLAGS
# part -> (module, function, stub with the same signature that does nothing)
PARTS = {
    "fold": (fold_lib, "fold", lambda plans, rows, stats, clipped, *a, **k: (stats, clipped)),
    "refresh": (schedule, "refresh", lambda plans, phases, stats, old, key, count, due, *a: (old, key)),
    "condition": (transform, "_condition", lambda updates, plans, factors: updates),
}
_SKIP = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all")


@contextlib.contextmanager
def _patched(replacements: dict[str, Any]):
  saved = {part: getattr(PARTS[part][0], PARTS[part][1]) for part in replacements}
  try:
    for part, fn in replacements.items():
      setattr(PARTS[part][0], PARTS[part][1], fn)
    yield
  finally:
    for part, fn in saved.items():
      setattr(PARTS[part][0], PARTS[part][1], fn)


def _scoped(part: str):
  fn = getattr(PARTS[part][0], PARTS[part][1])

  def wrapped(*args, **kwargs):
    with jax.named_scope(f"PART_{part}"):
      return fn(*args, **kwargs)

  return wrapped


def kernels(hlo_text: str) -> collections.Counter:
  """The compiled program's kernels by part (``PART_<name>`` scopes; ``other``): instructions of its computations
  that are not fusion bodies, bar parameters, constants and tuple plumbing."""
  out = collections.Counter()
  for comp in hlo_text.split("\n\n"):
    head = comp.strip().split("\n")[0]
    if "fused_computation" in head or head.startswith("HloModule"):
      continue
    for line in comp.split("\n")[1:]:
      m = re.match(r"\s+(?:ROOT )?\S+ = [^ ]+ ([\w-]+)\(", line)
      if m and m.group(1) not in _SKIP:
        name = re.search(r'op_name="([^"]*)"', line)
        out[next((p for p in PARTS if name and f"PART_{p}" in name.group(1)), "other")] += 1
  return out


def profile(config, name: str, spec: dict) -> dict[str, Any]:
  shape, classes, batch = tuple(spec["shape"]), spec["classes"], spec["batch"]
  xs, _ = benchmark_step._data(name, shape, classes, batch, 1)
  model = benchmark_step._model(name, shape, classes)
  opt = optimizers.create(optimizers.variant(config.run, {"name": "scsgd"}), input_axes=scsgd_jax.input_axes_nnx(model))
  _, rows = scsgd_jax.capture_nnx(model, xs[0], rng=jax.random.PRNGKey(0), max_rows=config.run.max_rows or None)
  params = nnx.state(model, nnx.Param)
  state = opt.tx.init(params)

  def compiled():
    fn = jax.jit(lambda g, s, li: opt.tx.update(g, s, g, layer_inputs=li))
    t0 = time.perf_counter()
    lowered = fn.lower(params, state, rows)
    t1 = time.perf_counter()
    out = lowered.compile()
    return out, {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}

  compiled()  # warm-up: the first compilation of a process pays for more than its program
  result = {}
  with _patched({p: _scoped(p) for p in PARTS}):
    program, figures = compiled()
  result["whole"] = {**figures, "kernels": dict(kernels(program.as_text()))}
  for label, stubbed in [*((f"without_{p}", (p,)) for p in PARTS), ("without_all", tuple(PARTS))]:
    with _patched({p: PARTS[p][2] for p in stubbed}):
      program, figures = compiled()
    result[label] = {**figures, "kernels": sum(kernels(program.as_text()).values())}
  return result


def main(argv):
  del argv
  config = cli.config()
  report.provenance()
  models = {**config.models, **config.compile_models}
  only = [m for m in config.only.split(",") if m] or ["transformer_lm", "transformer_lm_6"]
  results = {"models": {}}
  for name in only:
    r = results["models"][name] = profile(config, name, models[name].to_dict())
    print(name, {k: (round(v["lower_s"] + v["compile_s"], 2), v["kernels"]) for k, v in r.items()}, flush=True)
  report.write_results(FLAGS.results_dir, results, cli.command_line(), "compile_profile.json", machine.describe())


if __name__ == "__main__":
  cli.define_flags(workdir=False, data=False, results_dir=os.path.join(os.path.dirname(__file__), "results"))
  cli.run(main)
