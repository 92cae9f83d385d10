"""The convex experiment's report: ``results.json``, PNG plots and ``README.md`` with its tables."""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.run import report
from experiments.run.report import plt

def _spectrum_figure(result, out_dir) -> None:
  fig, ax = plt.subplots(figsize=(6, 4))
  ev = np.asarray(result["eigenvalues"])
  ax.semilogy(np.arange(1, len(ev) + 1), np.maximum(ev, 1e-12))
  for k in result["config"]["ranks"]:
    ax.axvline(k, color="gray", alpha=0.3)
  ax.set_xlabel("index i")
  ax.set_ylabel("eigenvalue of C")
  ax.set_title(f"Spectrum of C ({result['config']['dataset']} pixels, n = {result['n']})")
  report.save_figure(fig, out_dir, "spectrum")


def _suboptimality_figures(result, out_dir) -> None:
  for batch, _ in result["config"]["settings"]:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, mth in result["methods"].items():
      run = mth["runs"][str(batch)]
      style = "-" if name in ("sgd", "full") else ("--" if name.startswith("lowrank") else ":")
      ax.loglog(run["eval_steps"], np.maximum(run["suboptimality"], 1e-6), style,
                label=f"{name} (eta={run['best_step_size']:g})", lw=2 if name in ("sgd", "full") else 1)
    ax.set_xlabel("iteration t")
    ax.set_ylabel("L(W_bar_t) - L(W*)")
    ax.set_title(f"Logistic regression on {result['config']['dataset']}, batch {batch}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    report.save_figure(fig, out_dir, f"suboptimality_batch{batch}")


def _timing_figure(result, out_dir) -> None:
  fig, ax = plt.subplots(figsize=(6, 4))
  tm = result["timing"]
  ns = [r["n"] for r in tm]
  ax.loglog(ns, [r["sketch_s"] for r in tm], "o-", label=f"Algorithm 1 (k={tm[0]['k']})")
  ax.loglog(ns, [r["eigh_s"] for r in tm], "s-", label="eigh(C)")
  ax.loglog(ns, [r["eigh_s"] + r["form_c_s"] for r in tm], "^-", label="form C + eigh(C)")
  ax.set_xlabel("n")
  ax.set_ylabel("seconds")
  ax.legend()
  ax.grid(alpha=0.3, which="both")
  report.save_figure(fig, out_dir, "timing")


def _opening(result, command) -> list[str]:
  """The header, the problem, the plots and the spectrum's table."""
  dataset = result["config"]["dataset"]
  lines = report.header(f"The convex case: multiclass logistic regression on {dataset}", command,
                        result["machine"]) + [
      f"Whole run {result['wall_seconds']:.0f} s.\n",
      f"m = {result['m']} examples, n = {result['n']} (pixels in [0, 1]"
      f"{' + a constant-1 bias coordinate' if result['config']['bias_coordinate'] else ''}), p = {result['p']}. "
      f"L(W*) = {result['l_star']:.6f} (L-BFGS, {result['config']['lbfgs_steps']} steps, "
      f"final gradient norm {result['lbfgs_grad_norm']:.1e}); sigma = ||W*||_sp = {result['sigma_w_star_spectral']:.3f}, "
      f"rho = sqrt(2).\n",
      "Plots: [spectrum.png](spectrum.png), "
      + ", ".join(f"[suboptimality_batch{b}.png](suboptimality_batch{b}.png)" for b, _ in result["config"]["settings"])
      + ", [timing.png](timing.png).\n",
      "## Spectrum and the fast spectral decay property\n",
      f"tr(C) = {result['trace_c']:.4g}, tr(C^(1/2)) = {result['trace_sqrt_c']:.4g}.\n",
      "| k | tr(C_k^(1/2)) | sqrt((n-k)(tr C - tr C_k)) | ratio to tr(C^(1/2)) |",
      "| --- | --- | --- | --- |",
  ]
  for s in result["spectral_decay"]:
    lines.append(f"| {s['k']} | {s['trace_sqrt_c_k']:.4g} | {s['decay_term']:.4g} | {s['decay_over_trace_sqrt_c']:.3f} |")
  return lines


def _conditioners(result) -> list[str]:
  """Lemma 1's bound terms and what SGD measured, per conditioner."""
  settings, eps = result["config"]["settings"], result["config"]["epsilons"]
  single = str(settings[0][0])
  lines = [
      "\n## Conditioners: Lemma 1's bound terms and what SGD measured\n",
      f"Bound = sigma rho / sqrt(T) (tr A + tr A^-1 C) at T = {settings[0][1]} (single-example steps). "
      "Theorem 1: tr(A) tr(A^-1 C) >= tr(C^(1/2))^2 = "
      f"{result['trace_sqrt_c'] ** 2:.4g}, with equality for A = C^(1/2). Best step size per method from the grid "
      f"{list(result['config']['step_sizes'])} by the lowest L(W_bar_T).\n",
  ]
  head = ["conditioner", "tr A", "tr A^-1 C", "tr A + tr A^-1 C", "tr A * tr A^-1 C", "bound"]
  for b, _ in settings:
    head += [f"eta (b={b})", f"L(W_bar_T) - L* (b={b})"] + [f"t to {e} (b={b})" for e in eps]
  lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for name, mth in result["methods"].items():
    cells = [name] + [report.fmt(v, ".4g", "not reached") for v in (
        mth["trace_a"], mth["trace_a_inv_c"], mth["bound_sum"], mth["trace_product"], mth["runs"][single]["bound"])]
    for b, _ in settings:
      run = mth["runs"][str(b)]
      cells += [report.fmt(v, ".4g", "not reached") for v in (run["best_step_size"], run["suboptimality"][-1])]
      cells += [report.fmt(run["iterations_to_eps"][str(e)], ".4g", "not reached") for e in eps]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _iteration_ratio(result) -> list[str]:
  """The introduction's predicted iteration ratio and the measured one per epsilon and batch."""
  settings = result["config"]["settings"]
  lines = [
      "\nIterations to epsilon are read off the evaluation grid (log-spaced steps), so they are upper bounds "
      "at that grid's resolution.\n",
      "## The introduction's iteration ratio\n",
      f"Predicted: tr(W*^T W*) tr(C) / (||W*^T W*||_sp tr(C^(1/2))^2) = **{result['intro_ratio_predicted']:.3g}**.\n",
      "Measured: iterations for SGD / iterations for A = C^(1/2) to first reach L(W_bar_t) - L* <= epsilon, "
      "each at its best step size.\n",
      "| epsilon | " + " | ".join(f"batch {b}" for b, _ in settings) + " |",
      "|" + " --- |" * (1 + len(settings)),
  ]
  for e in result["config"]["epsilons"]:
    cells = []
    for b, _ in settings:
      v = result["iteration_ratio_measured_sgd_over_full"][str(b)][str(e)]
      cells.append(report.fmt(v, ".3g", "not reached") if v is not None else "not reached by both")
    lines.append(f"| {e} | " + " | ".join(cells) + " |")
  return lines


def _lemmas_and_timing(result) -> list[str]:
  """Lemmas 3 and 4 measured, and Algorithm 1's cost against an exact eigendecomposition."""
  lines = [
      "\n## Lemma 3 and Lemma 4, measured\n",
      f"Algorithm 1 from X (r = k + {result['config']['oversample']}, no power iterations), "
      f"{result['config']['lemma_seeds']} seeds per k.\n",
      "| k | Lemma 3: mean ||QQ^T X - X||_F / ||X - X_k||_F (<= 2) | max | "
      "Lemma 4: mean (tr C - tr C~)/(tr C - tr C_k) (<= 4) | max |",
      "| --- | --- | --- | --- | --- |",
  ]
  for k, r in result["lemmas"].items():
    lines.append(f"| {k} | {r['lemma3_mean']:.4f} | {r['lemma3_max']:.4f} | {r['lemma4_mean']:.4f} | {r['lemma4_max']:.4f} |")
  lines += [
      "\n## Cost of Algorithm 1 against an exact eigendecomposition\n",
      "Random ReLU features of the pixels give inputs of dimension n; medians of 3 jitted runs, same process.\n",
      "| n | m | k | Algorithm 1 (s) | form C (s) | eigh C (s) | eigh / Alg. 1 | (form + eigh) / Alg. 1 |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in result["timing"]:
    lines.append(f"| {r['n']} | {r['m']} | {r['k']} | {r['sketch_s']:.4f} | {r['form_c_s']:.4f} | {r['eigh_s']:.4f} | "
                 f"{r['eigh_over_sketch']:.2f}x | {r['form_plus_eigh_over_sketch']:.2f}x |")
  return lines


def write_report(result: dict[str, Any], out_dir: str, command: str) -> str:
  report.write_results(out_dir, result, command, machine=result["machine"])
  _spectrum_figure(result, out_dir)
  _suboptimality_figures(result, out_dir)
  _timing_figure(result, out_dir)
  lines = _opening(result, command) + _conditioners(result) + _iteration_ratio(result) + _lemmas_and_timing(result)
  return report.write_markdown(out_dir, lines)
