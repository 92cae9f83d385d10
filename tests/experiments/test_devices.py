"""The training loop on every local device: the smoke run on 4 host CPU devices (data parallel over a mesh)
equals the run on one device, and the entry point says how many devices it uses."""

import os
import subprocess
import sys

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(workdir, n):
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(n), "PYTHONPATH": ROOT}
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "experiments", "multidevice_train.py"),
                        str(workdir)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_smoke_run_on_four_devices_equals_one_device(tmp_path):
  one = _run(tmp_path / "one", 1)
  four = _run(tmp_path / "four", 4)
  assert one.splitlines()[0] == "devices: 1 device(s) (cpu, cpu), data parallel"
  assert four.splitlines()[0] == "devices: 4 device(s) (cpu, cpu), data parallel"
  helpers.assert_same_training(tmp_path / "one", tmp_path / "four")
