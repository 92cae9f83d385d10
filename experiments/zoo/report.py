"""The zoo's results: ``results.json`` (per workload and row: the chosen rate, the seeds' final held-out losses,
whether twice the rate still trains) and a README table beside it, from the cells' records."""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import platform
import statistics
import subprocess

import jax

from experiments.zoo import rows as rows_lib

ORDER = ("sgd", "scsgd", "scsgd_no_axes", "adamw", "scsgd_eigen", "muon", "scsgd_eigen_muon", "scsgd_muon")
# The probe records the report reads (experiments.zoo.probe's --out): {file name prefix: (the row probed, its base)}
PROBED = {"probes_eigen_muon_": ("scsgd_eigen_muon", "muon"), "probes_scsgd_": ("scsgd", "sgd")}
# What the probes (the table each heads) show of each pair the family loses, one line a finding, by row probed
EXCEPTIONS = {
    "scsgd_eigen_muon": (
        "`mlp_mixer`, `scsgd_eigen_muon` against `muon` (+0.020): the rate its seed-0 grid chose. It chose 0.16 where "
        "Muon chose 0.04; at Muon's rate the row ends at or below Muon on 3 of 5 seeds (median paired -0.010). At "
        "0.16 no part changed closes the gap; SOAP's two-sided basis comes closest (+0.005, 2 of 5).",
        "`relu_mlp`, `scsgd_eigen_muon` against `muon` (+0.019, no seed below): about half is the sketch's error (C's "
        "exact eigenbasis: median paired +0.016 to +0.007), the rest the one-sided input basis itself on this model "
        "(still no seed below). A 5x fresher basis or a 20-step second moment does not move it. The exact basis needs "
        "the dense statistics the sketch avoids, so no default was taken.",
        "`relu_mlp`, `scsgd_eigen` against `adamw` (+0.004) and `scsgd` against `sgd` (+0.003): within the seeds' "
        "spread, 2 of 5 seeds at or below (median paired +0.002 and +0.006; spreads 0.040 and 0.062); not probed "
        "further.",
        "`scsgd_muon` (the conditioning in front of Muon; no eigenbasis) ends above Muon on 7 of 10 workloads (Gemma "
        "+0.046, no seed below); not probed."),
}
PAIRS = (("scsgd", "sgd"), ("scsgd_no_axes", "sgd"), ("scsgd_eigen", "adamw"), ("scsgd_eigen_muon", "muon"),
         ("scsgd_muon", "muon"))


def provenance() -> dict:
  """The commit (and whether the tree had changes), the library versions and the machine of a record."""
  import flax
  import optax
  git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
  return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "scsgd_jax",
                                                                  "experiments/zoo")),
          "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
          "machine": f"{platform.machine()} {platform.processor() or ''} {jax.devices()[0].device_kind}".strip(),
          "date": datetime.date.today().isoformat()}


def summarize(record: dict) -> dict:
  if "refused" in record:
    return {"learning_rate": None, "final_loss_median": None, "final_loss_range": None, "seeds": 0, "seeds_diverged": 0,
            "double_rate_stable": False, "chosen_at_grid_edge": False, "median_curve": [], "refused": record["refused"]}
  p = record["protocol"]
  finals = [math.inf if r["diverged"] or r["final_loss"] is None else r["final_loss"] for r in p["seeds"]]
  ok = [f for f in finals if math.isfinite(f)]
  middle = statistics.median(finals)  # a diverged seed counts as an infinite loss
  double = p["double"]
  return {"learning_rate": p["chosen_rate"], "final_loss_median": middle if math.isfinite(middle) else None,
          "final_loss_range": [min(ok), max(ok)] if ok else None, "seeds": len(finals),
          "final_losses": [f if math.isfinite(f) else None for f in finals],
          "seeds_diverged": len(finals) - len(ok),
          "double_rate_stable": bool(not double["diverged"] and double["final_loss"] is not None
                                     and double["final_loss"] < double["first_loss"]),
          "chosen_at_grid_edge": p["chosen_rate"] in (p["grid"][0]["rate"], p["grid"][-1]["rate"]),
          "median_curve": _median_curve(p["seeds"])}


def _median_curve(runs) -> list:
  curves = [r["curve"] for r in runs if not r["diverged"]]
  if len(curves) < len(runs) / 2:
    return []
  return [[c[0][0], statistics.median(x[1] for x in c)] for c in zip(*curves)]


def iterations_to(curve: list, target: float):
  return next((step for step, loss in curve if loss <= target), None)


def check_rule(record: dict) -> None:
  """Refuses a record whose runs today's divergence rule (:func:`experiments.zoo.train.diverged_by`) would have
  decided otherwise from their own training losses and held-out curve: a table reads every run under one rule."""
  from experiments.zoo.train import diverged_by
  p = record.get("protocol")
  for run in [] if p is None else p["grid"] + p["seeds"] + [p["double"]]:
    losses, curve = run["train_losses"], run["curve"]
    stops = [k for k in range(1, len(losses)) if diverged_by(losses[:k], [])]
    ends = diverged_by(losses, curve) if not run["diverged"] else diverged_by(losses, [])
    if stops or ends != run["diverged"]:
      raise ValueError(f"{record['workload']}/{record['row']}: the run at rate {run['rate']:g}, seed {run['seed']} "
                       "was decided by another divergence rule than today's: run the cell again.")


