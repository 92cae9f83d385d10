"""Figures and the Markdown table of a comparison, beside the paper's numbers (Figures 1-4)."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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


def write_markdown(out_dir: str, lines: list[str]) -> str:
  """Writes ``lines`` as ``<out_dir>/README.md`` (the report page of a results folder); returns its path."""
  path = os.path.join(out_dir, "README.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


def read_metrics(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


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
    fig.tight_layout()
    path = os.path.join(out_dir, f"{metric}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def _at(rows, metric, step) -> Optional[float]:
  for r in rows:
    if r["step"] == step and metric in r:
      return r[metric]
  return None


def _fmt(v, pct=False):
  if v is None:
    return "n/a"
  return f"{100 * v:.2f}%" if pct else f"{v:.4f}"


def time_to_target(rows, target: float, metric: str = "test_loss"):
  """First evaluated step whose ``metric`` is <= target, and its training time (s)."""
  for r in rows:
    if metric in r and r[metric] <= target:
      return r["step"], r["train_time"]
  return None, None


def table(runs: dict[str, list[dict]], dataset: str) -> str:
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
        cells.append(_fmt(_at(runs[name], metric, step), pct))
        if name in paper and metric in paper[name]:
          cells.append(_fmt(paper[name][metric].get(step), pct))
      lines.append("| " + " | ".join(cells) + " |")
  if "sgd" in runs:
    final = [r for r in runs["sgd"] if "test_loss" in r][-1]
    target = final["test_loss"]
    lines += [
        f"\n**Time to SGD's final test loss** ({target:.4f} at iteration {final['step']}; "
        f"SGD's training time {final['train_time']:.1f} s)\n",
        "| optimizer | first iteration at or below | iterations vs SGD | training time (s) | time vs SGD |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in names:
      step, secs = time_to_target(runs[name], target)
      if step is None:
        lines.append(f"| {name} | not reached | - | - | - |")
      else:
        lines.append(f"| {name} | {step} | {step / final['step']:.2f}x | {secs:.1f} | "
                     f"{secs / final['train_time']:.2f}x |")
    lines.append("\nTraining time counts the jitted training steps only (compilation, evaluation and checkpointing "
                 "excluded).")
  return "\n".join(lines) + "\n"


def write_report(runs: dict[str, list[dict]], dataset: str, out_dir: str, command: str,
                 machine: Optional[dict] = None) -> str:
  os.makedirs(out_dir, exist_ok=True)
  for name, rows in runs.items():
    with open(os.path.join(out_dir, f"metrics_{name}.jsonl"), "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
  figs = plot(runs, dataset, out_dir)
  text = [f"# {dataset}: {', '.join(runs)}\n", "Produced by:\n", "```", command, "```\n"]
  if machine:
    text.append(f"Machine: {machine.get('cpu')} ({machine.get('cores')} cores), JAX {machine.get('jax')} "
                f"on {machine.get('backend')}.\n")
  text.append("Figures: " + ", ".join(f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in figs) + "\n")
  text.append(table(runs, dataset))
  return write_markdown(out_dir, text)
