"""The training loop on every device: one ``data`` mesh axis over all devices, batches sharded on it,
parameters and optimizer state replicated (data parallel, ``jit`` with ``NamedSharding``: the captured
rows are global arrays, so the statistics see the whole batch, as on one device).

Multi-host: call ``jax.distributed.initialize()`` before anything else on each host (on Cloud TPU and
Slurm it needs no arguments); the mesh then spans every host's devices, and each host feeds only its own
part of every batch (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class DataParallel:
  """Placement of batches (sharded over ``data``) and of parameters and state (replicated)."""

  def __init__(self):
    # Auto axis: XLA propagates the batch sharding through the model (capture's row gathers included)
    self.mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    self.batch = NamedSharding(self.mesh, P("data"))
    self.replicated = NamedSharding(self.mesh, P())

  @property
  def size(self) -> int:
    return jax.device_count()

  def describe(self) -> str:
    d = jax.devices()[0]
    hosts = f" on {jax.process_count()} hosts" if jax.process_count() > 1 else ""
    return f"{jax.device_count()} device(s) ({d.platform}{', ' + d.device_kind if d.device_kind else ''}){hosts}, data parallel"

  def replicate(self, tree):
    if self.size == 1:  # one device: plain placement (a mesh would engage the SPMD partitioner for nothing)
      return tree
    return jax.device_put(tree, self.replicated)

  def shard(self, x: np.ndarray) -> jax.Array:
    """A global batch ``x`` (every host holds all of it) placed with its first axis over ``data``."""
    if self.size == 1:
      return x
    if jax.process_count() == 1:
      return jax.device_put(x, self.batch)
    local = np.split(np.asarray(x), jax.process_count())[jax.process_index()]
    return jax.make_array_from_process_local_data(self.batch, local)

  def place(self, x: np.ndarray) -> jax.Array:
    """``x`` sharded if its first axis divides over the devices, else replicated (an evaluation's last batch)."""
    if self.size == 1:
      return x
    return self.shard(x) if len(x) % self.size == 0 else jax.device_put(x, self.replicated)