def write(workdir: pathlib.Path, results_dir: pathlib.Path) -> dict:
  """``results.json`` and ``README.md`` in ``results_dir``: the committed cells, each cell of ``workdir`` added or put
  in its place."""
  out = {"workloads": {}, "command": "python -m experiments.zoo.run --data_dir ../shared/tfds --workdir workdir/zoo "
                                     "--results_dir experiments/results/zoo"}
  records = [json.loads(p.read_text()) for p in sorted(workdir.glob("*/*.json"))]
  committed = results_dir / "results.json"
  if committed.exists():  # the cells recorded before (their records' summaries) stay; the workdir's replace theirs
    out["workloads"] = json.loads(committed.read_text())["workloads"]
  for rec in records:
    check_rule(rec)
    entry = out["workloads"].setdefault(rec["workload"], {"settings": rec["workload_settings"], "rows": {}})
    entry["rows"][rec["row"]] = {**summarize(rec), "source": rec["source"], "commit": rec["commit"],
                                 "dirty": rec["dirty"], "versions": rec["versions"], "machine": rec["machine"]}
  out["probes"] = [_probe(json.loads(p.read_text()), *probed) for prefix, probed in PROBED.items()
                   for p in sorted(results_dir.glob(prefix + "*.json"))]
  results_dir.mkdir(parents=True, exist_ok=True)
  (results_dir / "results.json").write_text(json.dumps(out, indent=1))
  (results_dir / "README.md").write_text(table(out))
  return out


def _probe(record: dict, row: str, base: str) -> dict:
  """A probe record (:mod:`experiments.zoo.probe`) of ``row`` as the table reads it: each variant's final losses by
  seed, to pair with ``base``'s."""
  return {"row": row, "base": base, "workload": record["workload"], "rate": record["rate"], "command": record["command"],
          "commit": record["commit"], "variants": {v: [None if r["diverged"] else r["final_loss"] for r in runs]
                                                   for v, runs in record["variants"].items()}}


def _probes(out: dict) -> list[str]:
  """Each probe (one part of a row changed at a time, the zoo's seeds) against the row's base, seed by seed, a table
  per row probed, with what it shows (:data:`EXCEPTIONS`)."""
  lines = []
  for row, base in dict.fromkeys((p["row"], p["base"]) for p in out.get("probes", ())):
    probes = [p for p in out["probes"] if p["row"] == row]
    lines += ["", f"## Where `{row}` loses to `{base}`: one part changed at a time (5 seeds, paired with `{base}`'s "
              "runs)", "", f"| workload | rate | variant | median | median paired difference to {base} | seeds at or "
              f"below {base} |", "|---|---|---|---|---|---|"]
    for p in probes:
      reference = out["workloads"][p["workload"]]["rows"][base]
      for variant, losses in p["variants"].items():
        wins, n, median = paired({"final_losses": losses}, reference)
        finite = [f for f in losses if f is not None]
        lines.append(f"| {p['workload']} | {p['rate']:g} | {variant} | {statistics.median(finite):.3f} | "
                     f"{median:+.3f} | {wins} of {n} |")
    lines += [""] + [f"- {text}" for text in EXCEPTIONS.get(row, ())] + ["", "Rebuild: " + "; ".join(
        f"`{p['command']}`" for p in probes)]
  return lines


def _fmt(row: dict, most: int) -> str:
  if row.get("refused"):
    return "refused"
  fewer = f" [{row['seeds']}]" if row["seeds"] < most else ""
  if row["final_loss_median"] is None:
    return "diverged" + fewer
  flag = "" if row["double_rate_stable"] else " (2x: no)"
  lost = f" ({row['seeds_diverged']}/{row['seeds']} diverged)" if row.get("seeds_diverged") else ""
  return f"{row['final_loss_median']:.3f}{lost}{flag}{fewer}"


def _most_seeds(out: dict) -> int:
  return max((row["seeds"] for e in out["workloads"].values() for row in e["rows"].values()), default=0)


def paired(a: dict, b: dict) -> tuple[int, int, float]:
  """Row ``a`` against its base ``b`` seed by seed (the same init and batches): the seeds where ``a`` ends at or
  below ``b`` (a diverged run counts as an infinite loss), the seeds both ran, the median of ``a - b``."""
  inf = lambda f: math.inf if f is None else f
  pairs = list(zip(a["final_losses"], b["final_losses"]))
  diffs = [inf(x) - inf(y) if math.isfinite(inf(x)) or math.isfinite(inf(y)) else 0.0 for x, y in pairs]
  return sum(d <= 0 for d in diffs), len(pairs), statistics.median(diffs)


