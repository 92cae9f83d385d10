"""Run by test_devices.py in its own process with 4 host CPU devices (XLA_FLAGS set before JAX starts).

Data parallelism three ways (pmap, shard_map, jit with NamedSharding) and an FSDP-style kernel sharded on
its input dimension, each against one device training on the concatenated batch. Prints one JSON line.
"""

import functools
import json
import os

if __name__ == "__main__":  # only as a script: pytest's doctest collection imports this module in its workers
  # test_devices.py passes its flags (tests/helpers.py: 4 devices, compiled for speed of compiling)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  os.environ["JAX_PLATFORMS"] = "cpu"  # host CPU devices, also on a machine with an accelerator

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import scsgd_jax as sk  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
STEPS, DEVICES, LOCAL = 8, 4, 8
KW = dict(rank=4,
          refresh=sk.Refresh(every=3))  # l1 (n = 12): dense C, full C^{1/2}; l2 (n = 24): sketched; 2 refreshes each


def init_params():
  rng = np.random.default_rng(0)
  return {"l1": {"kernel": jnp.asarray(rng.standard_normal((12, 24)) / 4, jnp.float32)},
          "l2": {"kernel": jnp.asarray(rng.standard_normal((24, 4)) / 5, jnp.float32)}}


def batches():
  rng = np.random.default_rng(1)
  scales = np.linspace(0.2, 3.0, 12)
  return [(jnp.asarray(rng.standard_normal((DEVICES * LOCAL, 12)) * scales, jnp.float32),
           jnp.asarray(rng.standard_normal((DEVICES * LOCAL, 4)), jnp.float32)) for _ in range(STEPS)]


def grads_and_inputs(params, x, y):
  def loss(p):
    h = jnp.tanh(x @ p["l1"]["kernel"])
    return jnp.mean((h @ p["l2"]["kernel"] - y) ** 2), {"l1": {"kernel": x}, "l2": {"kernel": h}}

  (_, rows), g = jax.value_and_grad(loss, has_aux=True)(params)
  return g, rows


def one_device():
  tx = sk.scsgd(0.05, sk.Conditioning(**KW))
  params = init_params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    g, rows = grads_and_inputs(params, x, y)
    u, state = tx.update(g, state, params, layer_inputs=rows)
    return optax.apply_updates(params, u), state

  for x, y in batches():
    params, state = step(params, state, x, y)
  return params, state


def data_parallel_pmap(axis_name):
  tx = sk.scsgd(0.05, sk.Conditioning(axis_name=axis_name, **KW))
  params = init_params()
  state = tx.init(params)
  params, state = jax.tree.map(lambda v: jnp.stack([v] * DEVICES), (params, state))  # one copy per device

  @functools.partial(jax.pmap, axis_name="data")
  def step(params, state, x, y):
    g, rows = grads_and_inputs(params, x, y)
    u, state = tx.update(jax.lax.pmean(g, "data"), state, params, layer_inputs=rows)
    return optax.apply_updates(params, u), state

  for x, y in batches():
    params, state = step(params, state, x.reshape(DEVICES, LOCAL, -1), y.reshape(DEVICES, LOCAL, -1))
  return params, state


def data_parallel_shard_map():
  tx = sk.scsgd(0.05, sk.Conditioning(axis_name="data", **KW))
  params = init_params()
  state = tx.init(params)
  mesh = Mesh(np.array(jax.devices()), ("data",))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()))
  def step(params, state, x, y):
    g, rows = grads_and_inputs(params, x, y)
    # shard_map's autodiff already sums the gradient of replicated parameters over 'data' (the transpose of
    # their implicit broadcast): the global mean is that sum over the device count
    g = jax.tree.map(lambda v: v / DEVICES, g)
    u, state = tx.update(g, state, params, layer_inputs=rows)
    return optax.apply_updates(params, u), state

  for x, y in batches():
    params, state = step(params, state, x, y)
  return params, state


def sharded_jit(fsdp: bool):
  """``jit`` on global arrays: the batch sharded over 'data'; with ``fsdp`` each kernel sharded on its input axis."""
  tx = sk.scsgd(0.05, sk.Conditioning(**KW))
  mesh = Mesh(np.array(jax.devices()), ("data",))
  params = init_params()
  if fsdp:
    params = jax.tree.map(lambda w: jax.device_put(w, NamedSharding(mesh, P("data", None))), params)
  state = tx.init(params)
  batch = NamedSharding(mesh, P("data", None))

  @jax.jit
  def step(params, state, x, y):
    g, rows = grads_and_inputs(params, x, y)
    u, state = tx.update(g, state, params, layer_inputs=rows)
    return optax.apply_updates(params, u), state

  for x, y in batches():
    params, state = step(params, state, jax.device_put(x, batch), jax.device_put(y, batch))
  return params, state


def replicas_identical(tree) -> bool:
  return all(bool(np.all(np.asarray(leaf) == np.asarray(leaf)[:1])) for leaf in jax.tree.leaves(tree))


def max_rel_diff(a, b) -> float:
  out = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    out = max(out, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)))
  return out


def main():
  assert jax.device_count() == 4, jax.devices()
  ref_params, ref_state = one_device()
  stats = lambda s: s[0].statistics  # scsgd = chain(conditioning, sgd)
  out = {"devices": jax.device_count()}
  p, s = data_parallel_pmap("data")
  out["pmap_replicas_identical"] = replicas_identical((p, s))
  first = jax.tree.map(lambda v: v[0], (p, s))
  out["pmap_vs_one_device"] = max_rel_diff(first[0], ref_params)
  out["pmap_statistics_vs_one_device"] = max_rel_diff(stats(first[1]), stats(ref_state))
  p, s = data_parallel_pmap(None)
  out["pmap_without_axis_name_replicas_identical"] = replicas_identical((p, s))
  p, s = data_parallel_shard_map()
  out["shard_map_vs_one_device"] = max_rel_diff(p, ref_params)
  out["shard_map_statistics_vs_one_device"] = max_rel_diff(stats(s), stats(ref_state))
  for fsdp in (False, True):
    p, s = sharded_jit(fsdp)
    name = "fsdp_jit" if fsdp else "sharded_jit"
    out[f"{name}_vs_one_device"] = max_rel_diff(p, ref_params)
    out[f"{name}_statistics_vs_one_device"] = max_rel_diff(stats(s), stats(ref_state))
  out["steps"] = int(ref_state[0].count)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
