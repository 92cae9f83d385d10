"""Kernel-by-kernel diagnosis of plain SCSGD against Nesterov SGD on a transformer, on synthetic data only.

  python -m experiments.studies.diagnose --config configs/studies/diagnose.py --results_dir experiments/results/diagnose

The development task's order-2 Markov source (``experiments.studies.develop``), learned by the Flax examples' layout of
a transformer LM (``config.diagnose.model``: 3-D attention kernels, the step benchmark's TransformerLM). Each
variant of ``config.diagnose.variants`` (an optimizer and settings over its recipe) runs at each rate of ``config.diagnose.rates`` (the head to head's
schedule and recipes), and every ``record_every`` steps records, per conditioned kernel: the gradient's norm,
the parameter change's norm relative to the kernel's (``rel_step``; :func:`scsgd_jax.update_diagnostics`), and
for SCSGD its conditioner (:func:`scsgd_jax.kernel_diagnostics`: ``inverse_max``, ``spread``, ``tail_inverse``). A diverged run records
the step and the kernels whose relative step grew most before it. Written: ``diagnose.json`` and
``rel_step.png`` (relative step per kernel over training, one panel per optimizer at the rate named by
``config.diagnose.plot_rate``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

import scsgd_jax
from experiments.studies import scaffold
from experiments.studies import develop
from experiments.run import models
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.run import step as step_lib



def run(config: ml_collections.ConfigDict, label: str, rate: float, table: np.ndarray, heldout: np.ndarray) -> dict:
  """One run of variant ``label`` at peak ``rate`` (seed ``config.seed``): its records and final held-out loss."""
  d = config.diagnose
  variant = dict(d.variants[label])
  name = variant.pop("name")
  run_config = ml_collections.ConfigDict(config.to_dict())
  run_config.schedule.base = rate
  settings = {**registry.entry(name).recipe(config.benchmark.kind).settings, **variant}
  opt = optimizers.create(optimizers.variant(run_config, {"name": name, **settings}))
  model = models.CharTransformer(rngs=nnx.Rngs(config.seed), vocab=config.develop.vocab, context=config.develop.context,
                                 **d.model.to_dict())
  kernels = set(scsgd_jax.input_axes_nnx(model))
  graphdef, params, rest = step_lib.split(model)
  step = step_lib.make_train_step(graphdef, opt.tx, opt.capture, config.max_rows or None, donate=False)
  grad_fn = jax.jit(jax.grad(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      nnx.merge(graphdef, p, rest)(x), y).mean()))
  apply = jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x))
  opt_state = opt.tx.init(params)
  rng, key = np.random.default_rng(config.seed + 1), jax.random.PRNGKey(config.seed)
  records, diverged_at = [], None
  for i in range(config.num_steps):
    batch = develop.sample_windows(table, config.batch_size, config.develop.context + 1, rng)
    x, y = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
    new_params, rest, opt_state, loss, _ = step(params, rest, opt_state, x, y, jax.random.fold_in(key, i))
    if i % d.record_every == 0 or not np.isfinite(float(loss)):
      sizes = scsgd_jax.update_diagnostics(grad_fn(params, x, y), jax.tree.map(lambda a, b: a - b, new_params, params),
                                           params, kernel_filter=lambda path, leaf: path in kernels)
      row = {"step": i, "loss": float(loss), "kernels": {
          p: {"grad": float(d["grad_norm"]), "rel_step": float(d["relative_step"])} for p, d in sizes.items()}}
      if name.startswith("scsgd"):
        for p, diag in scsgd_jax.kernel_diagnostics(opt_state).items():
          row["kernels"].setdefault(p, {}).update(
              {k: float(np.max(v)) for k, v in diag.items() if k in ("inverse_max", "spread", "tail_inverse")})
      records.append(row)
    params = new_params
    if not np.isfinite(float(loss)):
      diverged_at = i
      break
  final = float("inf") if diverged_at is not None else develop._heldout_loss(apply, params, rest, heldout)
  return {"variant": label, "optimizer": name, "learning_rate": rate, "settings": settings, "diverged_at": diverged_at,
          "heldout_loss": final if np.isfinite(final) else float("inf"), "records": records}


def _plot(runs: list[dict], rate: float, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shown = [r for r in runs if r["learning_rate"] == rate]
  fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4.5), sharey=True, squeeze=False)
  for ax, r in zip(axes[0], shown):
    for p in r["records"][0]["kernels"]:
      ax.plot([row["step"] for row in r["records"]], [row["kernels"][p]["rel_step"] for row in r["records"]],
              label=p.replace("/kernel", "").replace("/embedding", ""))
    ax.set_yscale("log")
    ax.set_title(f"{r['variant']} at {rate:g}: held-out {r['heldout_loss']:.3f}")
    ax.set_xlabel("step")
  axes[0][0].set_ylabel("|step| / |kernel|")
  axes[0][-1].legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def study(config: ml_collections.ConfigDict, results_dir: str):
  d = config.develop
  table = develop.markov_source(d.vocab, d.concentration, d.source_seed)
  heldout = develop.sample_windows(table, d.heldout_windows, d.context + 1, np.random.default_rng(d.source_seed + 1))
  runs = []
  for label in config.diagnose.variants:
    for rate in config.diagnose.rates:
      r = run(config, label, rate, table, heldout)
      runs.append(r)
      print(f"{label} lr {rate:g}: held-out {r['heldout_loss']:.4f}"
            + (f", diverged at step {r['diverged_at']}" if r["diverged_at"] is not None else ""), flush=True)
  os.makedirs(results_dir, exist_ok=True)
  _plot(runs, config.diagnose.plot_rate, os.path.join(results_dir, "rel_step.png"))
  return {"config": config.to_dict(), "runs": runs}, "diagnose.json"


if __name__ == "__main__":
  scaffold.run(study, results_dir=os.path.join(scaffold.RESULTS, "diagnose"))
