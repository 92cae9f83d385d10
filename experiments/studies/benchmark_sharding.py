"""The optimizer state sharded like the parameters, on 8 host CPU devices: per-device state and temporary memory
against AdamW's and Muon's, and the sharded run against one device's.

  python -m experiments.studies.benchmark_sharding --config configs/studies/benchmark_sharding.py [--results_dir experiments/results]

A residual MLP of ``config.blocks`` blocks (Dense ``(d, hidden)`` then ``(hidden, d)``) and a head, its kernels
sharded one of two ways: FSDP (every kernel on its input axis ``n`` over all 8 devices, the batch too) or tensor
parallel (on its output axis ``p`` over ``model`` of a ``(data 2, model 4)`` mesh, the batch over ``data``). Every
optimizer's state is placed by :func:`scsgd_jax.state_shardings` (the parameters' own rule for a plain optax
state: a leaf shaped like a parameter sharded as it, the rest replicated) and kept so by the step's output
shardings. Reported per optimizer and layout: the state's bytes on the fullest device, after ``init`` and after
``config.steps`` steps at each optimizer's registry rate (its authors', times ``config.rate_scale``; refreshes
every ``config.settings``' period); the compiled step's temporary bytes per device
(XLA's memory analysis); and the largest parameter difference from the same steps on one device, beside the
same steps' difference on one device when every input is moved by float32 round-off (``2^-24`` relative): how far
rounding alone moves the run, the scale a sharded fold's reordered sums can move it by.

``--config.processes=2`` runs the same on 2 processes x 4 host devices (``jax.distributed`` on localhost, gloo):
the meshes span both processes, each feeds its part of every batch, and each compares with its own one-device run;
process 0's figures go to ``benchmark_sharding_2x4.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import scsgd_jax  # noqa: E402
from experiments.optim import optimizers  # noqa: E402
from experiments.optim import registry  # noqa: E402
from experiments.run import devices  # noqa: E402
from experiments.run import step as step_lib  # noqa: E402
from experiments.studies import scaffold  # noqa: E402

BASELINE = "adamw"


class ResidualMLP(nnx.Module):

  def __init__(self, d: int, hidden: int, blocks: int, classes: int, rngs: nnx.Rngs):
    self.ups = nnx.List([nnx.Linear(d, hidden, rngs=rngs) for _ in range(blocks)])
    self.downs = nnx.List([nnx.Linear(hidden, d, rngs=rngs) for _ in range(blocks)])
    self.head = nnx.Linear(d, classes, rngs=rngs)

  def __call__(self, x):
    for up, down in zip(self.ups, self.downs):
      x = x + down(jax.nn.relu(up(x)))
    return self.head(x)


def _meshes() -> dict[str, tuple[jax.sharding.Mesh, P, P]]:
  """``{layout: (mesh, a kernel's spec, the batch's spec)}``."""
  auto = jax.sharding.AxisType.Auto
  if jax.device_count() < 8:
    raise RuntimeError(f"benchmark_sharding needs 8 devices, found {jax.device_count()}: run it in a fresh process "
                       "(it sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts).")
  fsdp = jax.make_mesh((8,), ("fsdp",), axis_types=(auto,))
  tp = jax.make_mesh((2, 4), ("data", "model"), axis_types=(auto, auto))
  return {"fsdp": (fsdp, P("fsdp", None), P("fsdp")), "tensor_parallel": (tp, P(None, "model"), P("data"))}


def _param_shardings(params, mesh, kernel_spec):
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, kernel_spec if leaf.ndim == 2 else P()), params)


def _per_device_bytes(tree) -> int:
  """The bytes of ``tree``'s shards on its fullest device."""
  per = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
  return max(per.values()) if per else 0


