"""No binary file is committed outside the results and data folders (a wheel, an archive, a checkpoint left at the
root would ship with every clone)."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = ("experiments/results/",)


def test_no_binary_outside_the_results_folders():
  files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  binary = [f for f in files if not f.startswith(ALLOWED) and (ROOT / f).is_file()
            and b"\0" in (ROOT / f).read_bytes()[:8192]]
  assert binary == []
