"""Where the conditioning's compile time goes: its update alone, part by part, on one step benchmark model.

  python -m experiments.compile_profile --config configs/benchmark_step.py --config.only=transformer_lm

For the model (``config.only``, a step benchmark model) and SCSGD at the experiments' settings, the optimizer's
``update`` alone is jitted and compiled (the model's own forward and backward left out): once whole, once
with each part stubbed out (the fold of the captured rows into the statistics, the refresh of the factors,
the conditioning of the gradients) and once with all three stubbed (what is left: the Nesterov chain). For
each it records the seconds to lower and compile and the XLA kernels of the compiled program (the
instructions of its non-fused computations; XLA's CPU backend emits code per kernel, and the compile time
follows their number), the whole update's kernels also by part (named scopes). It also compiles the fold
alone in three forms that compute the same statistics (``fold_alone``): the library's (one computation per
kernel), and two banked forms that fold the kernels of one kind of statistics, ``n`` and row count together
(:func:`fold_vmapped`: one ``vmap``; :func:`fold_looped`: one ``fori_loop`` over the bank's members), the
forms that would make the fold's compile time independent of depth, and both banked forms on a state stacked
beforehand; and the refresh alone, bank by bank (``refresh_alone``). Writes ``compile_profile.json``. Run it
alone on the machine: the seconds are timings.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

import scsgd_jax
from experiments import benchmark_step
from experiments import cli
from experiments import machine
from experiments import optimizers
from experiments import report
from scsgd_jax._src import defaults
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import plan as plan_lib
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


def _banks(kernel_plans, rows) -> list[list[str]]:
  """The kernels that can fold together: one kind of statistics, ``n``, slice layout and row shape."""
  banks = collections.defaultdict(list)
  for path, plan in kernel_plans.items():
    x = rows[path]
    if x.size:
      banks[(id(plan.statistics), plan.n, plan.slices is None, x.shape[-2:] if plan.slices is None else x.shape[1:],
             x.dtype)].append(path)
  return list(banks.values())


def _member_fold(plan, outlier_threshold):
  """The library's fold of one bank member (a kernel or slice), guarded: ``(stats, rows) -> (stats, clipped)``."""

  def one(state, x):
    folded, n_clipped = fold_lib.fold_kernel(plan, state, x, outlier_threshold)
    return fold_lib.keep_if_finite(folded, state), n_clipped

  return one


def _lone(kernel_plans, paths) -> list[bool]:
  """Which of ``paths`` are kernels of one slice (no leading axis to stack on)."""
  return [kernel_plans[p].slices is None for p in paths]


def stacked_banks(kernel_plans, rows, stats):
  """Per bank (:func:`_banks`): its paths, and its members' statistics and rows stacked on a leading axis."""
  out = []
  for paths in _banks(kernel_plans, rows):
    lone = _lone(kernel_plans, paths)
    out.append((paths, schedule._stacked([stats[p] for p in paths], lone),
                schedule._stacked([rows[p] for p in paths], lone)))
  return out


def _fold_banked(fold_bank):
  """A fold with the library's signature (no ``axis_name``) that stacks each bank (:func:`stacked_banks`) and
  folds it with ``fold_bank(one, stats, rows) -> (stats, clipped per member)`` (:func:`_member_fold`)."""

  def fold(kernel_plans, rows, stats, clipped, outlier_threshold):
    new_stats, new_clipped = dict(stats), dict(clipped)
    for paths, bank_stats, bank_rows in stacked_banks(kernel_plans, rows, stats):
      sizes = [kernel_plans[p].slices or 1 for p in paths]
      folded, counts = fold_bank(_member_fold(kernel_plans[paths[0]], outlier_threshold), bank_stats, bank_rows)
      starts = np.cumsum([0, *sizes])
      for i, (p, part) in enumerate(zip(paths, schedule._unstacked(folded, sizes, _lone(kernel_plans, paths)))):
        new_stats[p], new_clipped[p] = part, clipped[p] + jnp.sum(counts[starts[i]:starts[i + 1]])
    return new_stats, new_clipped

  return fold


def _looped(one, stats, rows):
  def body(j, carry):
    s, counts = carry
    folded, count = one(jax.tree.map(lambda a: a[j], s), rows[j])
    return jax.tree.map(lambda a, b: a.at[j].set(b), s, folded), counts.at[j].set(count)

  return jax.lax.fori_loop(0, rows.shape[0], body, (stats, jnp.zeros(rows.shape[0], jnp.int32)))


