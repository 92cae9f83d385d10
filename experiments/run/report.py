"""Report helpers shared by every experiment: the one results writer (``results.json`` with the command,
machine, commit and package versions), the page (``README.md``) with its header, figures, formatting."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import subprocess
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (re-exported for the reports' figures)

from experiments.run import machine as machine_lib  # noqa: E402
from experiments.run import workdir as workdir_lib  # noqa: E402


def machine_line(machine: Optional[dict] = None) -> str:
  m = machine or machine_lib.describe()
  return f"Machine: {m['cpu']} ({m['cores']} cores), JAX {m['jax']} on {m['backend']}."


def header(title: str, command: str, machine: Optional[dict] = None) -> list[str]:
  """The opening lines of every results page: title, the command that produced it, the machine."""
  return [f"# {title}\n", "Produced by:\n", "```", command, "```\n", machine_line(machine) + "\n"]


def save_figure(fig, out_dir: str, name: str) -> str:
  """Saves ``fig`` as ``<out_dir>/<name>.png`` (110 dpi), closes it, returns the path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.png")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def figure_links(paths: list[str]) -> str:
  return ", ".join(f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in paths)


def write_markdown(out_dir: str, lines: list[str]) -> str:
  """Writes ``lines`` as ``<out_dir>/README.md`` (the page of a results folder); returns its path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "README.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


PACKAGES = ("scsgd-jax", "jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "tensorflow-datasets")


# what decides a run's numbers: the library and the training code (not the reports, the harness or the CLI)
TRAINING_CODE = ("scsgd_jax", "experiments/optim", "experiments/paper/warm_start.py",
                 *(f"experiments/run/{m}.py" for m in ("build", "checkpoints", "data", "devices", "models", "step",
                                                       "train")))


def code_hash(root: str) -> str:
  """SHA-256 (first 16 hex digits) of every file of :data:`TRAINING_CODE` under ``root``, names and contents:
  two runs with the same hash ran the same library and training code, whatever their commits."""
  digest = hashlib.sha256()
  for entry in TRAINING_CODE:
    path = os.path.join(root, entry)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py"))
    for name in files:
      digest.update(os.path.relpath(name, root).encode() + b"\0")
      with open(name, "rb") as f:
        digest.update(f.read() + b"\0")
  return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def provenance() -> dict[str, Any]:
  """The commit of the working tree (``+dirty`` if its code has uncommitted changes) and the package versions,
  read once per process: the code that runs is the code this process imported, even if the checkout
  moves on while it runs (the benchmark's runs take hours)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                            check=True).stdout.strip()
    # code only: the results the runs write (experiments/results/) do not make the code dirty
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)experiments/results"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
    commit += "+dirty" if dirty else ""
  except (OSError, subprocess.CalledProcessError):
    commit = "unknown (not a git checkout)"
  return {"commit": commit, "code_hash": code_hash(root), "versions": machine_lib.package_versions(PACKAGES)}


def write_results(out_dir: str, record: dict[str, Any], command: str, filename: str = "results.json",
                  machine: Optional[dict] = None) -> str:
  """Writes ``record`` as ``<out_dir>/<filename>`` with the command, machine, commit and package versions
  (atomically: a reader never sees half a file); returns its path. Every entry point writes through it."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, filename)
  full = {"command": command, "machine": machine or machine_lib.describe(), **copy.deepcopy(provenance()), **record}
  workdir_lib.write_json_atomic(path, json.dumps(full, indent=1))
  return path


def fmt(v, spec: str = ".4g", none: str = "-", percent: bool = False) -> str:
  """``v`` formatted with ``spec`` (``percent``: ``100 v`` and a ``%``); ``none`` for ``None``; a string as it is."""
  if v is None:
    return none
  if percent:
    return f"{100 * v:{spec}}%"
  if isinstance(v, (bool, str)) or (isinstance(v, int) and spec.endswith("g")):
    return str(v)
  return format(v, spec)


def first_at_or_below(rows: list[dict], target: float, metric: str = "test_loss"):
  """``(step, training seconds)`` of the first row whose ``metric`` is at or below ``target``; ``(None, None)``."""
  for r in rows:
    if metric in r and r[metric] <= target:
      return r["step"], r["train_time"]
  return None, None
