"""The head to head's report: each task's figures from its run records (ranked, with curves and every grid
point) and the summary across tasks. Reads records; never runs anything (the protocol is ``benchmark.py``)."""

from __future__ import annotations

import collections
import json
import os
from typing import Sequence

import numpy as np

from experiments.run import machine
from experiments.optim import registry
from experiments.run import report
from experiments.run import workdir as workdir_lib
from experiments.run.report import plt


UNRECORDED = "unrecorded"  # the code hash of a record written before runs recorded it


def final(record: dict, key_: str = "test_loss") -> float:
  """The run's last logged ``key_`` (its eval split's loss); inf if it diverged or logged none."""
  if record["diverged"]:
    return float("inf")
  evals = [r for r in record["rows"] if key_ in r]
  return evals[-1][key_] if evals else float("inf")


def cpu(record: dict) -> str:
  """The machine the run trained on: its processor and, where recorded, its platform (the kernel build: VMs of one
  processor name differ in speed between hosts); ``unrecorded`` for a record without its machine."""
  m = record.get("machine", {})
  return f"{m['cpu']} ({m['platform']})" if "cpu" in m and m.get("platform") else m.get("cpu", UNRECORDED)


def median(values):
  return float(np.median(values)) if values else None


def spread(values):
  """``[min, max]`` of ``values`` (None without any): the range over seeds a median is read with."""
  return [float(min(values)), float(max(values))] if values else None


def with_range(value, span, spec: str = ".4f") -> str:
  """``value`` formatted, then ``[min, max]`` when the seeds differ (one seed, or equal ones: the value alone)."""
  text = report.fmt(value, spec)
  if span and span[0] != span[1]:
    text += f" [{report.fmt(span[0], spec)}, {report.fmt(span[1], spec)}]"
  return text


def summarize(config, results: dict[str, dict], anchors: dict) -> dict:
  """Per optimizer its figures over seeds; the target; ratios. ``results``: ``Harness.optimizer`` outputs."""
  finals = {n: median([final(r) for r in o["seeds"].values()]) for n, o in results.items()}
  baselines = [n for n in config.benchmark.target_from if n in finals] or list(finals)
  target = min(finals[n] for n in baselines)
  out = {"target": target, "target_from": baselines, "anchors": anchors, "optimizers": {}}
  for name, o in results.items():
    recs = list(o["seeds"].values())
    hits = [report.first_at_or_below(r["rows"], target) for r in recs]
    its = [h[0] for h in hits if h[0] is not None]
    secs = [h[1] for h in hits if h[1] is not None]
    lasts = [r["rows"][-1] for r in recs if r["rows"] and not r["diverged"]]
    step_ms = median([1e3 * r["train_time"] / r["step"] for r in lasts])
    lrs = sorted({p.learning_rate for p in o["tried"] if p.joint == o["point"].joint})
    reports = [r["report"] for r in recs] if all("report" in r for r in recs) else []  # each seed's, or none
    out["optimizers"][name] = {
        "learning_rate": o["point"].learning_rate, "joint": dict(o["point"].joint),
        "at_grid_edge": len(lrs) > 1 and o["point"].learning_rate in (lrs[0], lrs[-1]),
        "kept": name in config.benchmark.get("points", {}),  # chosen on an earlier table of the task
        "source": registry.recipe(name, config.benchmark.kind).source,
        "settings": recs[0]["config"][workdir_lib.RESOLVED_KEY],
        "seeds": sorted(o["seeds"]), "commits": sorted({r["commit"] for r in recs}),
        "code_hashes": sorted({r.get("code_hash", UNRECORDED) for r in recs}),
        "reached": f"{len(its)}/{len(hits)}",
        "iterations_median": median(its) if len(its) == len(hits) else None,
        "iterations_range": [min(its), max(its)] if its else None,
        "seconds_median": median(secs) if len(secs) == len(hits) else None,
        "final_loss_median": finals[name],
        "final_loss_range": spread([final(r) for r in recs]),
        "final_error_median": median([final(r, "test_error") for r in recs]),
        "report_loss_median": median([r["loss"] for r in reports]),
        "report_error_median": median([r["error"] for r in reports]),
        "report_loss_range": spread([r["loss"] for r in reports]),
        "step_ms_median": step_ms,
        "state_bytes": recs[0]["state_bytes"],
        "diverged_seeds": sum(r["diverged"] for r in recs),
        "load_average_1min_max": max(max(r["load_average_1min"]) for r in recs),
        "machines": sorted({cpu(r) for r in recs}),
        "grid": {p.tag(): v for p, v in sorted(o["tried"].items())},
    }
  # the table compares like with like only if every row ran the same library and training code
  counts = collections.Counter(h for o in out["optimizers"].values() for h in o["code_hashes"])
  out["code_hashes"] = dict(counts)
  common = counts.most_common(1)[0][0] if counts else None
  for o in out["optimizers"].values():
    o["other_code"] = len(counts) > 1 and o["code_hashes"] != [common]
  # step times compare only on one machine: a row's ratio to SGD is given only if all its seeds and all SGD's
  # ran on one processor, the same
  out["machines"] = sorted({c for o in out["optimizers"].values() for c in o["machines"]})
  sgd = out["optimizers"].get("sgd")
  for s in out["optimizers"].values():
    same = sgd is not None and len(sgd["machines"]) == 1 and s["machines"] == sgd["machines"]
    s["step_time_vs_sgd"] = (s["step_ms_median"] / sgd["step_ms_median"]
                             if same and sgd["step_ms_median"] and s["step_ms_median"] else None)
    # the race in SGD's steps: iterations to the target at this row's step cost
    s["sgd_steps_to_target"] = (s["iterations_median"] * s["step_time_vs_sgd"]
                                if s["iterations_median"] and s["step_time_vs_sgd"] else None)
  return out


