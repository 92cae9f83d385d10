"""Head to head: every optimizer on one task, the same tuning budget, 3 seeds at the chosen rate.

  python -m experiments.benchmark --config configs/benchmark/<task>.py --workdir workdir/benchmark/<task> \\
      --results_dir experiments/results/benchmark/<task> --data_dir ../shared/tfds

Protocol (``config.benchmark``): each optimizer's learning rate from one log-spaced grid of the same
size centred on its documented default, chosen by the final loss on ``config.eval_split`` after
``tune_fraction`` of the budget on seed 0 (a diverged rate loses; a best rate at an end of the grid
grows the grid past that end, ``extend_edge`` steps at most); then every seed of ``seeds`` at the
full budget and the chosen rate. The target is the best final loss (median over seeds) of the
``target_from`` optimizers (Nesterov SGD and AdamW). Every run goes through ``train.train_and_evaluate``
in its own workdir, so the whole set resumes. All runs of a task run back to back in one process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

import jax
import numpy as np
from absl import flags

from experiments import build as build_lib
from experiments import cli
from experiments import data as data_lib
from experiments import errors
from experiments import machine
from experiments import metrics
from experiments import optimizers
from experiments import report
from experiments import train
from experiments import validate as validate_lib
from experiments.report import plt

FLAGS = flags.FLAGS


def names(config) -> list[str]:
  """``config.benchmark.optimizers`` (a tuple, or "a,b" from the command line), each checked."""
  value = config.benchmark.optimizers
  listed = [n.strip() for item in ([value] if isinstance(value, str) else value) for n in item.split(",")]
  for n in listed:
    if n not in optimizers.OPTIMIZERS or n not in config.benchmark.default_lr:
      raise errors.ConfigError(f"config.benchmark.optimizers: unknown optimizer {n!r}; choose from "
                               f"{sorted(config.benchmark.default_lr)}.")
  return listed


def learning_rates(config, name: str) -> list[float]:
  centre = config.benchmark.default_lr[name]
  return [float(f"{centre * m:.3g}") for m in config.benchmark.grid]


def run_config(config, name: str, lr: float, seed: int, steps: int):
  cfg = config.copy_and_resolve_references()
  with cfg.unlocked():
    del cfg["benchmark"]  # the protocol is the harness's: a run's recorded config is what it trains
  cfg.optimizer.name = name
  cfg.schedule.base = lr
  cfg.seed = seed
  cfg.num_steps = steps
  cfg.checkpoint_every = min(cfg.checkpoint_every, steps)
  return cfg


def _state_bytes(cfg) -> int:
  shapes = build_lib.abstract_state(build_lib.build(cfg, abstract=True))["opt_state"]
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def _run(cfg, workdir: str) -> tuple[list[dict], bool]:
  """The run's metrics rows and whether it diverged (its rows up to then)."""
  diverged = False
  try:
    train.train_and_evaluate(cfg, workdir)
  except errors.DivergedError as e:
    print(f"warning: {e}", file=sys.stderr, flush=True)
    diverged = True
  return metrics.read(os.path.join(workdir, train.METRICS_FILE)), diverged


def _final(rows, key="test_loss"):
  evals = [r for r in rows if key in r]
  return evals[-1][key] if evals else float("inf")


def tune(loss, lrs: list[float], extend_edge: int) -> dict[float, float]:
  """``{lr: loss(lr)}`` over ``lrs``; while the best is at an end of the grid, the grid grows one more
  step (its own ratio) past that end, at most ``extend_edge`` times per end, so the rate a peer gets
  is bracketed rather than cut off by where its grid happened to be centred."""
  tried = {lr: loss(lr) for lr in lrs}
  ratio = lrs[-1] / lrs[-2] if len(lrs) > 1 else 1.0
  grown = {+1: 0, -1: 0}
  while ratio > 1.0:
    best = min(tried, key=lambda lr: (tried[lr], lr))
    if not np.isfinite(tried[best]):
      side = -1  # every rate diverged: smaller ones
    else:
      side = +1 if best == max(tried) else -1 if best == min(tried) else 0
    if side == 0 or grown[side] == extend_edge:
      break
    grown[side] += 1
    lr = float(f"{best * ratio ** side:.3g}")
    tried[lr] = loss(lr)
  return dict(sorted(tried.items()))


