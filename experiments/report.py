"""Report helpers shared by every experiment: the header (command and machine), figures, the page."""

from __future__ import annotations

import os
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (re-exported for the reports' figures)

from experiments import machine as machine_lib  # noqa: E402


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
