"""The sharding study: on 8 host devices every optimizer's state is placed by ``scsgd_jax.state_shardings`` and the
sharded run equals one device's; the record says the per-device bytes against AdamW's."""

import json
import os
import subprocess
import sys

import pytest

from tests import helpers

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("processes, filename", [(1, "benchmark_sharding.json"), (2, "benchmark_sharding_2x4.json")])
def test_smoke_config_runs_and_the_sharded_runs_equal_one_device(tmp_path, processes, filename):
  """On one process of 8 devices, and on 2 processes of 4 (the meshes spanning both)."""
  args = ["--config", "configs/studies/benchmark_sharding.py", "--config.d=16", "--config.hidden=32", "--config.blocks=1",
          "--config.classes=4", "--config.batch=16", "--config.steps=3", f"--config.processes={processes}",
          "--config.optimizers=('adamw', 'muon', 'scsgd', 'scsgd_eigen_muon')", f"--results_dir={tmp_path}"]
  out = subprocess.run([sys.executable, "-m", "experiments.studies.benchmark_sharding", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env={**os.environ, "XLA_FLAGS": helpers.xla_flags(8)})
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / filename) as f:
    record = json.load(f)
  results = record.get("results", record)
  assert results["devices"] == 8 and results["processes"] == processes
  assert set(results["layouts"]) == {"fsdp", "tensor_parallel"}
  for layout, rows in results["layouts"].items():
    assert set(rows) == {"adamw", "muon", "scsgd", "scsgd_eigen_muon"}
    assert rows["adamw"]["state_vs_adamw"] == 1.0
    for name, row in rows.items():
      assert row["max_param_difference_vs_one_device"] < 1e-4, (layout, name, row)
      assert 0 < row["max_param_difference_from_rounding"] < 1e-4, (layout, name, row)
      assert row["difference_vs_rounding"] == pytest.approx(
          row["max_param_difference_vs_one_device"] / row["max_param_difference_from_rounding"])
      assert 0 < row["state_bytes"] <= row["state_bytes_one_device"], (layout, name, row)
