"""The training loop on every device: one ``data`` mesh axis over all devices, batches sharded on it,
parameters and optimizer state replicated (data parallel, ``jit`` with ``NamedSharding``: the captured
rows are global arrays, so the statistics see the whole batch, as on one device).

Several processes (hosts, or processes on one machine): :func:`initialize` (``experiments.run.main``'s
``--num_processes``, ``--process_id``, ``--coordinator_address``) joins JAX's multi-controller runtime before
anything else runs; the mesh then spans every process's devices, each process feeds only its own part of
every batch (``jax.make_array_from_process_local_data``), and process 0 alone writes metrics and results
(:func:`is_writer`; checkpoints are written once by orbax). On the CPU the processes reduce with gloo.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.run import supervise


RUNTIME_HEARTBEAT_TIMEOUT_S = 30  # JAX's runtime aborts every process (a fatal log) once a peer is this silent
PEER_SILENT_S = 10  # ... so a peer silent this long ends this process first, with one line
BEAT_S = 1.0


def free_port() -> int:
  """A free TCP port on localhost, for a coordinator on this machine."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
  """Joins the run's ``num_processes`` processes (``process_id`` is this one's; process 0 serves the
  coordinator at ``coordinator_address``, e.g. ``127.0.0.1:12355``). Call before any other JAX work.

  A process that dies (``kill -9``, a crash, a lost host) takes the others down in one line each (exit
  status 1), never a hang: a peer within :data:`PEER_SILENT_S` seconds (:class:`PeerWatch`), process 0, which
  serves the coordinator, at once, through the runtime's own abort; ``experiments.run.main`` turns such an
  abort (and gloo's, for a peer that died mid-transfer) into one line (``supervise.py``)."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's; others have their own
  jax.distributed.initialize(coordinator_address, num_processes, process_id, initialization_timeout=120,
                             heartbeat_timeout_seconds=RUNTIME_HEARTBEAT_TIMEOUT_S)
  watch = PeerWatch()
  watch.start()
  atexit.register(watch.finish)


def collective_failed(e: BaseException) -> None:
  """A step across processes raised ``e`` (a peer's connection closed): the peer watch names a dead peer
  within :data:`PEER_SILENT_S` (and ends this process); else ``e`` is said in one line. Never returns."""
  time.sleep(PEER_SILENT_S + 3 * BEAT_S)
  text = str(e).strip().splitlines()
  _stop(f"a step across processes failed ({type(e).__name__}: {text[0][:200] if text else ''})")


def _stop(why: str) -> None:
  print(supervise.stop_line(why, jax.process_index()), file=sys.stderr, flush=True)
  os._exit(1)  # the main thread may be blocked in a collective with the dead process


class PeerWatch(threading.Thread):
  """Every process posts a heartbeat to the coordinator's key-value store each :data:`BEAT_S`; a peer whose
  heartbeat stops for :data:`PEER_SILENT_S` (a peer that finished says so and is never waited for), or a
  coordinator that stops answering, ends this process with one line on stderr. Without it the survivors
  wait in a collective until the runtime aborts them with a C++ stack trace."""

  def __init__(self):
    super().__init__(daemon=True, name="peer-watch")
    from jax._src import distributed  # the runtime's client (as orbax's multihost utilities use it)

    self._client, self._me, self._n = distributed.global_state.client, jax.process_index(), jax.process_count()
    self._done = threading.Event()

  def _key(self, process: int) -> str:
    return f"scsgd_jax/alive/{process}"

  def finish(self) -> None:
    """This process ends normally: its peers stop watching it."""
    if not self._done.is_set():
      self._done.set()
      try:
        self._client.key_value_set(self._key(self._me), "done", allow_overwrite=True)
      except Exception:  # the coordinator may be gone already at exit
        pass

  def run(self) -> None:
    beat, heard = 0, {p: (None, time.monotonic()) for p in range(self._n) if p != self._me}
    while not self._done.wait(BEAT_S):
      beat += 1
      try:
        self._client.key_value_set(self._key(self._me), str(beat), allow_overwrite=True)
        values = {p: self._get(p) for p in heard}
      except Exception as e:  # noqa: BLE001 - whatever the client raises, the coordinator is gone
        if not self._done.is_set():
          self._die(f"the coordinator (process 0) stopped answering ({type(e).__name__})")
        return
      now = time.monotonic()
      for p, value in values.items():
        if value == "done":
          heard[p] = ("done", now)
        elif value != heard[p][0]:
          heard[p] = (value, now)
        elif heard[p][0] != "done" and now - heard[p][1] > PEER_SILENT_S and not self._done.is_set():
          self._die(f"process {p} of {self._n} stopped (no heartbeat for {PEER_SILENT_S} s)")

  def _get(self, process: int):
    """A peer's last heartbeat, ``None`` before its first."""
    try:
      return self._client.key_value_try_get(self._key(process))
    except Exception as e:  # noqa: BLE001
      if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
        return None
      raise

  def _die(self, why: str) -> None:
    _stop(why)




def is_writer() -> bool:
  """Whether this process writes the run's files (metrics, config, results): process 0."""
  return jax.process_index() == 0


class DataParallel:
  """Placement of batches (sharded over ``data``) and of parameters and state (replicated)."""

  def __init__(self):
    # Auto axis: XLA propagates the batch sharding through the model (capture's row gathers included)
    self.mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    self.batch = NamedSharding(self.mesh, P("data"))
    self.replicated = NamedSharding(self.mesh, P())
    # this process's places on the mesh (its devices' rows of every batch)
    self._places = [i for i, d in enumerate(self.mesh.devices.flat) if d.process_index == jax.process_index()]

  @property
  def size(self) -> int:
    return jax.device_count()

  @property
  def state_sharding(self):
    """Where parameters and optimizer state live (a checkpoint is restored there): replicated over the mesh,
    or ``None`` (the default device) on one device."""
    return self.replicated if self.size > 1 else None

  def describe(self) -> str:
    d = jax.devices()[0]
    hosts = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
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
    return self.shard_rows(x, np.arange(len(x)))

  def local_part(self, n: int) -> slice:
    """The rows of an ``n``-row global batch that this process feeds: its devices' places on the mesh."""
    per = n // self.size
    return slice(self._places[0] * per, (self._places[-1] + 1) * per)

  def shard_rows(self, data: np.ndarray, indices: np.ndarray) -> jax.Array:
    """The global batch ``data[indices]`` placed over ``data``, each process reading only its own rows."""
    if self.size == 1:
      return data[indices]
    if jax.process_count() == 1:
      return jax.device_put(data[indices], self.batch)
    local = data[indices[self.local_part(len(indices))]]
    return jax.make_array_from_process_local_data(self.batch, local, (len(indices),) + data.shape[1:])

  def place(self, x: np.ndarray) -> jax.Array:
    """``x`` sharded if its first axis divides over the devices, else replicated (an evaluation's last batch)."""
    if self.size == 1:
      return x
    return self.shard(x) if len(x) % self.size == 0 else jax.device_put(x, self.replicated)