def validate(config) -> None:
  for name in names(config):
    for lr in learning_rates(config, name):
      validate_lib.validate_config(run_config(config, name, lr, 0, config.num_steps))


def benchmark(config, workdir: str) -> dict:
  validate(config)  # every run's config, before any runs
  tune_steps = max(config.eval_every, int(config.num_steps * config.benchmark.tune_fraction))
  tune_steps -= tune_steps % config.checkpoint_every if tune_steps > config.checkpoint_every else 0
  out = {"tune_steps": tune_steps, "optimizers": {}}
  for name in names(config):

    def tune_loss(lr, name=name):
      rows, diverged = _run(run_config(config, name, lr, 0, tune_steps), os.path.join(workdir, name, f"tune_lr{lr:g}"))
      return float("inf") if diverged else _final(rows)

    tuning = tune(tune_loss, learning_rates(config, name), config.benchmark.extend_edge)
    best = min(tuning, key=lambda lr: (tuning[lr], lr))
    seeds = {}
    for seed in config.benchmark.seeds:
      cfg = run_config(config, name, best, seed, config.num_steps)
      run_dir = os.path.join(workdir, name, f"lr{best:g}_seed{seed}")
      rows, diverged = _run(cfg, run_dir)
      seeds[seed] = {"rows": rows, "diverged": diverged}
      if config.benchmark.report_split and not diverged:
        seeds[seed]["report"] = train.evaluate_checkpoint(cfg, run_dir, config.benchmark.report_split)
    lrs = sorted(tuning)
    out["optimizers"][name] = {"tuning": {f"{lr:g}": v for lr, v in tuning.items()}, "learning_rate": best,
                               "at_grid_edge": best in (lrs[0], lrs[-1]),
                               "seeds": seeds, "state_bytes": _state_bytes(cfg)}
    print(f"{name}: lr {best:g}, final {[_final(s['rows']) for s in seeds.values()]}", flush=True)
  return summarize(config, out)


def _median_report(seeds: dict, key: str):
  """Median over seeds of the final parameters' ``config.benchmark.report_split`` figure (None: not
  evaluated, or a seed diverged)."""
  values = [s["report"][key] for s in seeds.values() if "report" in s]
  return float(np.median(values)) if values and len(values) == len(seeds) else None


def summarize(config, out: dict) -> dict:
  opts = out["optimizers"]
  finals = {n: float(np.median([_final(s["rows"]) for s in o["seeds"].values()])) for n, o in opts.items()}
  baselines = [n for n in config.benchmark.target_from if n in finals] or list(finals)  # a subset ran: its best
  target = min(finals[n] for n in baselines)
  out["target"] = target
  for name, o in opts.items():
    hits = [report.first_at_or_below(s["rows"], target) for s in o["seeds"].values()]
    its = [h[0] for h in hits if h[0] is not None]
    secs = [h[1] for h in hits if h[1] is not None]
    last = [s["rows"][-1] for s in o["seeds"].values() if s["rows"]]
    o["summary"] = {
        "reached": f"{len(its)}/{len(hits)}",
        "iterations_median": float(np.median(its)) if len(its) == len(hits) else None,
        "iterations_range": [min(its), max(its)] if its else None,
        "seconds_median": float(np.median(secs)) if len(secs) == len(hits) else None,
        "seconds_range": [min(secs), max(secs)] if secs else None,
        "final_loss_median": finals[name],
        "final_error_median": float(np.median([_final(s["rows"], "test_error") for s in o["seeds"].values()])),
        "report_loss_median": _median_report(o["seeds"], "loss"),
        "report_error_median": _median_report(o["seeds"], "error"),
        "step_ms_median": float(np.median([1e3 * r["train_time"] / r["step"] for r in last])),
        "compile_s_median": float(np.median([r.get("compile_time", float("nan")) for r in last])),
        "state_bytes": o["state_bytes"],
        "diverged_seeds": sum(s["diverged"] for s in o["seeds"].values()),
    }
  best_secs = min((o["summary"]["seconds_median"] for o in opts.values() if o["summary"]["seconds_median"]),
                  default=None)
  best_its = min((o["summary"]["iterations_median"] for o in opts.values() if o["summary"]["iterations_median"]),
                 default=None)
  best_bytes = min(o["state_bytes"] for o in opts.values())
  for o in opts.values():
    s = o["summary"]
    s["time_to_target_vs_best"] = s["seconds_median"] / best_secs if s["seconds_median"] and best_secs else None
    s["iterations_vs_best"] = s["iterations_median"] / best_its if s["iterations_median"] and best_its else None
    s["state_vs_smallest"] = s["state_bytes"] / best_bytes
  return out


