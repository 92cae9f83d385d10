"""The convex case: multiclass logistic regression with SGD and every conditioner of the paper.

  python -m experiments.convex --config configs/convex_mnist.py --out experiments/results/convex \
      --data_dir ../shared/tfds

Runs the update of Equation (updateGeneric), ``W <- W - eta (A^{-1} x) delta^T`` (here in the
``(n, p)`` layout), with a constant step and the averaged iterate ``W_bar`` of Lemma 1, for
``A = I`` (SGD), ``A = C^{1/2}`` (Theorem 1), the exact rank-k conditioner (Section 2.2,
Theorem 2) and Algorithm 1's sketch from ``X`` (Theorem 3). ``C = X^T X / m`` is exact over the
training set, so every ``A`` is fixed and ``A^{-1} x`` is precomputed once per conditioner.
Writes ``results.json``, PNG plots and ``README.md`` (tables and the command) into ``--out``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import scsgd_jax as sk
from experiments import data as data_lib
from experiments import machine
from experiments import report

RHO = float(np.sqrt(2.0))  # the multiclass log loss is sqrt(2)-Lipschitz in the scores: ||softmax - e_y|| <= sqrt(2)


# ----------------------------------------------------------------------------- problem


def load_features(config) -> tuple[np.ndarray, np.ndarray]:
  split = data_lib.load_split(config.dataset, "train", config.data_dir or None, config.max_train_examples,
                              config.download)
  x = split.images.reshape(len(split.labels), -1)
  if config.bias_coordinate:
    x = np.concatenate([x, np.ones((x.shape[0], 1), np.float32)], axis=1)
  return x.astype(np.float32), split.labels


def loss_fn(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean multiclass log loss of the scores ``x @ w`` (``w`` is ``(n, p)``)."""
  return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()


def solve_optimum(x, y, num_classes: int, steps: int):
  """``W*`` and ``L(W*)`` by full-batch L-BFGS (optax.lbfgs with its zoom line search)."""
  x, y = jnp.asarray(x), jnp.asarray(y)
  fun = lambda w: loss_fn(w, x, y)  # noqa: E731
  opt = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(fun)

  @jax.jit
  def run(w):
    def body(carry, _):
      w, state = carry
      value, grad = value_and_grad(w, state=state)
      updates, state = opt.update(grad, state, w, value=value, grad=grad, value_fn=fun)
      return (optax.apply_updates(w, updates), state), None

    (w, _), _ = jax.lax.scan(body, (w, opt.init(w)), None, length=steps)
    return w, fun(w), jnp.linalg.norm(jax.grad(fun)(w))

  w, value, grad_norm = run(jnp.zeros((x.shape[1], num_classes), jnp.float32))
  return np.asarray(w), float(value), float(grad_norm)


def make_conditioners(c, x, ranks, key, oversample) -> dict[str, sk.Factor]:
  n = c.shape[0]
  factors = {"sgd": sk.identity_factor(n, 1), "full": sk.full_factor(jnp.asarray(c))}
  xt = jnp.asarray(x).T  # (n, m): Algorithm 1's X
  for k in ranks:
    factors[f"lowrank_{k}"] = sk.low_rank_factor(jnp.asarray(c), k)
    factors[f"sketch_{k}"] = sk.sketched_factor_from_data(jax.random.fold_in(key, k), xt, k, oversample=oversample,
                                                          power_iterations=0)
  return factors


def eval_steps(total: int, num: int) -> np.ndarray:
  return np.unique(np.geomspace(1, total, num).round().astype(int))