def _vmapped(one, stats, rows):
  return jax.vmap(one)(stats, rows)


fold_vmapped = _fold_banked(_vmapped)
fold_looped = _fold_banked(_looped)
FOLDS = {"per_kernel": fold_lib.fold, "vmap_banked": fold_vmapped, "loop_banked": fold_looped}
BANK_FOLDS = {"vmap_prestacked": _vmapped, "loop_prestacked": _looped}  # the state already kept per bank


def _library_conditioning(params, rows_captured):
  """The library's default conditioning of ``params`` (read with the captured layouts): its arguments, its
  initial state and its kernel plans."""
  args = transform.arguments("compile_profile", input_axes=rows_captured.input_axes)
  tx, plans = transform.conditioning_and_plans(args)
  return args, tx.init(params), plans(params, rows_captured.input_axes)


def fold_alone(params, rows_captured) -> dict[str, float]:
  """Seconds to lower and compile the fold alone (the library's default conditioning of ``params``, whose inputs
  ``rows_captured`` are), in each form of :data:`FOLDS`, and of :data:`BANK_FOLDS` on statistics and rows
  stacked per bank beforehand (what a state kept per bank would compile: no stacking in the step)."""
  args, state, kernel_plans = _library_conditioning(params, rows_captured)
  rows = transform._checked_rows(kernel_plans, rows_captured)
  out = {}
  for label, fold in FOLDS.items():
    fn = jax.jit(lambda r, s, c, fold=fold: fold(kernel_plans, r, s, c, args["outlier_threshold"]))
    t0 = time.perf_counter()
    fn.lower(rows, state.statistics, state.clipped_rows).compile()
    out[label] = time.perf_counter() - t0
  banks = stacked_banks(kernel_plans, rows, state.statistics)
  for label, fold_bank in BANK_FOLDS.items():
    fn = jax.jit(lambda s, r, fold_bank=fold_bank: [
        fold_bank(_member_fold(kernel_plans[paths[0]], args["outlier_threshold"]), bank_s, bank_r)
        for (paths, _, _), bank_s, bank_r in zip(banks, s, r)])
    t0 = time.perf_counter()
    fn.lower([b[1] for b in banks], [b[2] for b in banks]).compile()
    out[label] = time.perf_counter() - t0
  return out


def refresh_alone(params, rows_captured) -> dict[str, dict[str, Any]]:
  """Seconds to lower and compile the refresh alone (the library's default conditioning of ``params``), of each
  bank (one kind of statistics, ``n`` and rank) with all its members and with its first member alone: the
  fixed cost of a distinct statistic and the cost of each further member."""
  _, state, kernel_plans = _library_conditioning(params, rows_captured)
  phases = plan_lib.slice_phases(kernel_plans, defaults.UPDATE_EVERY, True)
  due = lambda count, phase: schedule.refresh_due(count, phase, defaults.UPDATE_EVERY, True, defaults.STATISTICS_EVERY)
  banks = collections.defaultdict(dict)
  for path, plan in kernel_plans.items():
    banks[f"{plan.kind} n={plan.n} rank={plan.rank}"][path] = plan
  out = {}
  for bank, members in banks.items():
    out[bank] = {"members": len(members)}
    for label, sub in (("all_s", members), ("first_s", dict([next(iter(members.items()))]))):
      fn = jax.jit(lambda s, f, k, c, sub=sub: schedule.refresh(sub, phases, s, f, k, c, due))
      t0 = time.perf_counter()
      fn.lower(state.statistics, state.factors, state.key, state.count).compile()
      out[bank][label] = time.perf_counter() - t0
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
  result["fold_alone_s"] = fold_alone(params, rows)
  result["refresh_alone_s"] = refresh_alone(params, rows)
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
    print(name, {k: (round(v["lower_s"] + v["compile_s"], 2), v["kernels"]) for k, v in r.items() if "kernels" in v},
          {k: round(v, 2) for k, v in r["fold_alone_s"].items()}, r["refresh_alone_s"], flush=True)
  report.write_results(FLAGS.results_dir, results, cli.command_line(), "compile_profile.json", machine.describe())


if __name__ == "__main__":
  cli.define_flags(workdir=False, data=False, results_dir=os.path.join(os.path.dirname(__file__), "results"))
  cli.run(main)
