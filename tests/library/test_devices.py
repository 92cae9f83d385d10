"""Several devices: data parallelism under pmap, shard_map and sharded jit, and an FSDP-style kernel sharded
on its input axis, each equal to one device on the concatenated batch. 4 host CPU devices, in their own
process (the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys

from tests import helpers

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multidevice_check.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_data_parallel_and_fsdp_equal_one_device_and_replicas_stay_identical():
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(4)}
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


def test_statistics_fold_every_process_rows_into_one_correlation():
  """2 processes x 2 CPU devices, each feeding half of each batch's rows: the statistics and the update equal
  one device folding all the rows (the statistics are global under jit; no argument needed)."""
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_fold.py")
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(2)}
  procs = [subprocess.Popen([sys.executable, script, str(i), str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  for out, _ in outs:
    r = json.loads(out.strip().splitlines()[-1])
    assert (r["processes"], r["devices"]) == (2, 4)
    assert r["summary"] == {"l1/kernel": "dense C, full C^(1/2), n=12", "l2/kernel": "dense C, rank 4, n=40"}, r
    assert r["statistics_vs_all_rows"] < 1e-5 and r["update_vs_all_rows"] < 1e-5, r