def _median_curve(seeds: dict, key: str, x: str):
  runs = [[(r[x], r[key]) for r in s["rows"] if key in r] for s in seeds.values()]
  n = min(len(r) for r in runs)
  if n == 0:
    return [], []
  return ([float(np.median([r[i][0] for r in runs])) for i in range(n)],
          [float(np.median([r[i][1] for r in runs])) for i in range(n)])


def write_report(config, out: dict, results_dir: str, command: str) -> str:
  os.makedirs(results_dir, exist_ok=True)
  m = machine.describe()
  for name, o in out["optimizers"].items():
    for seed, s in o["seeds"].items():
      metrics.write(os.path.join(results_dir, f"metrics_{name}_seed{seed}.jsonl"), s["rows"])
  slim = {"tune_steps": out["tune_steps"], "target": out["target"], "machine": m, "command": command,
          "config": json.loads(config.to_json_best_effort()),
          "optimizers": {n: {k: v for k, v in o.items() if k != "seeds"} for n, o in out["optimizers"].items()}}
  report.write_results(results_dir, slim, command, machine=m)
  figs = []
  for x, label in (("step", "iteration"), ("train_time", "training seconds")):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, o in out["optimizers"].items():
      xs, ys = _median_curve(o["seeds"], "test_loss", x)
      ax.plot(xs, ys, label=f"{name} (lr {o['learning_rate']:g})")
    ax.axhline(out["target"], color="gray", ls="--", lw=1, label="target")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel(f"{config.eval_split} loss (median of seeds)")
    ax.set_title(f"{config.dataset} / {config.model}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    figs.append(report.save_figure(fig, results_dir, f"loss_vs_{x}"))
  b = config.benchmark
  lines = report.header(f"Head to head: {config.model} on {config.dataset}", command, m) + [
      f"Budget {config.num_steps} iterations, batch {config.batch_size}, schedule '{config.schedule.name}'. "
      f"Learning rate per optimizer from its default x {list(b.grid)}, chosen by the final "
      f"{config.eval_split} loss after {out['tune_steps']} iterations on seed 0; then seeds {list(b.seeds)} at "
      f"the full budget. Target: {out['target']:.4f}, the best final {config.eval_split} loss (median of seeds) "
      f"of {', '.join(b.target_from)}. Every other setting is the optimizer's documented default.\n",
      "Figures: " + report.figure_links(figs) + "\n",
      "| optimizer | lr | reached | iterations to target (median [range]) | vs best | seconds to target | vs best | "
      f"final {config.eval_split} loss | final error | "
      + (f"final {b.report_split} loss | {b.report_split} error | " if b.report_split else "")
      + "ms/step | compile s | state bytes | vs smallest |",
      "|" + " --- |" * (15 if b.report_split else 13)]
  for name, o in out["optimizers"].items():
    s = o["summary"]
    reported = (f"{report.fmt(s['report_loss_median'], '.4f')} | "
                f"{report.fmt(s['report_error_median'] and 100 * s['report_error_median'], '.2f')}% | "
                if b.report_split else "")
    its = f"{report.fmt(s['iterations_median'], '.0f')} [{', '.join(map(str, s['iterations_range'] or []))}]"
    secs = f"{report.fmt(s['seconds_median'], '.1f')} [{', '.join(f'{v:.1f}' for v in s['seconds_range'] or [])}]"
    edge = " (edge)" if o["at_grid_edge"] else ""
    lines.append(f"| {name} | {o['learning_rate']:g}{edge} | {s['reached']} | {its} | {report.fmt(s['iterations_vs_best'], '.2f')} | "
                 f"{secs} | {report.fmt(s['time_to_target_vs_best'], '.2f')} | {s['final_loss_median']:.4f} | "
                 f"{100 * s['final_error_median']:.2f}% | {reported}{s['step_ms_median']:.1f} | {s['compile_s_median']:.1f} | "
                 f"{s['state_bytes']:,} | {s['state_vs_smallest']:.2f} |")
  lines += ["", f"(edge): the chosen rate is at an end of the grid even after growing it {b.extend_edge} steps past "
            "that end, so the grid may not bracket the best rate.",
            "", "Tuning (learning rate: final loss after the tuning budget, seed 0; inf = diverged):", "",
            "| optimizer | rates tried |", "| --- | --- |"]
  for name, o in out["optimizers"].items():
    lines.append(f"| {name} | " + ", ".join(f"{lr}: {v:.4f}" for lr, v in o["tuning"].items()) + " |")
  return report.write_markdown(results_dir, lines)


def task_names(config_file: str) -> list[str]:
  """The benchmark's tasks: the configs beside ``config_file`` (``configs/benchmark/<task>.py``)."""
  folder = os.path.dirname(os.path.abspath(config_file))
  return sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f not in ("common.py", "__init__.py"))


