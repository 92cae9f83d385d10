"""What the theory predicts, measured: Lemma 3 and Lemma 4 ratios, and Algorithm 1's cost against eigh."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

import scsgd_jax as sk

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
      f = sk.sketch.sketched_factor_from_data(key, xt, k, oversample=oversample, power_iterations=0)
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
  sketch = jax.jit(lambda k, xt: sk.sketch.sketched_factor_from_data(k, xt, rank, oversample=oversample,
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
