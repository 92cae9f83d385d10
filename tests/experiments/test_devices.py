"""The training loop on every local device: the smoke run on 4 host CPU devices (data parallel over a mesh)
equals the run on one device, and the entry point says how many devices it uses."""

import os
import subprocess
import sys

import jax
import numpy as np

import scsgd_jax
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(workdir, n):
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "PYTHONPATH": ROOT}
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "experiments", "multidevice_train.py"),
                        str(workdir)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_smoke_run_on_four_devices_equals_one_device(tmp_path):
  one = _run(tmp_path / "one", 1)
  four = _run(tmp_path / "four", 4)
  assert one.splitlines()[0] == "devices: 1 device(s) (cpu, cpu), data parallel"
  assert four.splitlines()[0] == "devices: 4 device(s) (cpu, cpu), data parallel"
  (a, sa), (b, sb) = helpers.final_state(str(tmp_path / "one")), helpers.final_state(str(tmp_path / "four"))
  assert sa == sb == 40
  # A factor is compared by the operator A^{-1} it applies: the basis Q is defined up to the sign of each
  # column (and a rotation within a near-degenerate eigenspace), which LAPACK picks from rounding-level
  # differences such as the order of the 4 devices' sums.
  is_factor = lambda x: isinstance(x, scsgd_jax.Factor)
  for x, y in zip(jax.tree.leaves(a, is_leaf=is_factor), jax.tree.leaves(b, is_leaf=is_factor), strict=True):
    if is_factor(x):
      x, y = scsgd_jax.inverse_matrix(x), scsgd_jax.inverse_matrix(y)
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5 * max(1.0, float(np.abs(y).max())))