def orders(summary: dict) -> dict[str, list[str]]:
  """The rows ranked each way: by iterations to the target (the table's order), by measured training seconds to
  it, and by final validation loss (a row that never reached the target ranks after those that did)."""
  o, inf = summary["optimizers"], float("inf")
  return {"iterations": rank(summary),
          "seconds": sorted(o, key=lambda n: (o[n].get("seconds_median") or inf, o[n]["final_loss_median"])),
          "final loss": sorted(o, key=lambda n: (o[n]["final_loss_median"], n))}


def orders_said(summary: dict) -> list[str]:
  """The report's sentences on how the rankings differ (the race by iterations and by seconds, the final loss)."""
  by = orders(summary)
  reached = [n for n in by["iterations"] if summary["optimizers"][n]["iterations_median"]]
  by_time = [n for n in by["seconds"] if n in reached]
  lines = [f"Ranked by measured training seconds to the target: {', '.join(by_time)}"
           + (" (as by iterations)" if by_time == reached else "") + "; by final "
           f"validation loss: {', '.join(by['final loss'])}."]
  if by["final loss"][0] != by["iterations"][0]:
    lines.append(f"**The race and the final loss rank rows differently:** {by['iterations'][0]} reaches the target "
                 f"first, {by['final loss'][0]} ends lowest.")
  if reached and by["seconds"][0] != by["iterations"][0]:
    lines.append(f"**By time the race differs:** {by['seconds'][0]} reaches the target in the fewest training seconds, "
                 f"{by['iterations'][0]} in the fewest iterations.")
  return lines


def rank(summary: dict) -> list[str]:
  """Optimizers by iterations to the target (not reached: last), then final validation loss, then test loss."""
  inf = float("inf")
  return sorted(summary["optimizers"], key=lambda n: (
      summary["optimizers"][n]["iterations_median"] or inf, summary["optimizers"][n]["final_loss_median"],
      summary["optimizers"][n]["report_loss_median"] or inf))


def _median_curve(records: Sequence[dict], key_: str, x: str):
  runs = [[(r[x], r[key_]) for r in rec["rows"] if key_ in r] for rec in records]
  n = min(len(r) for r in runs)
  return ([float(np.median([r[i][0] for r in runs])) for i in range(n)],
          [float(np.median([r[i][1] for r in runs])) for i in range(n)])