def run_sgd(x, xc, y, num_classes, step_sizes, batch, steps, evals, seed):
  """Constant-step conditioned SGD for every step size at once; ``W_bar`` at each step of ``evals``.

  ``xc = X A^{-1}`` holds the conditioned inputs. Examples are drawn i.i.d. (same draws for every
  conditioner under one seed). Returns ``(len(evals), len(step_sizes), n, p)`` averaged iterates.
  """
  n = x.shape[1]
  idx = np.random.default_rng(seed).integers(0, x.shape[0], (steps, batch))
  lrs = jnp.asarray(step_sizes, jnp.float32)
  is_eval = np.zeros(steps + 1, bool)
  is_eval[evals] = True
  slot = np.cumsum(is_eval) - 1
  x, xc, y = jnp.asarray(x), jnp.asarray(xc), jnp.asarray(y)
  num_evals = int(is_eval.sum())

  @jax.jit
  def run(idx, is_eval, slot):
    def body(carry, inp):
      w, wsum, buf, t = carry
      ib, ev, sl = inp
      wsum = wsum + w  # W_bar_t = (W_1 + ... + W_t) / t
      t = t + 1
      buf = jax.lax.cond(ev, lambda b: b.at[sl].set(wsum / t), lambda b: b, buf)
      xb, xcb = x[ib], xc[ib]
      scores = jnp.einsum("bn,lnp->lbp", xb, w)
      delta = jax.nn.softmax(scores, -1) - jax.nn.one_hot(y[ib], num_classes)[None, :, :]
      grad = jnp.einsum("bn,lbp->lnp", xcb, delta) / batch  # (A^{-1} x) delta^T, (n, p) layout
      return (w - lrs[:, None, None] * grad, wsum, buf, t), None

    zeros = jnp.zeros((len(step_sizes), n, num_classes), jnp.float32)
    buf = jnp.zeros((num_evals, *zeros.shape), jnp.float32)
    (_, _, buf, _), _ = jax.lax.scan(body, (zeros, zeros, buf, 0), (idx, is_eval[1:], slot[1:]))
    return buf

  return run(jnp.asarray(idx), jnp.asarray(is_eval), jnp.asarray(slot))


def losses(x, y, ws) -> np.ndarray:
  f = jax.jit(jax.vmap(lambda w: loss_fn(w, jnp.asarray(x), jnp.asarray(y))))
  out = np.asarray(f(jnp.asarray(ws)))
  return np.where(np.isfinite(out), out, np.inf)


# ----------------------------------------------------------------------------- theory


def lemma_ratios(x, eigvals, ranks, seeds, oversample) -> dict[str, Any]:
  """Lemma 3: ||QQ^T X - X||_F / ||X - X_k||_F (bound 2 in expectation); Lemma 4: (tr C - tr C~)/(tr C - tr C_k) (bound 4)."""
  m = x.shape[0]
  xt = jnp.asarray(x).T
  tr_c = float(np.sum(eigvals))

  out = {}
  for k in ranks:
    tail = float(np.sum(eigvals[k:]))
    best = np.sqrt(m * tail)

    @jax.jit
    def measure(key, k=k):
      f = sk.sketched_factor_from_data(key, xt, k, oversample=oversample, power_iterations=0)
      qx = f.q.T @ xt
      resid = jnp.linalg.norm(f.q @ qx - xt)
      tr_tilde = jnp.sum(qx * qx) / m
      return resid, tr_tilde

    l3, l4 = [], []
    for seed in range(seeds):
      resid, tr_tilde = measure(jax.random.PRNGKey(1000 + seed))
      l3.append(float(resid) / best)
      l4.append((tr_c - float(tr_tilde)) / tail)
    out[str(k)] = {"lemma3_mean": float(np.mean(l3)), "lemma3_max": float(np.max(l3)),
                   "lemma4_mean": float(np.mean(l4)), "lemma4_max": float(np.max(l4)), "seeds": seeds}
  return out


def _time(fn, *args, repeats=3) -> float:
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def timing(pixels, dims, examples, rank, oversample, seed) -> list[dict[str, Any]]:
  """Algorithm 1 (``O(m n k)``) against an exact eigh of ``C`` (``O(n^3)``, plus ``O(m n^2)`` to form ``C``)."""
  rng = np.random.default_rng(seed)
  base = jnp.asarray(pixels[:examples])
  sketch = jax.jit(lambda k, xt: sk.sketched_factor_from_data(k, xt, rank, oversample=oversample,
                                                             power_iterations=0))
  form = jax.jit(lambda xt: xt @ xt.T / xt.shape[1])
  eigh = jax.jit(jnp.linalg.eigh)
  rows = []
  for n in dims:
    proj = jnp.asarray(rng.standard_normal((base.shape[1], n)) / np.sqrt(base.shape[1]), jnp.float32)
    xt = jax.nn.relu(base @ proj).T  # (n, m) random ReLU features
    c = form(xt)
    t_sketch = _time(sketch, jax.random.PRNGKey(0), xt)
    t_form = _time(form, xt)
    t_eigh = _time(eigh, c)
    rows.append({"n": n, "m": int(base.shape[0]), "k": rank, "sketch_s": t_sketch, "form_c_s": t_form,
                 "eigh_s": t_eigh, "eigh_over_sketch": t_eigh / t_sketch,
                 "form_plus_eigh_over_sketch": (t_form + t_eigh) / t_sketch})
    logging.info("timing n=%d: %s", n, rows[-1])
  return rows


# ----------------------------------------------------------------------------- experiment


