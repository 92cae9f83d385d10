"""Memory of the optimizer state by layer width, from shapes (nothing runs): SCSGD's statistics against Adam.

  python -m experiments.studies.benchmark_scaling --config configs/studies/benchmark_scaling.py [--results_dir experiments/results]

One Dense layer ``(n, 1024)`` for each ``n`` of ``config.dims``; each variant built through the experiments'
optimizer factory: Nesterov SGD, Adam, and SCSGD with the paper's dense ``n x n`` statistics, the streaming
(Nystrom, ``O(n r)``) ones and the default (chosen by memory). Reported: the state's bytes, the ratio to
Adam's, the statistics' bytes and the factor's rank. Then, for each benchmark task of ``config.tasks`` (a
config module), the state of each of ``config.task_rows`` on that task's model as the head to head builds
it (its recipe), against AdamW's: the memory rule on the models the tables train, at today's library. Step
times are measured by ``benchmark_step``.
"""

from __future__ import annotations

import importlib

import jax
import ml_collections

from experiments.head_to_head import benchmark
from experiments.studies import scaffold
from experiments.optim import optimizers

OUTPUTS = 1024


def _bytes(tree) -> int:
  return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def dense_layer(config: ml_collections.ConfigDict, n: int) -> dict:
  params = {"dense": {"kernel": jax.ShapeDtypeStruct((n, OUTPUTS), jax.numpy.float32)}}
  states = {name: jax.eval_shape(optimizers.create(optimizers.variant(config.run, v)).tx.init, params)
            for name, v in config.variants.items()}
  adam = _bytes(states["adam"])
  out = {}
  for name, state in states.items():
    out[name] = {"state_bytes": _bytes(state), "state_vs_adam": _bytes(state) / adam}
    if name.startswith("scsgd"):
      out[name]["statistics_bytes"] = _bytes(state[0].statistics)
      out[name]["kernels"] = state[0].summary()
  return out


def task_states(module: str, rows) -> dict:
  """Each row's state bytes on the model of task config ``module``, built as the head to head builds it, and
  its ratio to AdamW's."""
  task = importlib.import_module(module).get_config()
  out = {}
  for name in ("adamw", *rows):
    arg = benchmark.registry.entry(name).adam_rate
    cfg = benchmark.run_config(task, name, benchmark.Point(task.schedule.base), 0, {arg: 1e-3} if arg else {})
    out[name] = {"state_bytes": benchmark.state_bytes(cfg)}
  for v in out.values():
    v["state_vs_adamw"] = v["state_bytes"] / out["adamw"]["state_bytes"]
  return out


def study(config: ml_collections.ConfigDict, results_dir: str):
  results = {"setup": {"outputs": OUTPUTS, "variants": config.variants.to_dict()}, "dense_layer": {}}
  for n in config.dims:
    results["dense_layer"][str(n)] = dense_layer(config, n)
    print(n, {k: round(v["state_vs_adam"], 3) for k, v in results["dense_layer"][str(n)].items()}, flush=True)
  results["tasks"] = {}
  for module in config.tasks:
    results["tasks"][module] = task_states(module, config.task_rows)
    print(module, {k: round(v["state_vs_adamw"], 4) for k, v in results["tasks"][module].items()}, flush=True)
  return results, "benchmark_scaling.json"


if __name__ == "__main__":
  scaffold.run(study)