def _figures(config, results, anchors, summary, results_dir) -> list[str]:
  """The median loss curves against iterations and against training seconds."""
  figs = []
  for x, label in (("step", "iteration"), ("train_time", "training seconds")):
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name in rank(summary):
      xs, ys = _median_curve(list(results[name]["seeds"].values()), "test_loss", x)
      ax.plot(xs, ys, label=f"{name} (lr {summary['optimizers'][name]['learning_rate']:g})")
    ax.axhline(summary["target"], color="gray", ls="--", lw=1, label="target")
    for i, (anchor, v) in enumerate(anchors.get(config.eval_split, {}).items()):
      ax.axhline(v, color="black", ls=":", lw=1)
      ax.annotate(anchor, (0.01, v), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel(f"{config.eval_split} loss (median of seeds)")
    ax.set_title(f"{config.dataset} / {config.model}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    figs.append(report.save_figure(fig, results_dir, f"loss_vs_{x}"))
  return figs


def _opening(config, summary, anchors, figs, command, m) -> list[str]:
  """The header, the protocol, the anchors, the figures and the table's head."""
  b = config.benchmark
  s_ = summary["optimizers"]
  machines = summary["machines"]
  lines = report.header(f"Head to head: {config.model} on {config.dataset}", command, m) + [
      *([f"**The rows ran on {len(machines)} machines**, not only the one above, which wrote this report "
         "(processor: rows): " + "; ".join(
          f"{c}: " + ", ".join(n for n in rank(summary) if c in s_[n]["machines"]) for c in machines)
         + ". ms/step compares rows of one machine only; vs SGD is given only for a row that ran where SGD ran.\n"]
        if len(machines) > 1 else []),
      f"Budget {config.num_steps} iterations at batch {config.batch_size}; schedule {dict(config.schedule)} "
      f"(peak = the tuned rate); trained on `{config.train_split}`, chosen on `{config.eval_split}`, reported on "
      f"`{b.report_split}`. Rates: each optimizer's authors' rate (or its centre in the config, "
      f"`benchmark.centres`) x {list(b.grid)}, one full-budget run per "
      f"rate on seed 0, the grid grown past a winning end (at most {b.extend_edge} steps), chosen by final "
      f"{config.eval_split} loss; then seeds {list(b.seeds)} at the chosen rate. Target: "
      f"{summary['target']:.4f}, the best final {config.eval_split} loss (median of seeds) of "
      f"{', '.join(summary['target_from'])}. Every run's record, with its command, commit, package versions and "
      "resolved settings, is under [runs/](runs/).\n",
      "Sanity anchors (a trivial model's loss): " + "; ".join(
          f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in a.items()) for split, a in anchors.items()) + "\n",
      "Figures: " + report.figure_links(figs) + "\n",
      *([f"**The rows ran {len(summary['code_hashes'])} versions of the library and training code** (code hash: "
         "rows): " + ", ".join(f"{h} ({n})" for h, n in summary["code_hashes"].items()) + ". Rows marked * ran "
         "another than the most common: the table does not compare them like with like; re-run them.\n"]
        if len(summary["code_hashes"]) > 1 else []),
      f"| rank | optimizer | lr | reached | iterations to target (median [range]) | final {config.eval_split} loss (median [range]) | "
      f"final {b.report_split} loss (median [range]) | {b.report_split} error | ms/step | vs SGD | "
      "training s to target | in SGD steps | state bytes | seeds |",
      "|" + " --- |" * 14]
  return lines


def _rows(summary) -> list[str]:
  """The table's rows, best first."""
  s_, lines = summary["optimizers"], []
  for i, name in enumerate(rank(summary), 1):
    s = s_[name]
    joint = "".join(f", {k} {v:g}" for k, v in s["joint"].items())
    edge = " (kept)" if s.get("kept") else " (edge)" if s["at_grid_edge"] else ""
    its = f"{report.fmt(s['iterations_median'], '.0f')} [{', '.join(map(str, s['iterations_range'] or []))}]"
    lines.append(
        f"| {i} | {name}{' *' if s['other_code'] else ''} | {s['learning_rate']:g}{joint}{edge} | {s['reached']} | {its} | "
        f"{with_range(s['final_loss_median'], s['final_loss_range'])} | "
        f"{with_range(s['report_loss_median'], s['report_loss_range'])} | {report.fmt(s['report_error_median'], '.2f', percent=True)} | "
        f"{report.fmt(s['step_ms_median'], '.1f')} | {report.fmt(s['step_time_vs_sgd'], '.2f')} | "
        f"{report.fmt(s.get('seconds_median'), '.1f')} | {report.fmt(s.get('sgd_steps_to_target'), '.0f')} | "
        f"{s['state_bytes']:,} | {len(s['seeds'])} |")
  return lines


def _closing(config, summary, missing) -> list[str]:
  """What the marks and columns mean, every grid point, and each row's settings and source."""
  s_ = summary["optimizers"]
  machines = summary["machines"]
  lines = [*orders_said(summary)]
  if missing:
    lines += ["", f"Not run yet (or not complete): {', '.join(missing)}."]
  kept = (" (kept): the rate the row chose on an earlier table of this task (its updates unchanged since; the config "
          "names the table), its seed 0 run again here." if any(s_[n].get("kept") for n in s_) else "")
  lines += ["", "(edge): the chosen rate is at an end of the grid even after growing it, so the grid may not "
            f"bracket the best rate.{kept} ms/step: training seconds per step (compilation, evaluation and "
            "checkpoints excluded), median of seeds; training s to target: those seconds until the first evaluation "
            "at or below the target, median of seeds (every seed must reach it); in SGD steps: iterations to the "
            "target times the row's step over SGD's (vs SGD), the race at SGD's step cost; the rows ran one after "
            "another on "
            + (f"{machines[0]}" if len(machines) == 1 else "the machines named above")
            + ", the load average of each is in results.json (`load_average_1min_max`).", "",
            f"Every grid point (final {config.eval_split} loss, seed 0; inf = diverged):", "",
            "| optimizer | grid |", "| --- | --- |"]
  for name in rank(summary):
    lines.append(f"| {name} | " + ", ".join(f"{p}: {v:.4f}" for p, v in s_[name]["grid"].items()) + " |")
  lines += ["", "Settings and their sources (`experiments/optim/registry.py`):", ""]
  for name in rank(summary):
    lines.append(f"- **{name}** ({', '.join(s_[name]['commits'])}; code {', '.join(s_[name]['code_hashes'])}): "
                 f"{s_[name]['source']}.")
  return lines


def write_report(config, results: dict[str, dict], anchors: dict, results_dir: str, command: str,
                 missing: Sequence[str] = ()) -> str:
  summary = summarize(config, results, anchors)
  m = machine.describe()
  settings = json.loads(config.to_json_best_effort())
  report.write_results(results_dir, {**summary, "settings": settings, "missing": list(missing)}, command, machine=m)
  figs = _figures(config, results, anchors, summary, results_dir)
  lines = _opening(config, summary, anchors, figs, command, m) + _rows(summary) + [""] + _closing(
      config, summary, missing)
  return report.write_markdown(results_dir, lines)


def write_summary(root: str, tasks: Sequence[str] = ()) -> str:
  """``<root>/README.md``: per task, its optimizers ranked, from every ``<root>/<task>/results.json``."""
  lines = ["# Head to head: summary", "",
           "Per task, optimizers ranked by iterations to the target (the best final validation loss, median of the "
           "task's seeds, of Nesterov SGD and AdamW), then final validation and test loss; optimizer-state bytes and "
           "step time against SGD's. Protocol: experiments/head_to_head/benchmark.py (rates tuned at the full budget, warmup + "
           "cosine, every peer as its authors run it, cited in experiments/optim/registry.py). Each task's folder holds its "
           "report, curves, every grid point and every run's record.", "",
           "| task | rank | optimizer | lr | iterations to target | final validation loss | final test loss | "
           "state bytes | step vs SGD |", "| --- |" + " --- |" * 8]
  for task in sorted(os.listdir(root)):
    path = os.path.join(root, task, "results.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      result = json.load(f)
    if "target_from" not in result:  # a results file of the earlier protocol
      continue
    for i, name in enumerate(rank(result), 1):
      s = result["optimizers"][name]
      lines.append(f"| [{task}]({task}/README.md) | {i} | {name} | {s['learning_rate']:g} | "
                   f"{report.fmt(s['iterations_median'], '.0f')} ({s['reached']}) | {s['final_loss_median']:.4f} | "
                   f"{report.fmt(s['report_loss_median'], '.4f')} | {s['state_bytes']:,} | "
                   f"{report.fmt(s['step_time_vs_sgd'], '.2f')} |")
    if result.get("missing"):
      lines.append(f"| [{task}]({task}/README.md) | - | not yet run: {', '.join(result['missing'])} | | | | | | |")
  missing = [t for t in tasks if not os.path.exists(os.path.join(root, t, "results.json"))]
  if missing:
    lines += ["", f"No results yet for: {', '.join(missing)} (the commands are in experiments/README.md)."]
  return report.write_markdown(root, lines)
