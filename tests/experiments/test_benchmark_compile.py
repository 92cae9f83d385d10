"""The compile study: its kernel count read from a hand-written HLO module, and its smoke config end to end (fresh
processes, medians, ratios)."""

import json
import os
import subprocess
import sys

import pytest

from experiments.studies import benchmark_compile

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HLO = """HloModule jit_update

fused_computation.1 {
  param_0 = f32[8]{0} parameter(0)
  multiply.1 = f32[8]{0} multiply(param_0, param_0)
  ROOT add.1 = f32[8]{0} add(multiply.1, param_0)
}

region_0.2 {
  p = (s32[], f32[8]{0}) parameter(0)
  gte = s32[] get-tuple-element(p), index=0
  ROOT sort.1 = f32[8]{0} sort(f32[8]{0} gte), dimensions={0}
}

ENTRY main.3 {
  Arg_0.1 = f32[8]{0} parameter(0)
  constant.1 = f32[] constant(1)
  fusion.1 = f32[8]{0} fusion(Arg_0.1), kind=kLoop, calls=fused_computation.1
  dot.1 = f32[] dot(fusion.1, Arg_0.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  bitcast.1 = f32[8]{0} bitcast(fusion.1)
  ROOT tuple.1 = (f32[], f32[8]{0}) tuple(dot.1, bitcast.1)
}
"""


def test_kernels_counts_what_runs_outside_fusion_bodies():
  # the entry's fusion and dot, the control flow body's sort; not the fusion's body, parameters, constants, tuples,
  # bitcasts or get-tuple-elements
  assert benchmark_compile.kernels(HLO) == 3


def test_smoke_config_writes_medians_and_ratios(tmp_path):
  args = ["--config", "configs/studies/benchmark_compile.py", "--config.models=('transformer_lm_1', 'transformer_lm_2')",
          "--config.optimizers=('sgd', 'scsgd', 'scsgd+apart')", "--config.repeats=1", f"--results_dir={tmp_path}"]
  out = subprocess.run([sys.executable, "-m", "experiments.studies.benchmark_compile", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / "benchmark_compile_depth.json") as f:
    record = json.load(f)
  results = record.get("results", record)
  rows = results["medians"]
  assert set(rows) == {"transformer_lm_1", "transformer_lm_2"}
  for by in rows.values():
    assert set(by) == {"sgd", "scsgd", "scsgd+apart"}
    assert all(r["step_s"] > 0 and r["update_kernels"] > 0 for r in by.values())
    # SCSGD's update holds SGD's and its conditioning's: more kernels; with the refresh apart, fewer, and the
    # refresh's own program the rest
    assert by["scsgd"]["update_kernels"] > by["scsgd+apart"]["update_kernels"] > by["sgd"]["update_kernels"]
    assert by["scsgd+apart"]["refresh_s"] > 0 and by["scsgd+apart"]["refresh_kernels"] > 0
  ratios = results["ratios"]
  assert ratios["step_vs_sgd"]["transformer_lm_1"]["sgd"] == 1.0
  assert set(ratios["step_and_refresh_vs_sgd"]["transformer_lm_1"]) == {"scsgd+apart"}
  deep, small = (rows[m]["scsgd"]["update_kernels"] - rows[m]["sgd"]["update_kernels"]
                 for m in ("transformer_lm_2", "transformer_lm_1"))
  assert ratios["depth_ratio"]["scsgd"]["added"] == [small, deep]