def _paired(out: dict) -> list[str]:
  """The pairs whose medians differ by less than their seeds' spread, seed by seed (rows recorded with their
  seeds' losses)."""
  lines = []
  for name, entry in out["workloads"].items():
    rows = entry["rows"]
    for a, b in PAIRS:
      if not all(r in rows and rows[r].get("final_losses") and rows[r]["final_loss_range"] for r in (a, b)):
        continue
      spread = max(hi - lo for lo, hi in (rows[a]["final_loss_range"], rows[b]["final_loss_range"]))
      if rows[a]["final_loss_median"] is None or rows[b]["final_loss_median"] is None or abs(
          rows[a]["final_loss_median"] - rows[b]["final_loss_median"]) >= spread:
        continue
      wins, n, median = paired(rows[a], rows[b])
      lines.append(f"| {name} | {a} vs {b} | {wins} of {n} | {median:+.3f} | {spread:.3f} |")
  if not lines:
    return []
  return ["", "## Close pairs, seed by seed (medians closer than the seeds' spread; the same init and batches per "
          "seed)", "", "| workload | pair | seeds at or below the base | median paired difference | spread |",
          "|---|---|---|---|---|"] + lines


def table(out: dict) -> str:
  most = _most_seeds(out)
  lines = ["# The zoo", "", f"Medians of {most} seeds' final held-out loss at each row's chosen rate (`[3]`: a cell "
           "recorded with 3 seeds, before the zoo ran 5; factor-2 grid, warmup + cosine, the same batches for every "
           "row); `(2x: no)`: twice the chosen rate does not train. Rebuild: `" + out["command"] + "`.", "",
           "| workload | " + " | ".join(ORDER) + " |", "|---" * (len(ORDER) + 1) + "|"]
  for name, entry in out["workloads"].items():
    rows = entry["rows"]
    lines.append(f"| {name} | " + " | ".join(_fmt(rows[r], most) if r in rows else "" for r in ORDER) + " |")
  lines += ["", "## Pairs (a row against its base: at or below is a win)", "",
            "| workload | " + " | ".join(f"{a} vs {b}" for a, b in PAIRS) + " |", "|---" * (len(PAIRS) + 1) + "|"]
  for name, entry in out["workloads"].items():
    rows = entry["rows"]
    cells = []
    for a, b in PAIRS:
      if a not in rows or b not in rows or rows[a].get("refused"):
        cells.append("refused" if a in rows else "")
      elif rows[a]["final_loss_median"] is None or rows[b]["final_loss_median"] is None:
        cells.append("loss (diverged)" if rows[a]["final_loss_median"] is None else "win (base diverged)")
      else:
        d = rows[a]["final_loss_median"] - rows[b]["final_loss_median"]
        cells.append(f"{d:+.3f} " + ("win" if d <= 0 else "loss"))
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += _paired(out) + _probes(out)
  lines += ["", "## Iterations to Muon's final loss (median curves)", "", "| workload | muon | scsgd_eigen_muon | ratio |",
            "|---|---|---|---|"]
  for name, entry in out["workloads"].items():
    rows = entry["rows"]
    if "muon" in rows and "scsgd_eigen_muon" in rows and rows["muon"]["median_curve"]:
      target = rows["muon"]["final_loss_median"]
      a, b = (iterations_to(rows[r]["median_curve"], target) for r in ("muon", "scsgd_eigen_muon"))
      lines.append(f"| {name} | {a} | {b if b else 'never'} | {b / a:.2f} |" if a and b else
                   f"| {name} | {a} | {b if b else 'never'} | |")
  rates = ["", "## Chosen rates", "", "| workload | " + " | ".join(ORDER) + " |", "|---" * (len(ORDER) + 1) + "|"]
  for name, entry in out["workloads"].items():
    rows = entry["rows"]
    rates.append(f"| {name} | " + " | ".join(
        (f"{rows[r]['learning_rate']:.3g}" + (" (edge)" if rows[r]["chosen_at_grid_edge"] else ""))
        if r in rows and rows[r]["learning_rate"] else ""
        for r in ORDER) + " |")
  about = ["", "## Workloads", ""] + [f"- `{name}`: {entry['settings'].get('what', '')}; {entry['settings'].get('steps')} "
                                      f"steps, batch {entry['settings'].get('batch')}, {entry['settings'].get('dataset')}"
                                      for name, entry in out["workloads"].items()]
  sources = {r: rows_lib.ROWS[r].source for entry in out["workloads"].values() for r in entry["rows"]
             if r in rows_lib.ROWS}
  about += ["", "## Rows, as their authors run them", ""] + [f"- `{r}`: {sources[r]}" for r in ORDER if r in sources]
  refused = [f"- `{name}` / `{r}`: {row['refused']}" for name, entry in out["workloads"].items()
             for r, row in entry["rows"].items() if row.get("refused")]
  if refused:
    about += ["", "## Refused (the library's one line, at the first update)", ""] + refused
  return "\n".join(lines + rates + about) + "\n"
