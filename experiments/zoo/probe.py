"""Probes of a zoo cell: the library's ``scsgd`` (or, ``--row scsgd_eigen_muon``, that row) with one default or part
changed at a time, at one rate, on the zoo's seeds, each run as the zoo runs it (:class:`experiments.zoo.train.Cell`).

  python -m experiments.zoo.probe --workload lm1b_transformer --rate 0.8 --data_dir ../shared/tfds \\
      --out experiments/results/zoo/probes_lm1b_transformer.json

``--trace ROW:RATE:SEED`` (repeatable) instead follows one run's first ``--steps`` steps kernel by kernel: the loss and
the three kernels of largest relative step ``|U| / |W|`` (:func:`scsgd_jax.update_diagnostics`): the layer a too-high
rate blows up first runs far above the others.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import jax
import optax

import scsgd_jax as sk
from experiments.zoo import bounds, report, rows as rows_lib, train

NOT_EMBEDDINGS = lambda path, leaf: sk.default_kernel_filter(path, leaf) and not path.endswith("embedding")
VARIANTS = {
    "defaults": {},
    "unbounded": {"max_relative_step": None},  # the paper's step: no step bound (the defaults before it)
    "dense_everywhere": {"statistics": sk.Statistics(kind="dense")},  # every kernel the full C^(1/2): no sketch
    "floor_0.1": {"conditioner": sk.Conditioner(eigenvalue_floor=0.1)},  # at most ~3x amplification, not 10x
    "embeddings_plain": {"kernel_filter": NOT_EMBEDDINGS},
    "normalize_all": {"conditioner": sk.Conditioner(normalize="all")},
    "no_warm_start": {"refresh": sk.Refresh(warm_start=False)},
    "refresh_every_10": {"refresh": sk.Refresh(every=10)},
}


# step bounds around the paper's step (experiments.zoo.bounds): built at the probe's rate, as they read the step
_RECIPE = lambda s, axes: sk.scsgd(s, sk.Conditioning(input_axes=axes), max_relative_step=None)
BOUNDS = {  # name_<value>: the bound at that value (w: the workload)
    # the library's bound with its first floor, RMS 0.01 for every leaf
    "relative_step": lambda s, axes, v, w: optax.chain(_RECIPE(s, axes), sk.clip_by_relative_norm(v, floor_rms=1e-2)),
    # the library's bound as scsgd's max_relative_step: the floor at each leaf's init scale
    "fan_in_floor": lambda s, axes, v, w: sk.scsgd(s, sk.Conditioning(input_axes=axes), max_relative_step=v),
    "predicted_decrease": lambda s, axes, v, w: bounds.predicted_decrease(_RECIPE(s, axes), nats=v),
    "amplification": lambda s, axes, v, w: bounds.amplification(_RECIPE(s, axes), s, kappa=v),
    "outlier_step": lambda s, axes, v, w: bounds.outlier_step(_RECIPE(s, axes), kappa=v),
    "head_step": lambda s, axes, v, w: bounds.head_step(_RECIPE(s, axes), w.head, v),
}


# ``scsgd_eigen_muon`` with one part changed at a time (``--row scsgd_eigen_muon``): (Conditioning fields, keywords)
_EXACT = {"statistics": sk.Statistics(kind="dense"), "conditioner": sk.Conditioner(kind="full")}
EIGEN_MUON_VARIANTS = {
    "defaults": ({}, {}),
    "exact_basis": (_EXACT, {}),  # C's own eigenbasis, every direction: no sketch
    "refresh_every_10": ({"refresh": sk.Refresh(every=10)}, {}),  # a basis 5x fresher
    "b2_0.95": ({}, {"b2": 0.95}),  # the second moment over ~20 steps, not ~1,000 (SOAP's LM setting)
    "soap_basis": (_EXACT, {"basis": "gradients", "sides": "both"}),  # SOAP's two-sided gradient basis
}

SEEDS = (0, 1, 2)  # each probe's


def _variant(variant: str) -> rows_lib.Row:
  """The probe's row: ``scsgd`` with one default changed, or a bound around the recipe (built at each rate, as it
  reads the step)."""
  name, _, value = variant.rpartition("_")
  if name in BOUNDS:
    return rows_lib.Row(lambda s, w, axes: BOUNDS[name](s, axes, float(value), w), 0.1, variant, linear=False)
  options = VARIANTS[variant]
  bound = {k: options[k] for k in ("max_relative_step",) if k in options}
  conditioning = {k: v for k, v in options.items() if k not in bound}
  return rows_lib.Row(lambda s, w, axes: sk.scsgd(s, sk.Conditioning(input_axes=axes, **conditioning), **bound), 0.1,
                      variant, linear=False)


def _eigen_muon_variant(variant: str) -> rows_lib.Row:
  conditioning, changed = EIGEN_MUON_VARIANTS[variant]
  return rows_lib.Row(lambda s, w, axes: rows_lib.eigen_muon(s, w, axes, conditioning, **changed), 0.02, variant)


def _definition(row: str, variant: str) -> rows_lib.Row:
  """``row``'s probe row for ``variant`` (a ``KeyError`` for a variant it has not)."""
  return _eigen_muon_variant(variant) if row == "scsgd_eigen_muon" else _variant(variant)


