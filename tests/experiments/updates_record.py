"""Every registry entry's updates on the tests' small models, a few steps at fixed seeds, as one SHA-256 per
update leaf: the record that a change meant to leave the arithmetic alone (a refactor of the face) must reproduce
bit for bit. ``python -m tests.experiments.updates_record`` writes :data:`RECORD`; ``test_updates_record``
compares (``--check NAME:KIND ...`` prints each pair's leaves that differ, as JSON).

Both run in a process of their own with XLA's default flags, as users' and the experiments' runs compile (the tests'
fast-compile flags round some programs otherwise: a record is reproduced bit for bit under the flags it was made
under).

Each entry runs at its authors' settings for a transformer (``registry.recipe(name, 'transformer')``: every zoo
model's output layer is named ``head``, as that recipe says), its rate the recipe's centre under a constant
schedule, and the model's ``input_axes`` where it captures. K-FAC, which runs the model itself, is left out: it
is a peer's code, built by no function of the library.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import platform
import sys

import jax
import ml_collections
import numpy as np
import optax

from experiments.optim import optimizers
from experiments.optim import registry
from tests.library import zoo

RECORD = pathlib.Path(__file__).with_name("updates.json")
MACHINES = RECORD.with_name("updates_machines.json")  # each entry's CPU (:func:`machine`) when it was recorded
STEPS = 3
MODELS = ("mlp", "cnn", "transformer", "scanned")
LEFT_OUT = ("kfac",)


def machine() -> str:
  """The CPU's vector instruction sets, which XLA compiles for (the same program rounds otherwise on a CPU with
  others: a record holds bit for bit on the CPUs it was made on)."""
  try:
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split()
  except (OSError, StopIteration):
    return platform.machine()
  return " ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4", "f16c"))))


def recorded_on(name: str) -> str:
  """The CPU entry ``name`` was recorded on (``""``: not said, recorded before the CPUs were)."""
  return json.loads(MACHINES.read_text()).get(name, "") if MACHINES.exists() else ""


def entries() -> list[str]:
  return [n for n in registry.REGISTRY if n not in LEFT_OUT]


def _config(name: str) -> ml_collections.ConfigDict:
  recipe = registry.recipe(name, "transformer")
  config = ml_collections.ConfigDict(dict(
      seed=0, num_steps=STEPS, schedule=dict(name="constant", base=recipe.learning_rate),
      optimizer=dict(name=name, weight_decay=0.0)))
  arg = registry.entry(name).adam_rate
  return optimizers.variant(config, {"name": name, **recipe.settings, **({arg: 1e-3} if arg else {})})


def digests(name: str, kind: str) -> list[str]:
  """One SHA-256 per update leaf per step, of ``name``'s updates on zoo model ``kind``."""
  config = _config(name)
  capture = registry.entry(name).capture

  def make_tx(model):
    axes = zoo.input_axes(model) if capture != "none" else None
    tx = optimizers.create(config, input_axes=axes).tx
    if capture != "none":
      return tx
    # a peer's update may take no extra arguments: the zoo's step passes it none (its rate is 1 here)
    return optax.GradientTransformationExtraArgs(tx.init, lambda u, s, p=None, **extra: tx.update(u, s, p))

  model, optimizer = zoo.build(kind, make_tx)
  out = []

  def record(step, updates, model):
    del model
    for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
      a = np.asarray(leaf)
      out.append(f"{step}:{jax.tree_util.keystr(path)}:{a.dtype}{a.shape}:{hashlib.sha256(a.tobytes()).hexdigest()}")

  with jax.numpy_rank_promotion("allow"):  # the peers broadcast implicitly
    zoo.fit(kind, model, optimizer, 1.0, STEPS, capture=capture != "none", two_sided=capture == "two_sided",
            on_update=record)
  return out


def recorded(name: str, kind: str) -> list[str]:
  """:func:`digests`, or the error a peer's code raises on that model (recorded as it is: the check is that it still
  does)."""
  try:
    return digests(name, kind)
  except Exception as e:  # noqa: BLE001 -- a peer's failure on one model is part of the record
    if name.startswith("scsgd"):  # the library's own rows never fail
      raise
    return [f"error: {type(e).__name__}"]


def write(names=None) -> dict[str, dict[str, list[str]]]:
  """The record of ``names`` (default: every entry) written into :data:`RECORD` entry by entry (a record there
  already keeps its other entries)."""
  record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
  for name in names or entries():
    record[name] = {}
    for kind in MODELS:
      record[name][kind] = recorded(name, kind)
      jax.clear_caches()  # as in check
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    machines = json.loads(MACHINES.read_text()) if MACHINES.exists() else {}
    MACHINES.write_text(json.dumps({**machines, name: machine()}, indent=1, sort_keys=True) + "\n")
    print(f"{name}: recorded", flush=True)
  return record


def check(pairs) -> dict[str, list[str]]:
  """``{"name:kind": [the leaves, by step and path, whose digest differs from the record]}``, each pair also printed
  as it is checked (a line of JSON)."""
  record = json.loads(RECORD.read_text())
  out = {}
  for pair in pairs:
    name, kind = pair.split(":")
    got, want = recorded(name, kind), record[name][kind]
    out[pair] = ([] if got == want else [w.rsplit(":", 1)[0] for g, w in zip(got, want) if g != w]
                 or ["the number of leaves"])
    print(json.dumps({pair: out[pair]}), flush=True)
    jax.clear_caches()  # a process compiling a hundred programs would pass Linux's limit on its memory mappings
  return out


if __name__ == "__main__":
  if sys.argv[1:2] == ["--check"]:
    print(json.dumps(check(sys.argv[2:])))
  else:
    written = write(sys.argv[1:] or None)
    print(f"wrote {RECORD}: {len(written)} entries x {len(MODELS)} models x {STEPS} steps")