def write_summary(root: str, tasks: Sequence[str] = ()) -> str:
  """``<root>/README.md``: one table, task x optimizer, from every ``<root>/<task>/results.json``; a
  line names each of ``tasks`` that has no results there yet."""
  lines = ["# Head to head: summary", "",
           "Per task: time to the target (the best final loss of Nesterov SGD and AdamW, median of seeds) against "
           "the fastest optimizer of the task, iterations to it, final loss (median of seeds), optimizer-state "
           "bytes. Each task's folder holds its report, curves and raw metrics; commands are in each report.", "",
           "| task | optimizer | lr | time to target vs best | iterations to target | final loss | state bytes |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for task in sorted(os.listdir(root)):
    path = os.path.join(root, task, "results.json")
    if not os.path.exists(path):
      continue
    result = json.load(open(path))
    for name, o in result["optimizers"].items():
      s = o["summary"]
      lines.append(f"| [{task}]({task}/README.md) | {name} | {o['learning_rate']:g} | "
                   f"{report.fmt(s['time_to_target_vs_best'], '.2f', 'not reached by every seed')} | "
                   f"{report.fmt(s['iterations_median'], '.0f')} ({s['reached']}) | {s['final_loss_median']:.4f} | "
                   f"{s['state_bytes']:,} |")
  missing = [t for t in tasks if not os.path.exists(os.path.join(root, t, "results.json"))]
  if missing:
    lines += ["", f"No results yet for: {', '.join(missing)} (`configs/benchmark/<task>.py`; the commands are in "
              "experiments/README.md)."]
  return report.write_markdown(root, lines)


def main(argv):
  del argv
  config = cli.config()
  with data_lib.reuse_decoded_splits():
    out = benchmark(config, FLAGS.workdir)
  print(open(write_report(config, out, FLAGS.results_dir, cli.command_line())).read())
  write_summary(os.path.dirname(os.path.abspath(FLAGS.results_dir)), task_names(cli.config_path()))


if __name__ == "__main__":
  cli.define_flags(workdir=True)
  cli.run(main)