def probe(workload: str, rate: float, variant: str, data_dir: str, row: str = "scsgd",
          seeds: tuple[int, ...] = SEEDS) -> list[dict]:
  cell = train.Cell(workload, row, data_dir, definition=_definition(row, variant))
  out = []
  for seed in seeds:
    r = cell.run(rate, seed)
    out.append({"seed": seed, "diverged": r["diverged"], "final_loss": r["final_loss"],
                "steps_trained": len(r["train_losses"])})
    print(variant, out[-1], flush=True)
  return out


def trace(workload: str, row: str, rate: float, seed: int, steps: int, data_dir: str) -> list[dict]:
  """The first ``steps`` steps of one zoo run: the loss and the kernels of largest relative step."""
  from experiments.zoo import workloads as wl
  cell = train.Cell(workload, row, data_dir)
  tx = rows_lib.build_row(cell.definition._replace(linear=False), cell.w, cell.axes, rate)  # built at the rate

  @jax.jit
  def step(params, extra, state, x, y, key):
    (loss, (inputs, extra)), grads = jax.value_and_grad(cell.bound.loss, has_aux=True)(params, extra, x, y, key,
                                                                                        cell.capture)
    updates, state = tx.update(grads, state, params, **({"layer_inputs": inputs} if cell.capture else {}))
    return optax.apply_updates(params, updates), extra, state, loss, sk.update_diagnostics(grads, updates, params)

  params, extra = cell.bound.start(seed)
  state, out = tx.init(params), []
  for i in range(steps):
    x, y = wl.batch(cell.data.train, cell.w.batch, i, seed)
    params, extra, state, loss, diagnostics = step(params, extra, state, x, y, jax.random.PRNGKey(i))
    top = sorted(((float(d["relative_step"]), k) for k, d in diagnostics.items()), reverse=True)[:3]
    out.append({"step": i, "loss": float(loss), "largest_relative_steps": [[k, r] for r, k in top]})
  return out


def _known(row: str, variant: str) -> bool:
  try:
    _definition(row, variant)
  except KeyError:
    return False
  return True


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", required=True)
  parser.add_argument("--rate", type=float, required=True)
  parser.add_argument("--row", default="scsgd", choices=("scsgd", "scsgd_eigen_muon"), help="the row probed")
  parser.add_argument("--variants", default=None,
                      help="comma-separated; default: every variant of --row (scsgd's may also name BOUNDS_<value>)")
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--data_dir", default="../shared/tfds")
  parser.add_argument("--out", required=True)
  parser.add_argument("--trace", action="append", default=[], help="ROW:RATE:SEED, a run followed kernel by kernel")
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  if args.trace:
    results = {t: trace(args.workload, t.split(":")[0], float(t.split(":")[1]), int(t.split(":")[2]), args.steps,
                        args.data_dir) for t in args.trace}
  else:
    every = EIGEN_MUON_VARIANTS if args.row == "scsgd_eigen_muon" else VARIANTS
    variants = args.variants.split(",") if args.variants else list(every)
    unknown = [v for v in variants if not _known(args.row, v)]
    if unknown:
      also = f", or <bound>_<value> for a bound of {sorted(BOUNDS)}" if args.row == "scsgd" else ""
      parser.error(f"--variants: {unknown} are no variants of --row {args.row}; its variants: {sorted(every)}{also}")
    seeds = tuple(int(s) for s in args.seeds.split(","))
    results = {v: probe(args.workload, args.rate, v, args.data_dir, args.row, seeds) for v in variants}
  given = sys.argv[1:] if argv is None else list(argv)
  record = {"command": "python -m experiments.zoo.probe " + shlex.join(given), "workload": args.workload,
            "rate": args.rate, ("traces" if args.trace else "variants"): results, **report.provenance()}
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
  main()
