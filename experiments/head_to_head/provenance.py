"""Where every committed result came from, machine-written: ``experiments/results/provenance.json``.

  python -m experiments.head_to_head.provenance [--results_dir experiments/results]

For every results file that records a commit (each head-to-head run's record, each report), its commit and
command; for each table of runs (a head-to-head task, the development task), the commits its rows ran at and,
between consecutive commits, the library and training code files that changed (``report.TRAINING_CODE``, what
a record's code hash covers), so a reader sees at once whether all rows ran the same library and training code.
The prose docs cite this file instead of commits.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
from typing import Optional

from absl import app
from absl import flags

from experiments.run import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = "provenance.json"

FLAGS = flags.FLAGS


def _git(*args: str) -> Optional[str]:
  out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
  return out.stdout.strip() if out.returncode == 0 else None


def _order(commits) -> list[str]:
  """``commits`` oldest first (by commit time; unknown commits last, by name)."""
  when = {c: _git("show", "-s", "--format=%ct", c) for c in commits}
  return sorted(commits, key=lambda c: (when[c] is None, int(when[c] or 0), c))


def code_changes(older: str, newer: str) -> Optional[list[str]]:
  """The code files that differ between two commits (``None``: a commit is not in this history)."""
  out = _git("diff", "--name-only", older, newer, "--", *report.TRAINING_CODE)
  return None if out is None else [f for f in out.splitlines() if f]


def table(records: dict[str, dict]) -> dict:
  """``{"commits": {commit: row count}, "code_changes": [...]}`` for the rows of one table."""
  by_commit = collections.Counter(r["commit"] for r in records.values())
  ordered = _order(by_commit)
  changes = [{"from": a, "to": b, "files": code_changes(a, b)} for a, b in zip(ordered, ordered[1:])]
  return {"rows": len(records), "commits": {c: by_commit[c] for c in ordered},
          "same_code": all(c["files"] == [] for c in changes), "code_changes": changes}


def collect(results_dir: str) -> dict:
  files, tables = {}, collections.defaultdict(dict)
  for folder, _, names in sorted(os.walk(results_dir)):
    for name in sorted(names):
      if not name.endswith(".json") or name == OUT:
        continue
      path = os.path.join(folder, name)
      with open(path) as f:
        try:
          rec = json.load(f)
        except json.JSONDecodeError:
          continue
      if not isinstance(rec, dict) or "commit" not in rec:
        continue
      rel = os.path.relpath(path, results_dir)
      parts = rel.split(os.sep)
      if "runs" in parts:  # one row of a table: <table>/runs/...
        tables[os.sep.join(parts[:parts.index("runs")])][rel] = rec
      else:
        files[rel] = {"commit": rec["commit"], "command": rec.get("command")}
  return {"head": _git("rev-parse", "HEAD"), "files": files,
          "tables": {name: table(records) for name, records in sorted(tables.items())}}


def write(results_dir: str) -> str:
  path = os.path.join(results_dir, OUT)
  with open(path, "w") as f:
    json.dump(collect(results_dir), f, indent=1)
    f.write("\n")
  return path


def main(argv):
  del argv
  path = write(FLAGS.results_dir)
  for name, t in json.load(open(path))["tables"].items():
    print(f"{name}: {t['rows']} rows at {len(t['commits'])} commits; same library and training code: {t['same_code']}")
  print(f"written {path}")


if __name__ == "__main__":
  flags.DEFINE_string("results_dir", os.path.join(ROOT, "experiments", "results"), "The committed results.")
  app.run(main)
