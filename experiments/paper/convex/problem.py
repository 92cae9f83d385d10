"""The problem: features and labels of a dataset, the log loss, its optimum, the conditioners, SGD runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scsgd_jax as sk
from experiments.run import data as data_lib

RHO = float(np.sqrt(2.0))  # the multiclass log loss is sqrt(2)-Lipschitz in the scores: ||softmax - e_y|| <= sqrt(2)


# ----------------------------------------------------------------------------- problem


def load_features(config) -> tuple[np.ndarray, np.ndarray]:
  split = data_lib.load_split(config.dataset, "train", config.data_dir or None, config.max_train_examples,
                              config.download)
  x = split.inputs.reshape(len(split.labels), -1)
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


def make_conditioners(c, x, ranks, key, oversample) -> dict[str, sk.sketch.Factor]:
  n = c.shape[0]
  factors = {"sgd": sk.sketch.identity_factor(n, 1), "full": sk.sketch.full_factor(jnp.asarray(c))}
  xt = jnp.asarray(x).T  # (n, m): Algorithm 1's X
  for k in ranks:
    factors[f"lowrank_{k}"] = sk.sketch.low_rank_factor(jnp.asarray(c), k)
    factors[f"sketch_{k}"] = sk.sketch.sketched_factor_from_data(jax.random.fold_in(key, k), xt, k, oversample=oversample,
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


def first_below(steps, subopt, eps):
  hit = np.nonzero(np.asarray(subopt) <= eps)[0]
  return int(steps[hit[0]]) if hit.size else None
