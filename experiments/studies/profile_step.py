"""Where a training step's time goes, by source line: each variant's jitted step (the step benchmark's,
built the same way) traced with JAX's profiler, every executed XLA kernel's time attributed to the line of
Python that emitted it.

  OPENBLAS_NUM_THREADS=1 python -m experiments.studies.profile_step --config configs/studies/profile_step.py --results_dir experiments/results/step_profile

Per model and variant: the step's wall time untraced (``wall_ms``, the mean of ``steps`` steps after
``warmup``; steps are not interleaved with a baseline's here, so ratios of step time come from
``benchmark_step``), then ``steps`` steps traced. From the trace, each XLA CPU kernel (a fusion, a GEMM, a
copy; not the ``while``/``conditional``/``call`` that hold others, whose kernels are counted themselves, nor the
runtime's markers and waits) is summed per step and attributed through the compiled program's stack frames to
its innermost Python frame: ``by_file`` (the file) and ``by_line`` (file, line and function). Kernels without a
frame (the runtime's argument handling, buffer copies) are filed under ``runtime: <kernel kind>``. The kernel
times are CPU time summed over the runtime's threads (two here), so they add up to more than the wall time;
``kernels_per_step`` counts the kernels executed. ``extra_over`` (a config entry) gives each file's ms and
kernels over the baseline variant's. Run it alone on the machine: the figures are timings.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Any

import jax

from experiments.studies import benchmark_step
from experiments.studies import scaffold

# trace events that are not one executed kernel: the profiler's Python frames, the runtime's waits and
# dispatch, and the kernels that hold others (their inner kernels are events of their own)
_NOT_A_KERNEL = re.compile(r"(\$|ThunkExecutor|SlinkyThreadPool|ThreadpoolListener|PjitFunction|CommonPjRt|Wait for |"
                           r"end: |cond(\.\d+)?$|while(\.\d+)?$|call(\.\d+)?$)")


def stack_frames(hlo_text: str) -> dict[str, tuple[str, str, int]]:
  """``{instruction: (file, function, line)}``: each instruction's innermost Python frame, read from the
  compiled program's text (its ``FileNames``, ``FunctionNames``, ``FileLocations`` and ``StackFrames``)."""
  def table(name: str, following: str) -> str:
    return hlo_text.split("\n" + name + "\n", 1)[1].split("\n" + following + "\n", 1)[0]

  files = dict(re.findall(r'^(\d+) "(.*)"$', table("FileNames", "FunctionNames"), re.M))
  functions = dict(re.findall(r'^(\d+) "(.*)"$', table("FunctionNames", "FileLocations"), re.M))
  locations = {m[0]: (files[m[1]], functions.get(m[2], "?"), int(m[3])) for m in re.findall(
      r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", table("FileLocations", "StackFrames"), re.M)}
  frames = dict(re.findall(r"^(\d+) \{file_location_id=(\d+)", hlo_text.split("\nStackFrames\n", 1)[1], re.M))
  return {name: locations[frames[frame]] for name, frame in re.findall(r"%([\w.\-]+) = [^\n]*?stack_frame_id=(\d+)",
                                                                       hlo_text) if frame in frames}


def _short(path: str) -> str:
  """A source file as a reader finds it: relative to its package (``scsgd_jax/_src/eigenbasis.py``, ``optax/...``)."""
  parts = path.split(os.sep)
  for i, part in enumerate(parts):
    if part in ("scsgd_jax", "experiments", "tests", "site-packages"):
      return "/".join(parts[i + (part == "site-packages"):])
  return parts[-1]


def kernel_times(trace_dir: str, steps: int) -> dict[str, tuple[float, float]]:
  """``{kernel: (ms per step, executions per step)}`` from the perfetto trace JAX's profiler wrote."""
  path = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
  with gzip.open(path) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  ms, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not _NOT_A_KERNEL.match(e["name"]):
      ms[e["name"]] += e.get("dur", 0) / 1e3 / steps
      count[e["name"]] += 1 / steps
  return {k: (ms[k], count[k]) for k in ms}


def attribute(times: dict[str, tuple[float, float]], frames: dict[str, tuple[str, str, int]]) -> dict[str, Any]:
  """The kernels' times summed by file and by line of their innermost frame."""
  by_file, by_line = collections.defaultdict(lambda: [0.0, 0.0]), collections.defaultdict(lambda: [0.0, 0.0])
  for kernel, (ms, count) in times.items():
    if kernel in frames:
      file, function, line = frames[kernel]
      f, where = _short(file), f"{_short(file)}:{line} ({function})"
    else:
      f = where = "runtime: " + re.sub(r"\.\d+$", "", kernel)
    for table, k in ((by_file, f), (by_line, where)):
      table[k][0] += ms
      table[k][1] += count
  order = lambda t: {k: {"ms": round(v[0], 4), "kernels": round(v[1], 2)} for k, v in
                     sorted(t.items(), key=lambda kv: -kv[1][0])}
  return {"kernel_ms_per_step": sum(v[0] for v in times.values()),
          "kernels_per_step": sum(v[1] for v in times.values()), "by_file": order(by_file), "by_line": order(by_line)}


def profile_variant(fn, state: list, xs, ys, warmup: int, steps: int) -> dict[str, Any]:
  key = jax.random.PRNGKey(0)

  def run(start: int, n: int):
    for i in range(start, start + n):
      params, rest, opt_state, loss, _ = fn(*state, xs[i % len(xs)], ys[i % len(ys)], jax.random.fold_in(key, i))
      jax.block_until_ready(loss)
      state[:] = [params, rest, opt_state]

  frames = stack_frames(fn.lower(*state, xs[0], ys[0], key).compile().as_text())
  run(0, warmup)
  t = time.perf_counter()
  run(warmup, steps)
  wall = (time.perf_counter() - t) * 1e3 / steps
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      run(warmup + steps, steps)
    times = kernel_times(d, steps)
  return {"wall_ms": wall, **attribute(times, frames)}


def extra_over(base: dict[str, Any], other: dict[str, Any]) -> dict[str, dict[str, float]]:
  """Each file's kernel ms and kernels per step in ``other`` over ``base``'s, largest first."""
  files = set(base["by_file"]) | set(other["by_file"])
  get = lambda t, f, k: t["by_file"].get(f, {}).get(k, 0.0)
  rows = {f: {"ms": round(get(other, f, "ms") - get(base, f, "ms"), 4),
              "kernels": round(get(other, f, "kernels") - get(base, f, "kernels"), 2)} for f in files}
  return dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]["ms"])))


def study(config, results_dir: str):
  results = {"setup": {"warmup": config.warmup, "steps": config.steps, "variants": config.variants.to_dict(),
                       "models": config.models.to_dict(), "run": config.run.to_dict()}, "models": {}}
  for name, spec in config.models.items():
    shape, classes, batch = tuple(spec["shape"]), spec["classes"], spec["batch"]
    xs, ys = benchmark_step._data(name, shape, classes, batch, 4)
    out = {}
    for vname, (fn, state) in benchmark_step._variants(config, name, shape, classes, spec.get("kind")).items():
      out[vname] = profile_variant(fn, state, xs, ys, config.warmup, config.steps)
      print(name, vname, f"wall {out[vname]['wall_ms']:.1f} ms, kernels {out[vname]['kernel_ms_per_step']:.1f} ms "
            f"({out[vname]['kernels_per_step']:.0f} per step)", flush=True)
    for vname, base in config.extra_over.items():
      if vname in out and base in out:
        out[vname]["extra_over"] = {"baseline": base, "by_file": extra_over(out[base], out[vname])}
    results["models"][name] = out
  return results, "profile_step.json"


if __name__ == "__main__":
  scaffold.run(study)