def first_below(steps, subopt, eps):
  hit = np.nonzero(np.asarray(subopt) <= eps)[0]
  return int(steps[hit[0]]) if hit.size else None


def run_experiment(config: ml_collections.ConfigDict) -> dict[str, Any]:
  t_start = time.perf_counter()
  x, y = load_features(config)
  m, n = x.shape
  num_classes = int(y.max()) + 1
  c = (x.T.astype(np.float64) @ x.astype(np.float64)) / m
  eigvals = np.clip(np.linalg.eigvalsh(c)[::-1], 0, None)
  tr_c, tr_root = float(eigvals.sum()), float(np.sqrt(eigvals).sum())

  w_star, l_star, grad_norm = solve_optimum(x, y, num_classes, config.lbfgs_steps)
  sigma = float(np.linalg.norm(w_star, 2))
  wwt = w_star @ w_star.T  # the paper's W*^T W* (n x n)
  intro_ratio = float(np.trace(wwt) * tr_c / (np.linalg.norm(wwt, 2) * tr_root ** 2))

  key = jax.random.PRNGKey(config.seed)
  cj = jnp.asarray(c, jnp.float32)
  factors = make_conditioners(c.astype(np.float32), x, config.ranks, key, config.oversample)

  spectrum = [{"k": k, "trace_sqrt_c_k": float(np.sqrt(eigvals[:k]).sum()),
               "decay_term": float(np.sqrt((n - k) * eigvals[k:].sum())),
               "decay_over_trace_sqrt_c": float(np.sqrt((n - k) * eigvals[k:].sum())) / tr_root}
              for k in config.ranks]

  methods: dict[str, Any] = {}
  for name, f in factors.items():
    bt = sk.bound_terms(f, cj)
    methods[name] = {"trace_a": float(bt.trace_a), "trace_a_inv_c": float(bt.trace_a_inv_c),
                     "bound_sum": float(bt.trace_a + bt.trace_a_inv_c),
                     "trace_product": float(bt.trace_a * bt.trace_a_inv_c), "runs": {}}
  for batch, steps in config.settings:
    evals = eval_steps(steps, config.num_evals)
    for name, f in factors.items():
      xc = np.asarray(sk.apply_inverse(f, jnp.asarray(x).T).T)
      ws = run_sgd(x, xc, y, num_classes, config.step_sizes, batch, steps, evals, config.seed)
      final = losses(x, y, ws[-1])
      best = int(np.argmin(final))  # the same rule for all: lowest L(W_bar_T); ties -> smaller step
      curve = losses(x, y, ws[:, best]) - l_star
      run = {"batch": batch, "steps": steps, "best_step_size": float(config.step_sizes[best]),
             "final_by_step_size": {str(s): float(v - l_star) for s, v in zip(config.step_sizes, final)},
             "eval_steps": evals.tolist(), "suboptimality": curve.tolist(),
             "iterations_to_eps": {str(e): first_below(evals, curve, e) for e in config.epsilons},
             "bound": sigma * RHO / np.sqrt(steps) * methods[name]["bound_sum"]}
      methods[name]["runs"][str(batch)] = run
      logging.info("%s batch %d: best eta %s, final subopt %.4f", name, batch, run["best_step_size"], curve[-1])

  measured = {}  # per setting (batch size): iterations SGD / iterations A = C^{1/2}, per epsilon
  for batch, _ in config.settings:
    measured[str(batch)] = {}
    for e in config.epsilons:
      a = methods["sgd"]["runs"][str(batch)]["iterations_to_eps"][str(e)]
      b = methods["full"]["runs"][str(batch)]["iterations_to_eps"][str(e)]
      measured[str(batch)][str(e)] = (a / b) if (a and b) else None

  result = {
      "config": config.to_dict(),
      "n": n, "m": m, "p": num_classes,
      "trace_c": tr_c, "trace_sqrt_c": tr_root, "eigenvalues": eigvals.tolist(),
      "l_star": l_star, "lbfgs_grad_norm": grad_norm, "sigma_w_star_spectral": sigma, "rho": RHO,
      "intro_ratio_predicted": intro_ratio, "iteration_ratio_measured_sgd_over_full": measured,
      "spectral_decay": spectrum, "methods": methods,
      "lemmas": lemma_ratios(x, eigvals, config.ranks, config.lemma_seeds, config.oversample),
      "timing": timing(x[:, :784] if config.bias_coordinate else x, config.timing_dims, config.timing_examples,
                       config.timing_rank, config.oversample, config.seed),
      "machine": machine.describe(),
  }
  result["wall_seconds"] = time.perf_counter() - t_start
  return result


