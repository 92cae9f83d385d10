"""Run by test_devices.py as 2 processes x 2 CPU devices (argv: process id, coordinator port): the library's
statistics under ``jit`` are global. Each process feeds only its half of every batch of input rows (a global
array sharded over all 4 devices); the folded statistics and the update equal those of this process folding
all the rows on one device. Prints one JSON line."""

import json
import os
import sys

if __name__ == "__main__":
  # test_devices.py passes its flags (tests/helpers.py: 2 devices, compiled for speed of compiling)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  os.environ["JAX_PLATFORMS"] = "cpu"  # host CPU devices, also on a machine with an accelerator

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import scsgd_jax as sk  # noqa: E402


def main(process_id: int, port: int):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows_sharding, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  rng = np.random.default_rng(0)
  params = {"l1": {"kernel": jnp.asarray(rng.standard_normal((12, 6)), jnp.float32)},
            "l2": {"kernel": jnp.asarray(rng.standard_normal((40, 3)), jnp.float32)}}
  tx = sk.scsgd(0.1, sk.Conditioning(rank=4, refresh=sk.Refresh(every=2),
                                     statistics=sk.Statistics(kind="dense")))  # l1: the full C^(1/2); l2: sketched
  local_device = jax.local_devices()[0]
  step = jax.jit(lambda g, s, x1, x2: tx.update(g, s, params, layer_inputs={"l1": {"kernel": x1}, "l2": {"kernel": x2}}))
  state_global = jax.device_put(tx.init(params), replicated)
  state_local = jax.device_put(tx.init(params), local_device)
  half = slice(process_id * 32, (process_id + 1) * 32)
  for i in range(5):
    x1 = rng.standard_normal((64, 12)).astype(np.float32) * np.linspace(0.2, 3, 12).astype(np.float32)
    x2 = rng.standard_normal((64, 40)).astype(np.float32)
    g = jax.tree.map(lambda p: jnp.full(p.shape, 0.01 * (i + 1), jnp.float32), params)
    # each process feeds only its half of the rows; the global arrays hold all 64
    gx1 = jax.make_array_from_process_local_data(rows_sharding, x1[half], x1.shape)
    gx2 = jax.make_array_from_process_local_data(rows_sharding, x2[half], x2.shape)
    u_global, state_global = step(jax.device_put(g, replicated), state_global, gx1, gx2)
    u_local, state_local = step(jax.device_put(g, local_device), state_local, jax.device_put(x1, local_device),
                                jax.device_put(x2, local_device))
  stats_err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(1.0, float(np.abs(np.asarray(b)).max())))
                  for a, b in zip(jax.tree.leaves(state_global[0].statistics), jax.tree.leaves(state_local[0].statistics)))
  update_err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(1.0, float(np.abs(np.asarray(b)).max())))
                   for a, b in zip(jax.tree.leaves(u_global), jax.tree.leaves(u_local)))
  print(json.dumps({"processes": jax.process_count(), "devices": jax.device_count(), "statistics_vs_all_rows": stats_err,
                    "update_vs_all_rows": update_err, "summary": state_global[0].summary()}), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
