"""The zoo: every workload trained by every row, each row's rate chosen on a factor-2 grid, 5 seeds at the chosen
rate and one run at twice it. One cell (workload x row) a process; cells already recorded are kept.

  python -m experiments.zoo.run --data_dir ../shared/tfds --workdir workdir/zoo --results_dir experiments/results/zoo

``--workloads`` / ``--rows`` (comma-separated) pick a part; ``--jobs`` cells run at once (default 2).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import pathlib
import subprocess
import sys

from experiments.zoo import report, rows as rows_lib, workloads as wl

SEEDS = (0, 1, 2, 3, 4)  # (cells recorded before the step bound default ran the first 3)
MAX_EXTENSIONS = 3  # grid steps added beyond either edge while the best rate sits on it


def _loss(run: dict) -> float:
  return math.inf if run["diverged"] or run["final_loss"] is None else run["final_loss"]


def protocol(cell) -> dict:
  """The grid, the seeds and the doubled rate of one cell (:class:`experiments.zoo.train.Cell`)."""
  centre = rows_lib.row(cell.row).centre
  grid = {e: cell.run(centre * 2.0 ** e, SEEDS[0]) for e in (-1, 0, 1)}
  for _ in range(MAX_EXTENSIONS):
    best = min(grid, key=lambda e: _loss(grid[e]))
    edge = max(grid) if best == max(grid) else min(grid) if best == min(grid) else None
    if edge is None or math.isinf(_loss(grid[best])):
      break
    step = 1 if edge == max(grid) else -1
    grid[edge + step] = cell.run(centre * 2.0 ** (edge + step), SEEDS[0])
  best = min(grid, key=lambda e: _loss(grid[e]))
  double = grid.get(best + 1) or cell.run(centre * 2.0 ** (best + 1), SEEDS[0])
  seeds = [grid[best]] + [cell.run(centre * 2.0 ** best, s) for s in SEEDS[1:]]
  return {"grid": [grid[e] for e in sorted(grid)], "chosen_rate": centre * 2.0 ** best, "seeds": seeds,
          "double": double}


def run_cell(workload: str, row: str, data_dir: str, out: pathlib.Path) -> None:
  from experiments.zoo import train
  record = {"workload": workload, "row": row, "source": rows_lib.row(row).source,
            "workload_settings": {k: v for k, v in wl.workload(workload)._asdict().items() if k != "make"},
            **report.provenance()}
  try:
    cell = train.Cell(workload, row, data_dir)
    record["protocol"] = protocol(cell)
  except ValueError as e:  # the library refused the model as this row builds it: the table says so
    record["refused"] = str(e).splitlines()[0]
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps(record, indent=1))
  os.replace(tmp, out)


def _spawn(workload: str, row: str, args) -> str:
  out = pathlib.Path(args.workdir) / workload / f"{row}.json"
  if out.exists():
    return f"{workload}/{row}: kept"
  cmd = [sys.executable, "-m", "experiments.zoo.run", "--cell", f"{workload}:{row}", "--data_dir", args.data_dir,
         "--workdir", args.workdir]
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false")
  done = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if done.returncode:
    return f"{workload}/{row}: FAILED\n{done.stderr[-2000:]}"
  return f"{workload}/{row}: done"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data_dir", default="../shared/tfds")
  parser.add_argument("--workdir", default="workdir/zoo")
  parser.add_argument("--results_dir", default=None, help="write results.json and README.md here from the workdir")
  parser.add_argument("--workloads", default=",".join(wl.WORKLOADS))
  parser.add_argument("--rows", default=",".join(rows_lib.ROWS))
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.cell:
    workload, row = args.cell.split(":")
    run_cell(workload, row, args.data_dir, pathlib.Path(args.workdir) / workload / f"{row}.json")
    return
  names, rows = args.workloads.split(","), args.rows.split(",")
  for name in names:
    wl.workload(name)
  for r in rows:
    rows_lib.row(r)
  cells = [(n, r) for n in names for r in rows]
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for line in pool.map(lambda c: _spawn(*c, args), cells):
      print(line, flush=True)
  if args.results_dir:
    report.write(pathlib.Path(args.workdir), pathlib.Path(args.results_dir))


if __name__ == "__main__":
  main()