# ----------------------------------------------------------------------------- report


def _fmt(v, digits=4):
  if v is None:
    return "not reached"
  if isinstance(v, float):
    return f"{v:.{digits}g}"
  return str(v)


def write_report(result: dict[str, Any], out_dir: str, command: str) -> str:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(result, f, indent=1)

  fig, ax = plt.subplots(figsize=(6, 4))
  ev = np.asarray(result["eigenvalues"])
  ax.semilogy(np.arange(1, len(ev) + 1), np.maximum(ev, 1e-12))
  for k in result["config"]["ranks"]:
    ax.axvline(k, color="gray", alpha=0.3)
  ax.set_xlabel("index i")
  ax.set_ylabel("eigenvalue of C")
  ax.set_title(f"Spectrum of C (MNIST pixels, n = {result['n']})")
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "spectrum.png"), dpi=110)
  plt.close(fig)

  methods = result["methods"]
  for batch, _ in result["config"]["settings"]:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, mth in methods.items():
      run = mth["runs"][str(batch)]
      style = "-" if name in ("sgd", "full") else ("--" if name.startswith("lowrank") else ":")
      ax.loglog(run["eval_steps"], np.maximum(run["suboptimality"], 1e-6), style,
                label=f"{name} (eta={run['best_step_size']:g})", lw=2 if name in ("sgd", "full") else 1)
    ax.set_xlabel("iteration t")
    ax.set_ylabel("L(W_bar_t) - L(W*)")
    ax.set_title(f"Logistic regression on MNIST, batch {batch}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"suboptimality_batch{batch}.png"), dpi=110)
    plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  tm = result["timing"]
  ns = [r["n"] for r in tm]
  ax.loglog(ns, [r["sketch_s"] for r in tm], "o-", label=f"Algorithm 1 (k={tm[0]['k']})")
  ax.loglog(ns, [r["eigh_s"] for r in tm], "s-", label="eigh(C)")
  ax.loglog(ns, [r["eigh_s"] + r["form_c_s"] for r in tm], "^-", label="form C + eigh(C)")
  ax.set_xlabel("n")
  ax.set_ylabel("seconds")
  ax.legend()
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "timing.png"), dpi=110)
  plt.close(fig)

  single = str(result["config"]["settings"][0][0])
  eps = result["config"]["epsilons"]
  lines = [
      "# The convex case: multiclass logistic regression on MNIST\n",
      "Produced by:\n", "```", command, "```\n",
      f"Machine: {result['machine']['cpu']} ({result['machine']['cores']} cores), JAX {result['machine']['jax']}; "
      f"whole run {result['wall_seconds']:.0f} s.\n",
      f"m = {result['m']} examples, n = {result['n']} (pixels in [0, 1]"
      f"{' + a constant-1 bias coordinate' if result['config']['bias_coordinate'] else ''}), p = {result['p']}. "
      f"L(W*) = {result['l_star']:.6f} (L-BFGS, {result['config']['lbfgs_steps']} steps, "
      f"final gradient norm {result['lbfgs_grad_norm']:.1e}); sigma = ||W*||_sp = {result['sigma_w_star_spectral']:.3f}, "
      f"rho = sqrt(2).\n",
      "Plots: [spectrum.png](spectrum.png), "
      + ", ".join(f"[suboptimality_batch{b}.png](suboptimality_batch{b}.png)" for b, _ in result["config"]["settings"])
      + ", [timing.png](timing.png).\n",
      "## Spectrum and the fast spectral decay property\n",
      f"tr(C) = {result['trace_c']:.4g}, tr(C^(1/2)) = {result['trace_sqrt_c']:.4g}.\n",
      "| k | tr(C_k^(1/2)) | sqrt((n-k)(tr C - tr C_k)) | ratio to tr(C^(1/2)) |",
      "| --- | --- | --- | --- |",
  ]
  for s in result["spectral_decay"]:
    lines.append(f"| {s['k']} | {s['trace_sqrt_c_k']:.4g} | {s['decay_term']:.4g} | {s['decay_over_trace_sqrt_c']:.3f} |")
  steps_single = result["config"]["settings"][0][1]
  lines += [
      "\n## Conditioners: Lemma 1's bound terms and what SGD measured\n",
      f"Bound = sigma rho / sqrt(T) (tr A + tr A^-1 C) at T = {steps_single} (single-example steps). "
      "Theorem 1: tr(A) tr(A^-1 C) >= tr(C^(1/2))^2 = "
      f"{result['trace_sqrt_c'] ** 2:.4g}, with equality for A = C^(1/2). Best step size per method from the grid "
      f"{list(result['config']['step_sizes'])} by the lowest L(W_bar_T).\n",
  ]
  head = ["conditioner", "tr A", "tr A^-1 C", "tr A + tr A^-1 C", "tr A * tr A^-1 C", "bound"]
  for b, _ in result["config"]["settings"]:
    head += [f"eta (b={b})", f"L(W_bar_T) - L* (b={b})"] + [f"t to {e} (b={b})" for e in eps]
  lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for name, mth in methods.items():
    cells = [name, _fmt(mth["trace_a"]), _fmt(mth["trace_a_inv_c"]), _fmt(mth["bound_sum"]),
             _fmt(mth["trace_product"]), _fmt(mth["runs"][single]["bound"])]
    for b, _ in result["config"]["settings"]:
      run = mth["runs"][str(b)]
      cells += [_fmt(run["best_step_size"]), _fmt(run["suboptimality"][-1])]
      cells += [_fmt(run["iterations_to_eps"][str(e)]) for e in eps]
    lines.append("| " + " | ".join(cells) + " |")
  lines += [
      "\nIterations to epsilon are read off the evaluation grid (log-spaced steps), so they are upper bounds "
      "at that grid's resolution.\n",
      "## The introduction's iteration ratio\n",
      f"Predicted: tr(W*^T W*) tr(C) / (||W*^T W*||_sp tr(C^(1/2))^2) = **{result['intro_ratio_predicted']:.3g}**.\n",
      "Measured: iterations for SGD / iterations for A = C^(1/2) to first reach L(W_bar_t) - L* <= epsilon, "
      "each at its best step size.\n",
      "| epsilon | " + " | ".join(f"batch {b}" for b, _ in result["config"]["settings"]) + " |",
      "|" + " --- |" * (1 + len(result["config"]["settings"])),
  ]
  for e in eps:
    cells = []
    for b, _ in result["config"]["settings"]:
      v = result["iteration_ratio_measured_sgd_over_full"][str(b)][str(e)]
      cells.append(_fmt(v, 3) if v is not None else "not reached by both")
    lines.append(f"| {e} | " + " | ".join(cells) + " |")
  lines += [
      "\n## Lemma 3 and Lemma 4, measured\n",
      f"Algorithm 1 from X (r = k + {result['config']['oversample']}, no power iterations), "
      f"{result['config']['lemma_seeds']} seeds per k.\n",
      "| k | Lemma 3: mean ||QQ^T X - X||_F / ||X - X_k||_F (<= 2) | max | "
      "Lemma 4: mean (tr C - tr C~)/(tr C - tr C_k) (<= 4) | max |",
      "| --- | --- | --- | --- | --- |",
  ]
  for k, r in result["lemmas"].items():
    lines.append(f"| {k} | {r['lemma3_mean']:.4f} | {r['lemma3_max']:.4f} | {r['lemma4_mean']:.4f} | {r['lemma4_max']:.4f} |")
  lines += [
      "\n## Cost of Algorithm 1 against an exact eigendecomposition\n",
      "Random ReLU features of the pixels give inputs of dimension n; medians of 3 jitted runs, same process.\n",
      "| n | m | k | Algorithm 1 (s) | form C (s) | eigh C (s) | eigh / Alg. 1 | (form + eigh) / Alg. 1 |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in result["timing"]:
    lines.append(f"| {r['n']} | {r['m']} | {r['k']} | {r['sketch_s']:.4f} | {r['form_c_s']:.4f} | {r['eigh_s']:.4f} | "
                 f"{r['eigh_over_sketch']:.2f}x | {r['form_plus_eigh_over_sketch']:.2f}x |")
  return report.write_markdown(out_dir, lines)


FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags, defined only when run as a script (so modules can be imported together)."""
  flags.DEFINE_string("out", None, "Output directory for results.json, plots and README.md.", required=True)
  flags.DEFINE_string("data_dir", None, "TFDS data dir (default: $TFDS_DATA_DIR, else tfds' own).")
  config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/convex_*.py).", lock_config=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  config = FLAGS.config
  if FLAGS.data_dir:
    config.data_dir = FLAGS.data_dir
  command = "python -m experiments.convex " + " ".join(shlex.quote(a) for a in sys.argv[1:])
  try:
    result = run_experiment(config)
  except data_lib.DataError as e:  # a message, not a traceback
    sys.exit(f"error: {e}")
  print(open(write_report(result, FLAGS.out, command)).read())


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config"])
  app.run(main)
