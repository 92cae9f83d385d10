"""Several devices: data parallelism under pmap, shard_map and sharded jit, and an FSDP-style kernel sharded
on its input axis, each equal to one device on the concatenated batch. 4 host CPU devices, in their own
process (the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multidevice_check.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_data_parallel_and_fsdp_equal_one_device_and_replicas_stay_identical():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["devices"] == 4 and r["steps"] == 8  # update_every=3: refreshes at steps 0, 1, 3 (warm), 3, 6
  # pmap with axis_name: replicas bitwise identical, and the one-device run on the whole batch
  assert r["pmap_replicas_identical"] is True
  # without it each replica folds only its shard: they drift apart (what axis_name is for)
  assert r["pmap_without_axis_name_replicas_identical"] is False
  for key in ("pmap", "shard_map", "sharded_jit", "fsdp_jit"):
    assert r[f"{key}_vs_one_device"] < 1e-5, (key, r)
    assert r[f"{key}_statistics_vs_one_device"] < 1e-5, (key, r)
