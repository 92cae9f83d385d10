"""The comparison's report: figures and tables beside the paper's numbers (Figures 1-4)."""

from __future__ import annotations

import json
import os
from typing import Optional

from experiments.run import metrics as metrics_lib
from experiments.run import report
from experiments.run.report import plt

PAPER_CURVES = os.path.join(os.path.dirname(__file__), "paper_curves.json")
TABLE_STEPS = (1000, 2000, 5000, 10000)
# metric -> (title, log scale as in the paper's figure)
FIGURES = {
    "train_loss": ("training log loss", True),
    "test_loss": ("test log loss", True),
    "train_error": ("training 0-1 error", False),
    "test_error": ("test 0-1 error", False),
}
PAPER_DATASET = {"mnist": "mnist", "svhn_cropped": "svhn"}
COLORS = {"sgd": "tab:blue", "scsgd": "tab:red", "adam": "tab:green"}


def paper_curves(dataset: str) -> dict[str, dict[str, dict[int, float]]]:
  """``{optimizer: {metric: {step: value}}}`` from the paper's pgfplots tables, or {} if it has none."""
  name = PAPER_DATASET.get(dataset)
  with open(PAPER_CURVES) as f:
    curves = json.load(f)["curves"]
  if name not in curves:
    return {}
  return {opt: {m: {int(s): v for s, v in vals.items()} for m, vals in ms.items()} for opt, ms in curves[name].items()}


def _series(rows, metric):
  pts = [(r["step"], r[metric]) for r in rows if metric in r]
  return [p[0] for p in pts], [p[1] for p in pts]


def plot(runs: dict[str, list[dict]], dataset: str, out_dir: str) -> list[str]:
  paper = paper_curves(dataset)
  paths = []
  for metric, (title, log) in FIGURES.items():
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, rows in runs.items():
      xs, ys = _series(rows, metric)
      ax.plot(xs, ys, label=f"{name} (ours)", color=COLORS.get(name), marker="." if "test" in metric else None)
    for name, curves in paper.items():
      if metric in curves:
        xs = sorted(curves[metric])
        ax.plot(xs, [curves[metric][x] for x in xs], "--", color=COLORS.get(name), alpha=0.6,
                label=f"{name.upper()} (paper)")
    if log:
      ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_title(f"{dataset}: {title}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    paths.append(report.save_figure(fig, out_dir, metric))
  return paths


def _at(rows, metric, step) -> Optional[float]:
  for r in rows:
    if r["step"] == step and metric in r:
      return r[metric]
  return None


def table(runs: dict[str, list[dict]], dataset: str, diverged: Optional[dict[str, int]] = None) -> str:
  diverged = diverged or {}
  paper = paper_curves(dataset)
  names = list(runs)
  lines = []
  for metric, pct in (("test_loss", False), ("test_error", True), ("train_loss", False), ("train_error", True)):
    head = ["iteration"]
    for name in names:
      head.append(f"{name} (ours)")
      if name in paper and metric in paper[name]:
        head.append(f"{name.upper()} (paper)")
    lines += [f"\n**{metric.replace('_', ' ')}**\n", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for step in TABLE_STEPS:
      cells = [str(step)]
      for name in names:
        cells.append(report.fmt(_at(runs[name], metric, step), ".2f" if pct else ".4f", "n/a", pct))
        if name in paper and metric in paper[name]:
          cells.append(report.fmt(paper[name][metric].get(step), ".2f" if pct else ".4f", "n/a", pct))
      lines.append("| " + " | ".join(cells) + " |")
  sgd_tests = [r for r in runs.get("sgd", []) if "test_loss" in r]
  if sgd_tests and "sgd" not in diverged:
    final = sgd_tests[-1]
    target = final["test_loss"]
    lines += [
        f"\n**Time to SGD's final test loss** ({target:.4f} at iteration {final['step']}; "
        f"SGD's training time {final['train_time']:.1f} s)\n",
        "| optimizer | first iteration at or below | iterations vs SGD | training time (s) | time vs SGD |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in names:
      step, secs = report.first_at_or_below(runs[name], target)
      if step is None and name in diverged:
        lines.append(f"| {name} | diverged at step {diverged[name]} | - | - | - |")
      elif step is None:
        lines.append(f"| {name} | not reached | - | - | - |")
      else:
        lines.append(f"| {name} | {step} | {step / final['step']:.2f}x | {secs:.1f} | "
                     f"{secs / final['train_time']:.2f}x |")
    lines.append("\nTraining time counts the jitted training steps only (compilation, evaluation and checkpointing "
                 "excluded).")
  return "\n".join(lines) + "\n"


def write_report(runs: dict[str, list[dict]], dataset: str, out_dir: str, command: str,
                 machine: Optional[dict] = None, diverged: Optional[dict[str, int]] = None) -> str:
  """Metrics, figures and ``README.md`` of a comparison; ``diverged`` maps a run that stopped on
  non-finite metrics to its step (its rows up to then are shown, and it is marked)."""
  diverged = diverged or {}
  os.makedirs(out_dir, exist_ok=True)
  for name, rows in runs.items():
    metrics_lib.write(os.path.join(out_dir, f"metrics_{name}.jsonl"), rows)
  figs = plot(runs, dataset, out_dir)
  text = report.header(f"{dataset}: {', '.join(runs)}", command, machine)
  if diverged:
    text.append("Diverged (non-finite metrics; rows up to then shown): "
                + ", ".join(f"**{n}** at step {s}" for n, s in diverged.items()) + ".\n")
  text.append("Figures: " + report.figure_links(figs) + "\n")
  text.append(table(runs, dataset, diverged))
  return report.write_markdown(out_dir, text)