def _run(config, name: str, mesh, kernel_spec, batch_spec, data) -> dict:
  model = ResidualMLP(config.d, config.hidden, config.blocks, config.classes, nnx.Rngs(0))
  recipe = registry.recipe(name, "transformer")  # as its authors run it (its head named "head"), at their rate
  run = optimizers.variant(config.run, {"name": name, **recipe.settings, **config.settings.get(name, {})})
  run.schedule = ml_collections.ConfigDict({"name": "constant", "base": recipe.learning_rate * config.rate_scale})
  opt = optimizers.create(run, input_axes=scsgd_jax.input_axes_nnx(model))
  graphdef, params, rest = step_lib.split(model)
  ps = _param_shardings(params, mesh, kernel_spec)
  ss = scsgd_jax.state_shardings(opt.tx, params, ps)
  params = jax.device_put(params, ps)  # the same values in every process: each places its own shards
  state = jax.jit(opt.tx.init, out_shardings=ss)(params)
  init_bytes = _per_device_bytes(state)
  step = step_lib.make_train_step(graphdef, opt.tx, opt.capture, None, donate=False).__wrapped__
  replicated = NamedSharding(mesh, P())
  step = jax.jit(step, out_shardings=(ps, replicated, ss, replicated, replicated))
  xs, ys = (jax.device_put(a, NamedSharding(mesh, P(None, *batch_spec))) for a in data)  # (steps, batch, ...)
  key = jax.random.PRNGKey(0)
  compiled = step.lower(params, rest, state, xs[0], ys[0], key).compile()
  memory = compiled.memory_analysis()
  for i in range(config.steps):
    params, rest, state, loss, _ = step(params, rest, state, xs[i], ys[i], jax.random.fold_in(key, i))
  return {"state_bytes_init": init_bytes, "state_bytes": _per_device_bytes(state),
          "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
          "loss": float(loss), "params": _gathered(params, mesh)}


def _max_difference(a, b) -> float:
  return max(float(np.max(np.abs(u - v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _gathered(tree, mesh):
  """``tree``'s values on the host (each process gathers every shard, from every process)."""
  whole = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
  return jax.tree.map(lambda leaf: np.asarray(leaf.addressable_data(0)), whole)


def _processes(config) -> dict:
  """The study as ``config.processes`` processes of ``8 / processes`` host devices each (this command with
  ``--config.process_id``): process 0's results."""
  port, n = devices.free_port(), config.processes
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // n}"}
  children = [subprocess.Popen([sys.executable, "-m", "experiments.studies.benchmark_sharding", *sys.argv[1:],
                                f"--config.process_id={i}", f"--config.port={port}"], env=env, text=True,
                               stdout=subprocess.PIPE) for i in range(n)]
  outs = [child.communicate()[0] for child in children]
  if any(child.returncode for child in children):
    raise RuntimeError(f"a process of the {n}-process run failed (exit statuses {[c.returncode for c in children]})")
  return json.loads(outs[0].strip().splitlines()[-1])


def study(config: ml_collections.ConfigDict, results_dir: str):
  del results_dir
  if config.processes > 1 and config.process_id < 0:
    return _processes(config), f"benchmark_sharding_{config.processes}x{8 // config.processes}.json"
  if config.process_id >= 0:
    devices.initialize(f"127.0.0.1:{config.port}", config.processes, config.process_id)
  out = _study(config)
  if config.process_id >= 0:
    print(json.dumps(out), flush=True)
    return None
  return out, "benchmark_sharding.json"


def _study(config: ml_collections.ConfigDict) -> dict:
  rng = np.random.default_rng(0)
  teacher = rng.standard_normal((config.d, config.classes))
  x = rng.standard_normal((config.steps, config.batch, config.d)) * np.logspace(0, -2, config.d)
  data = (jnp.asarray(x, jnp.float32), jnp.asarray(np.argmax(x @ teacher, -1), jnp.int32))
  # the same inputs moved by float32 round-off: one device's run on them says how far rounding alone moves it
  perturbed = (jnp.asarray(x * (1 + 2.0**-24 * rng.standard_normal(x.shape)), jnp.float32), data[1])
  one = jax.sharding.Mesh(np.asarray(jax.local_devices()[:1]).reshape(1), ("fsdp",),
                          axis_types=(jax.sharding.AxisType.Auto,))
  out = {"devices": jax.device_count(), "processes": jax.process_count(), "layouts": {}}
  for layout, (mesh, kernel_spec, batch_spec) in _meshes().items():
    rows = {}
    for name in config.optimizers:
      sharded = _run(config, name, mesh, kernel_spec, batch_spec, data)
      alone = _run(config, name, one, P(None, None), P(), data)
      rounded = _run(config, name, one, P(None, None), P(), perturbed)
      diff, rounding = (_max_difference(run["params"], alone["params"]) for run in (sharded, rounded))
      rows[name] = {**{k: v for k, v in sharded.items() if k != "params"}, "max_param_difference_vs_one_device": diff,
                    "max_param_difference_from_rounding": rounding, "difference_vs_rounding": diff / rounding,
                    "state_bytes_one_device": alone["state_bytes"]}
    base = rows[BASELINE]
    for row in rows.values():
      row["state_vs_adamw"] = row["state_bytes"] / base["state_bytes"]
      if row["temp_bytes"] is not None and rows.get("muon", {}).get("temp_bytes"):
        row["temp_vs_muon"] = row["temp_bytes"] / rows["muon"]["temp_bytes"]
    out["layouts"][layout] = rows
  return out


if __name__ == "__main__":
  scaffold.run(study)
