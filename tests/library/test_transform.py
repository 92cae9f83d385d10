"""The optax transformation against hand-derived updates, the optax wrappers, and bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scsgd_jax as sk
from tests import helpers

LR, NU = 0.1, 0.3
# the paper's C_0 = I EMA, folded every step, refreshed every N from step 0
PAPER = dict(statistics="dense", warm_start=False, statistics_every=1)


def _params(rng, n=6, p=3):
  return {"dense": {"kernel": jnp.asarray(rng.standard_normal((n, p)), jnp.float32),
                    "bias": jnp.zeros(p, jnp.float32)}}


def _plain(rank=3, **kw):
  """Conditioning followed by plain SGD, no momentum: W <- W - lr * A^{-1} G."""
  kw.setdefault("ema_rate", NU)
  kw.setdefault("update_every", 1)
  kw = {**PAPER, **kw}
  return optax.chain(sk.scale_by_sketched_conditioning(sk.Conditioning.from_flat(rank=rank, **kw)), optax.sgd(LR))


def test_dense_step_equals_hand_computed_full_conditioner():
  rng = np.random.default_rng(0)
  params = _params(rng)
  x = rng.standard_normal((16, 6))
  g = rng.standard_normal((6, 3))
  tx = _plain(conditioner="full")
  state = tx.init(params)
  grads = {"dense": {"kernel": jnp.asarray(g, jnp.float32), "bias": jnp.ones(3, jnp.float32)}}
  updates, state = jax.jit(tx.update)(grads, state, params, layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
  new = optax.apply_updates(params, updates)
  c = (1 - NU) * np.eye(6) + NU * x.T @ x / 16   # Section 3: EMA from C = I
  expected = np.asarray(params["dense"]["kernel"]) - LR * helpers.psd_power(c, -0.5) @ g   # W - eta A^{-1} G, (in, out) layout
  np.testing.assert_allclose(new["dense"]["kernel"], expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(new["dense"]["bias"], -LR * np.ones(3), rtol=1e-6)  # biases pass through
  np.testing.assert_allclose(state[0].statistics["dense/kernel"].moments, c, rtol=1e-5, atol=1e-6)


def test_the_estimator_keeps_the_statistics_and_factors_the_conditioning_reads():
  """The estimator alone (what the eigenbasis and the output side build on): its update folds C = (1 - nu) I +
  nu X^T X / m and rebuilds the factor C^{-1/2}, the conditioning's state after the same update; the conditioning
  is A^{-1} G of those factors."""
  from scsgd_jax._src import estimator as estimator_lib
  rng = np.random.default_rng(4)
  params = _params(rng)
  x, g = rng.standard_normal((16, 6)), rng.standard_normal((6, 3))
  c = sk.Conditioning.from_flat(conditioner="full", ema_rate=NU, update_every=1, **PAPER)
  est = estimator_lib.Estimator(c)
  tx = sk.scale_by_sketched_conditioning(c)
  grads = {"dense": {"kernel": jnp.asarray(g, jnp.float32), "bias": jnp.ones(3, jnp.float32)}}
  rows = {"dense": {"kernel": jnp.asarray(x, jnp.float32)}}
  state, plans, _ = est.update(grads, est.init(params), rows)
  assert list(plans) == ["dense/kernel"]
  c = (1 - NU) * np.eye(6) + NU * x.T @ x / 16
  np.testing.assert_allclose(state.statistics["dense/kernel"].moments, c, rtol=1e-5, atol=1e-6)
  a_inv = np.asarray(sk.sketch.precondition_kernel(state.factors["dense/kernel"], jnp.eye(6), (0,)))
  np.testing.assert_allclose(a_inv, helpers.psd_power(c, -0.5), rtol=1e-4, atol=1e-5)
  updates, tx_state = jax.jit(tx.update)(grads, tx.init(params), params, layer_inputs=rows)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), (tx_state.statistics, tx_state.factors),
               (state.statistics, state.factors))
  np.testing.assert_allclose(updates["dense"]["kernel"], a_inv @ g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("conditioner,rank", [("full", None), ("sketched", 3)])
def test_normalized_step_is_the_conditioner_of_c_over_its_mean_eigenvalue(conditioner, rank):
  """normalize='all': -lr (C / (tr C / n))^{-1/2} G, i.e. the plain step times sqrt(tr C / n), for the full and the
  sketched conditioner."""
  rng = np.random.default_rng(4)
  params = _params(rng, n=8, p=2)
  x = rng.standard_normal((32, 8)) * np.linspace(0.2, 3, 8)
  g = rng.standard_normal((8, 2))
  grads = {"dense": {"kernel": jnp.asarray(g, jnp.float32), "bias": jnp.zeros(2, jnp.float32)}}

  def step(normalize, scale=1.0):
    tx = _plain(rank=rank,
                conditioner=conditioner,
                normalize=normalize,
                **({} if conditioner == "full" else {
                    "oversample": 8
                }))
    updates, _ = tx.update(grads, tx.init(params), params,
                           layer_inputs={"dense": {"kernel": jnp.asarray(scale * x, jnp.float32)}})
    return np.asarray(updates["dense"]["kernel"], np.float64)

  c = (1 - NU) * np.eye(8) + NU * x.T @ x / 32
  np.testing.assert_allclose(step("all"), np.sqrt(np.trace(c) / 8) * step("none"), rtol=1e-4, atol=1e-6)
  if rank is None:
    np.testing.assert_allclose(step("all"), -LR * helpers.psd_power(c / (np.trace(c) / 8), -0.5) @ g, rtol=1e-3,
                               atol=1e-5)
  for bad in (1, True, "mean"):
    with pytest.raises(
        ValueError,
        match=re.escape(f"Conditioner.normalize must be one of ('none', 'embeddings', 'all'), got {bad!r}")):
      sk.scsgd(0.1, sk.Conditioning(conditioner=sk.Conditioner(normalize=bad)))


@pytest.mark.parametrize("normalize", ["none", "embeddings", "all"])
def test_normalize_embeddings_scales_the_embeddings_conditioner_alone(normalize):
  """normalize='embeddings': the embedding's step is -lr (d / (sum d / vocab))^{-1/2} g (d: the EMA of its token
  frequencies from C = I), the dense kernel's the paper's -lr C^{-1/2} G; 'none' and 'all' scale neither and both."""
  rng = np.random.default_rng(5)
  params = {**_params(rng), "embed": {"embedding": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)}}
  x = rng.standard_normal((16, 6)) * np.linspace(0.3, 2, 6)
  ids = np.array([0, 0, 0, 1, 1, 2, 0, 3, 0, 1, 0, 0])
  grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
  tx = _plain(rank=None, conditioner="full", normalize=normalize)
  updates, _ = tx.update(grads, tx.init(params), params,
                         layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)},
                                       "embed": {"embedding": jnp.asarray(ids)}})
  d = (1 - NU) + NU * np.bincount(ids, minlength=5) / ids.size
  scale = np.sqrt(d.sum() / 5) if normalize != "none" else 1.0
  expected = -LR * scale * d[:, None] ** -0.5 * np.asarray(grads["embed"]["embedding"])
  np.testing.assert_allclose(updates["embed"]["embedding"], expected, rtol=1e-5, atol=1e-7)
  c = (1 - NU) * np.eye(6) + NU * x.T @ x / 16
  scale = np.sqrt(np.trace(c) / 6) if normalize == "all" else 1.0
  expected = -LR * scale * helpers.psd_power(c, -0.5) @ np.asarray(grads["dense"]["kernel"])
  np.testing.assert_allclose(updates["dense"]["kernel"], expected, rtol=1e-4, atol=1e-5)


def test_dense_step_equals_hand_computed_rank_k_conditioner():
  """With r = k + oversample >= n the sketch spans R^n: the factor is the exact rank-k one (Section 2.2)."""
  rng = np.random.default_rng(1)
  params = _params(rng, n=8, p=2)
  x = rng.standard_normal((32, 8)) * np.linspace(0.2, 3, 8)
  g = rng.standard_normal((8, 2))
  k = 3
  tx = _plain(rank=k, conditioner="sketched", oversample=8)
  state = tx.init(params)
  grads = {"dense": {"kernel": jnp.asarray(g, jnp.float32), "bias": jnp.zeros(2, jnp.float32)}}
  updates, _ = tx.update(grads, state, params, layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
  c = (1 - NU) * np.eye(8) + NU * x.T @ x / 32
  w, v = np.linalg.eigh(c)
  w, v = w[::-1], v[:, ::-1]
  qk = v[:, :k]
  a = np.sqrt((np.trace(c) - w[:k].sum()) / (8 - k))
  a_inv = qk @ np.diag(w[:k] ** -0.5) @ qk.T + (np.eye(8) - qk @ qk.T) / a  # Lemma 2
  np.testing.assert_allclose(updates["dense"]["kernel"], -LR * a_inv @ g, rtol=1e-3, atol=1e-5)


class _ConvNet(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 3, (3, 3), strides=2, padding="SAME", rngs=rngs)

  def __call__(self, x):
    return jnp.sum(self.conv(x) ** 2)


def test_conv_step_equals_explicit_im2col_with_stride2_same_padding():
  rng = np.random.default_rng(2)
  model = _ConvNet(nnx.Rngs(0))
  x = rng.standard_normal((2, 7, 7, 2)).astype(np.float32)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  tx = _plain(conditioner="full")
  state = tx.init(params)

  def loss(m):
    out, li = sk.capture_nnx(m, jnp.asarray(x), max_rows=None)
    return out, li

  (_, layer_inputs), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  grads = nnx.as_pure(grads)
  updates, _ = tx.update(grads, state, params, layer_inputs=layer_inputs)
  # SAME with stride 2 on 7: out 4, total pad 2 -> (1, 1).
  rows = helpers.im2col(x, (3, 3), (2, 2), (1, 1), [(1, 1), (1, 1)])
  np.testing.assert_allclose(layer_inputs["conv"]["kernel"], rows, rtol=1e-6)
  c = (1 - NU) * np.eye(18) + NU * rows.T @ rows / rows.shape[0]
  g = np.asarray(grads["conv"]["kernel"]).reshape(18, 3)
  expected = -LR * (helpers.psd_power(c, -0.5) @ g).reshape(3, 3, 2, 3)
  np.testing.assert_allclose(updates["conv"]["kernel"], expected, rtol=1e-3, atol=1e-5)
  # the gradient itself is the im2col product: dL/dW = rows^T dL/dy
  y = rows @ np.asarray(params["conv"]["kernel"]).reshape(18, 3) + np.asarray(params["conv"]["bias"])
  np.testing.assert_allclose(g, rows.T @ (2 * y), rtol=1e-3, atol=1e-3)


def test_refresh_only_every_update_every_steps():
  rng = np.random.default_rng(3)
  params = _params(rng)
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning.from_flat(rank=3, update_every=3, ema_rate=0.5, conditioner="full", **PAPER))
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  step = jax.jit(tx.update)
  factors = []
  for t in range(7):
    x = jnp.asarray(rng.standard_normal((8, 6)) * (t + 1), jnp.float32)
    _, state = step(grads, state, params, layer_inputs={"dense": {"kernel": x}})
    factors.append(np.asarray(state.factors["dense/kernel"].b_inv))
  changed = [not np.allclose(factors[t], factors[t - 1]) for t in range(1, 7)]
  assert changed == [False, False, True, False, False, True]  # refreshed at counts 0, 3, 6


def test_kernels_of_equal_dim_are_factored_together_and_match_singletons():
  rng = np.random.default_rng(4)
  params = {"a": {"kernel": jnp.zeros((20, 2))}, "b": {"kernel": jnp.zeros((20, 5))}}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning.from_flat(rank=4, seed=3, update_every=1, ema_rate=1.0, conditioner="sketched", **PAPER))
  state = tx.init(params)
  xa = jnp.asarray(rng.standard_normal((64, 20)), jnp.float32)
  xb = jnp.asarray(rng.standard_normal((64, 20)) * np.linspace(0.1, 2, 20), jnp.float32)
  grads = jax.tree.map(jnp.ones_like, params)
  _, new = jax.jit(tx.update)(grads, state, params, layer_inputs={"a": {"kernel": xa}, "b": {"kernel": xb}})
  keys = jax.random.split(state.key, 3)[1:]
  for key, name, x in zip(keys, ["a/kernel", "b/kernel"], [xa, xb]):
    single = sk.sketch.sketched_factor(key, x.T @ x / 64, 4, oversample=10, power_iterations=1)
    np.testing.assert_allclose(sk.sketch.inverse_matrix(new.factors[name]), sk.sketch.inverse_matrix(single), rtol=1e-3, atol=1e-4)


def _loss_and_inputs(params, x, y):
  h = x @ params["dense"]["kernel"] + params["dense"]["bias"][None, :]
  return jnp.mean((h - y) ** 2)


def _run(tx, params, steps=5, seed=0):
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    g = jax.grad(_loss_and_inputs)(params, x, y)
    u, state = tx.update(g, state, params, layer_inputs={"dense": {"kernel": x}})
    return optax.apply_updates(params, u), state

  for x, y in _batches(steps, seed):
    params, state = step(params, state, x, y)
  return params, state


def _batches(steps=6, seed=0):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.standard_normal((16, 6)), jnp.float32), jnp.asarray(rng.standard_normal((16, 3)), jnp.float32))
          for _ in range(steps)]


def _multisteps_oracle(base, params, k=2):
  """optax.MultiSteps by hand: the mean gradient of k micro-batches, with the last micro-batch's rows."""
  state = base.init(params)
  batches = _batches()
  for i in range(0, len(batches), k):
    group = batches[i:i + k]
    grads = [jax.grad(_loss_and_inputs)(params, x, y) for x, y in group]
    g = jax.tree.map(lambda *gs: sum(gs) / len(gs), *grads)
    u, state = base.update(g, state, params, layer_inputs={"dense": {"kernel": group[-1][0]}})
    params = optax.apply_updates(params, u)
  return params


def _kernel_only_oracle(base, params, bias_update):
  """``base`` on the kernel alone, the bias moved by ``bias_update(gradient)`` (what partition/masked do)."""
  state = base.init({"dense": {"kernel": params["dense"]["kernel"]}})
  for x, y in _batches():
    g = jax.grad(_loss_and_inputs)(params, x, y)
    u, state = base.update({"dense": {"kernel": g["dense"]["kernel"]}}, state,
                           {"dense": {"kernel": params["dense"]["kernel"]}}, layer_inputs={"dense": {"kernel": x}})
    params = {"dense": {"kernel": params["dense"]["kernel"] + u["dense"]["kernel"],
                        "bias": params["dense"]["bias"] + bias_update(g["dense"]["bias"])}}
  return params


@pytest.mark.parametrize("wrapper", ["chain", "partition", "masked", "inject", "multisteps", "apply_if_finite"])
def test_optax_wrappers_condition_exactly_as_the_unwrapped_transformation(wrapper):
  """Each wrapper's conditioned kernel equals an oracle built from the unwrapped transformation, and that
  differs from plain Nesterov SGD's: a wrapper that skipped the conditioning would fail."""
  params = _params(np.random.default_rng(5))
  base = sk.scsgd(0.01, sk.Conditioning(rank=2, refresh=sk.Refresh(every=2)))
  reference = _run(base, params, steps=6)[0]
  plain = _run(optax.sgd(0.01, momentum=0.9, nesterov=True), params, steps=6)[0]
  assert not np.allclose(reference["dense"]["kernel"], plain["dense"]["kernel"], rtol=1e-3)
  if wrapper == "chain":  # a clip that never binds: the chain must leave the conditioning as it is
    tx = optax.chain(optax.clip_by_global_norm(1e9), base)
  elif wrapper == "partition":
    tx = optax.partition({"cond": base, "plain": optax.sgd(0.01)}, {"dense": {"kernel": "cond", "bias": "plain"}})
    reference = _kernel_only_oracle(base, params, lambda g: -0.01 * g)
  elif wrapper == "masked":  # the bias's update is its raw gradient (masked passes it, identity keeps it)
    tx = optax.chain(optax.masked(base, {"dense": {"kernel": True, "bias": False}}), optax.identity())
    reference = _kernel_only_oracle(base, params, lambda g: g)
  elif wrapper == "inject":
    tx = optax.inject_hyperparams(sk.scsgd)(learning_rate=0.01,
                                            conditioning=sk.Conditioning(rank=2, refresh=sk.Refresh(every=2)))
  elif wrapper == "multisteps":
    tx = optax.MultiSteps(base, every_k_schedule=2)
    reference = _multisteps_oracle(base, params)
  else:
    tx = optax.apply_if_finite(base, max_consecutive_errors=3)
  new = _run(tx, params, steps=6)[0]
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(reference)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_schedule_and_convergence_on_least_squares():
  """Regression with inputs scaled over two decades: at its best step size from one shared grid, the
  conditioned run (A = C^{1/2}) reaches a far lower loss than Nesterov SGD at its own best, with the step bound
  (a zero-initialised kernel grows at most 2% a step) and without it."""
  rng = np.random.default_rng(6)
  scales = np.logspace(-1, 1, 6)
  w_true = rng.standard_normal((6, 3))
  xs = [rng.standard_normal((32, 6)) * scales for _ in range(150)]
  x_eval = jnp.asarray(np.concatenate(xs[:20]), jnp.float32)

  def run(make_tx, lr):
    tx = make_tx(optax.exponential_decay(lr, 100, 0.5))  # a schedule, as optax optimizers accept
    params = {"dense": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(3)}}
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
      g = jax.grad(_loss_and_inputs)(params, x, x @ w_true)
      u, state = tx.update(g, state, params, layer_inputs={"dense": {"kernel": x}})
      return optax.apply_updates(params, u), state

    for x in xs:
      params, state = step(params, state, jnp.asarray(x, jnp.float32))
    loss = float(_loss_and_inputs(params, x_eval, x_eval @ w_true))
    return loss if np.isfinite(loss) else np.inf

  grid = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
  sgd = min(run(lambda s: optax.with_extra_args_support(optax.sgd(s, momentum=0.9, nesterov=True)), lr) for lr in grid)
  conditioning = sk.Conditioning(rank=2, conditioner=sk.Conditioner(kind="full"), refresh=sk.Refresh(every=10))
  cond = min(run(lambda s: sk.scsgd(s, conditioning, max_relative_step=None), lr) for lr in grid)  # the paper's step
  assert cond < 0.2 * sgd, (cond, sgd)
  # at its defaults the step bound holds the kernel's growth from zero to 2% a step: slower here, still far ahead
  bounded = min(run(lambda s: sk.scsgd(s, conditioning), lr) for lr in grid)
  assert bounded < 0.5 * sgd, (bounded, sgd)


def test_nnx_optimizer_forwards_layer_inputs():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(5, 4, rngs=rngs)
      self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  model = Net(nnx.Rngs(0))
  opt = nnx.Optimizer(model, sk.scsgd(0.05, sk.Conditioning(rank=2, refresh=sk.Refresh(every=1))), wrt=nnx.Param)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 5)), jnp.float32)

  @nnx.jit
  def step(model, opt):
    def loss_fn(m):
      out, li = sk.capture_nnx(m, x)
      return jnp.mean(out ** 2), li
    (loss, li), g = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, g, layer_inputs=li)
    return loss

  losses = [float(step(model, opt)) for _ in range(20)]
  assert losses[-1] < losses[0]


def test_state_survives_lax_cond_and_bf16_keeps_dtype():
  params = {"dense": {"kernel": jnp.ones((6, 3), jnp.bfloat16), "bias": jnp.zeros(3, jnp.bfloat16)}}
  tx = sk.scsgd(0.1, sk.Conditioning(rank=2, refresh=sk.Refresh(every=1)))
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  li = {"dense": {"kernel": jnp.ones((4, 6), jnp.bfloat16)}}

  @jax.jit
  def f(pred, state):
    return jax.lax.cond(pred, lambda s: tx.update(grads, s, params, layer_inputs=li)[1], lambda s: s, state)

  new = f(True, state)
  same = f(False, state)
  assert jax.tree.structure(new) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  updates, _ = tx.update(grads, state, params, layer_inputs=li)
  assert updates["dense"]["kernel"].dtype == jnp.bfloat16
  assert updates["dense"]["bias"].dtype == jnp.bfloat16


# ---------------------------------------------------------------- bad input


def _single_update(tx, layer_inputs, params=None):
  params = params or {"dense": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(3)}}
  state = tx.init(params)
  return tx.update(jax.tree.map(jnp.ones_like, params), state, params, **layer_inputs)


def test_missing_layer_inputs_argument():
  with pytest.raises(ValueError, match="needs the keyword argument `layer_inputs`"):
    _single_update(sk.scsgd(0.1), {})


def test_layer_inputs_missing_a_kernel_names_it():
  params = {"a": {"kernel": jnp.zeros((6, 3))}, "b": {"kernel": jnp.zeros((3, 4))}}
  with pytest.raises(ValueError, match="no entry for the conditioned kernel 'b/kernel'"):
    _single_update(sk.scsgd(0.1), {"layer_inputs": {"a": {"kernel": jnp.ones((4, 6))}}}, params)


def test_wrong_shape_names_kernel_and_shapes():
  with pytest.raises(ValueError, match=r"layer_inputs\['dense/kernel'\] has shape \(4, 5\), expected \(rows, 6\)"):
    _single_update(sk.scsgd(0.1), {"layer_inputs": {"dense": {"kernel": jnp.ones((4, 5))}}})


def test_rank_at_least_n_names_kernel():
  with pytest.raises(ValueError, match="rank=6 must be < n=6.*'dense/kernel'"):
    sk.scsgd(0.1, sk.Conditioning(rank=6, conditioner=sk.Conditioner(kind="sketched"))).init(
        {"dense": {
            "kernel": jnp.zeros((6, 3))
        }})


@pytest.mark.parametrize("bad", [0, -5, 2.5])
def test_non_positive_update_every(bad):
  with pytest.raises(ValueError, match=r"Refresh\.every must be an int >= 1"):
    sk.scsgd(0.1, sk.Conditioning(refresh=sk.Refresh(every=bad)))


def test_bad_conditioner_and_rank_arguments():
  with pytest.raises(ValueError, match=r"Conditioner\.kind must be one of"):
    sk.scsgd(0.1, sk.Conditioning(conditioner=sk.Conditioner(kind="diag")))
  with pytest.raises(ValueError, match="rank must be an int >= 1"):
    sk.scsgd(0.1, sk.Conditioning(rank=0))
  with pytest.raises(ValueError, match="ema_rate must lie in"):
    sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(ema_rate=0.0)))


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("kind", ["zero", "rank_deficient", "huge", "tiny"])
@pytest.mark.parametrize("conditioner,statistics", [("full", "dense"), ("sketched", "dense"), ("sketched", "streaming"),
                                                    ("auto", "diagonal")])
@pytest.mark.parametrize("warm_start", [False, True])
def test_degenerate_inputs_keep_updates_finite(kind, conditioner, statistics, warm_start):
  rng = np.random.default_rng(7)
  n = 12
  if kind == "zero":
    x = np.zeros((16, n))
  elif kind == "rank_deficient":
    x = rng.standard_normal((16, 1)) @ rng.standard_normal((1, n))
  elif kind == "huge":
    x = rng.standard_normal((16, n)) * 1e15
  else:
    x = rng.standard_normal((16, n)) * 1e-20
  params = {"dense": {"kernel": jnp.zeros((n, 3)), "bias": jnp.zeros(3)}}
  tx = sk.scsgd(
      0.1,
      sk.Conditioning(rank=3,
                      refresh=sk.Refresh(every=1, warm_start=warm_start),
                      statistics=sk.Statistics(ema_rate=1.0, kind=statistics),
                      conditioner=sk.Conditioner(kind=conditioner)))
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for _ in range(3):
    updates, state = jax.jit(tx.update)(grads, state, params, layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
    for leaf in jax.tree.leaves((updates, state)):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert np.all(np.isfinite(np.asarray(leaf))), kind


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_inputs_do_not_poison_statistics(bad):
  rng = np.random.default_rng(8)
  params = {"dense": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(3)}}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(rank=2,
                      refresh=sk.Refresh(every=1),
                      statistics=sk.Statistics(ema_rate=0.5, fold_every=1),
                      conditioner=sk.Conditioner(kind="full")))
  grads = jax.tree.map(jnp.ones_like, params)
  good1, good2 = (jnp.asarray(rng.standard_normal((8, 6)), jnp.float32) for _ in range(2))
  poisoned = good1.at[3, 2].set(bad)
  step = jax.jit(tx.update)

  s = tx.init(params)
  _, s = step(grads, s, params, layer_inputs={"dense": {"kernel": good1}})
  _, s_bad = step(grads, s, params, layer_inputs={"dense": {"kernel": poisoned}})
  for a, b in zip(jax.tree.leaves(s_bad.statistics), jax.tree.leaves(s.statistics)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(s_bad.factors["dense/kernel"], s.factors["dense/kernel"]):
    np.testing.assert_array_equal(a, b)
  u_after, _ = step(grads, s_bad, params, layer_inputs={"dense": {"kernel": good2}})
  u_clean, _ = step(grads, s, params, layer_inputs={"dense": {"kernel": good2}})
  np.testing.assert_allclose(u_after["dense"]["kernel"], u_clean["dense"]["kernel"], rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(u_after["dense"]["kernel"])))


def test_statistics_every_folds_only_on_its_steps():
  params = {"dense": {"kernel": jnp.zeros((4, 2))}}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning.from_flat(rank=2,
                                update_every=100,
                                ema_rate=0.5,
                                conditioner="full",
                                **{
                                    **PAPER, "statistics_every": 3
                                }))
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  x = jnp.full((2, 4), 2.0)
  expected = np.eye(4)
  step = jax.jit(tx.update)
  for t in range(7):
    _, state = step(grads, state, params, layer_inputs={"dense": {"kernel": x}})
    if t % 3 == 0:  # ema_rate is per step: a fold every 3 steps weighs its batch 1 - 0.5^3
      expected = 0.5 ** 3 * expected + (1 - 0.5 ** 3) * np.full((4, 4), 4.0)
    np.testing.assert_allclose(state.statistics["dense/kernel"].moments, expected, rtol=1e-6)


def test_custom_statistics_plug_in():
  """A user statistic (here: running mean without decay) replaces the EMA without touching the rest."""
  def init(n, key):
    del key
    return (jnp.zeros((n, n)), jnp.zeros(()))

  def update(s, rows):
    total, count = s
    return total + rows.T @ rows, count + rows.shape[0]

  def correlation(s):
    return s[0] / jnp.maximum(s[1], 1.0)

  def factor(s, key, rank):
    del key, rank
    return sk.sketch.full_factor(correlation(s))

  stats = sk.sketch.CorrelationStatistics(init, update, factor, correlation, lambda s: jnp.trace(correlation(s)))
  params = {"dense": {"kernel": jnp.zeros((3, 2))}}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(rank=1, conditioner=sk.Conditioner(kind="full"), refresh=sk.Refresh(every=1), statistics=stats))
  rng = np.random.default_rng(9)
  x = rng.standard_normal((20, 3))
  g = rng.standard_normal((3, 2))
  u, state = tx.update({"dense": {"kernel": jnp.asarray(g, jnp.float32)}}, tx.init(params), params,
                       layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
  np.testing.assert_allclose(u["dense"]["kernel"], helpers.psd_power(x.T @ x / 20, -0.5) @ g, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("arg,value", [
    ("eigenvalue_floor", float("nan")), ("eigenvalue_floor", -1.0), ("eigenvalue_floor", 2.0),
    ("outlier_threshold", 0.0), ("outlier_threshold", float("nan")), ("outlier_threshold", 0.5),
    ("ema_rate", float("nan")), ("ema_rate", float("inf")), ("momentum", 1.0), ("momentum", float("nan")),
])
def test_every_float_argument_is_checked_at_construction_naming_it(arg, value):
  """A NaN or out-of-range float once turned the method silently into plain SGD (or worse)."""
  owner = {"eigenvalue_floor": "Conditioner.", "outlier_threshold": "Statistics.", "ema_rate": "Statistics."}
  with pytest.raises(ValueError, match=rf"^{re.escape(owner.get(arg, ''))}{arg} must lie in "):
    if arg == "momentum":
      sk.scsgd(0.1, momentum=value)
    else:
      sk.scsgd(0.1, sk.Conditioning.from_flat(**{arg: value}))


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1])
def test_learning_rate_must_be_finite_and_non_negative(lr):
  with pytest.raises(ValueError, match="^learning_rate must lie in"):
    sk.scsgd(lr)


def test_outlier_threshold_inf_turns_the_guard_off():
  rng = np.random.default_rng(3)
  params = _params(rng)
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(rank=3,
                      statistics=sk.Statistics(outlier_threshold=float("inf"), fold_every=1, ema_rate=NU),
                      conditioner=sk.Conditioner(kind="full"),
                      refresh=sk.Refresh(every=1, warm_start=False)))
  state = tx.init(params)
  x = rng.standard_normal((8, 6)).astype(np.float32)
  x[0] *= 1e4  # far above 100x the running tr C: clipped by the default guard, kept here
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(grads, state, params, layer_inputs={"dense": {"kernel": jnp.asarray(x)}})
  assert int(state.clipped_rows["dense/kernel"]) == 0
  np.testing.assert_allclose(state.statistics["dense/kernel"].moments, (1 - NU) * np.eye(6) + NU * x.T @ x / 8,
                             rtol=1e-4)


@pytest.mark.parametrize("statistics", ["dense", "streaming", "diagonal"])
def test_a_kernel_with_no_rows_skips_its_fold_and_the_others_fold(statistics):
  """Rows of shape (0, n) (an empty micro-batch, a fully masked layer) once failed inside jnp.median."""
  rng = np.random.default_rng(4)
  params = {"a": _params(rng, n=6, p=3)["dense"], "b": _params(rng, n=5, p=2)["dense"]}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(rank=2,
                      statistics=sk.Statistics(kind=statistics, ema_rate=NU),
                      refresh=sk.Refresh(warm_start=False),
                      conditioner=sk.Conditioner(kind="sketched" if statistics != "diagonal" else "auto")))
  state = tx.init(params)
  xa = jnp.asarray(rng.standard_normal((7, 6)), jnp.float32)
  grads = jax.tree.map(jnp.ones_like, params)
  _, new = jax.jit(tx.update)(grads, state, params, layer_inputs={"a": {"kernel": xa},
                                                                  "b": {"kernel": jnp.zeros((0, 5))}})
  _, alone = tx.update({"a": grads["a"]}, tx.init({"a": params["a"]}), None, layer_inputs={"a": {"kernel": xa}})
  for x, y in zip(jax.tree.leaves(new.statistics["b/kernel"]), jax.tree.leaves(state.statistics["b/kernel"])):
    np.testing.assert_array_equal(x, y)  # b: untouched
  for x, y in zip(jax.tree.leaves(new.statistics["a/kernel"]), jax.tree.leaves(alone.statistics["a/kernel"])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # a: folded as if alone (jit vs eager: rounding)
  assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(new))


def test_summary_names_every_kernel_left_unconditioned_and_why(caplog):
  """A kernel the filter excludes, and one the memory rule leaves plain, appear in the summary with the reason
  (and once in the log), so no layer silently falls back to SGD."""
  import logging

  params = {"a": {"kernel": jnp.zeros((40, 3))}, "b": {"kernel": jnp.zeros((300, 1))},
            "e": {"embedding": jnp.zeros((10, 4))}}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(kernel_filter=lambda path, leaf: path != "e/embedding",
                      statistics=sk.Statistics(budget="kernel")))
  with caplog.at_level(logging.INFO, logger="scsgd_jax"):
    summary = tx.init(params).summary()
  assert summary == {"a/kernel": "diagonal C, n=40",
                     "b/kernel": "not conditioned: no statistics fit its memory budget (Statistics(kind='auto'))",
                     "e/embedding": "not conditioned: excluded by kernel_filter"}
  assert [r.getMessage() for r in caplog.records] == [
      "kernels left unconditioned (plain updates): b/kernel (not conditioned: no statistics fit its memory budget "
      "(Statistics(kind='auto'))); e/embedding (not conditioned: excluded by kernel_filter)"]


@pytest.mark.parametrize("kwargs,advice", [
    (dict(statistics="streaming", rank=8), "or use Statistics(kind='auto')"),
    (dict(conditioner="sketched", rank=8), "or use Conditioner(kind='auto')"),
    (dict(statistics="dense", rank=8, full_max_dim=4), "or raise Conditioner(full_max_dim=...) (now 4) to at least n"),
])
def test_a_rank_at_least_n_is_refused_with_advice_that_leads_somewhere(kwargs, advice):
  import re

  with pytest.raises(ValueError, match=re.escape(f"rank=8 must be < n=8, the input dimension of kernel 'd/kernel': "
                                                 f"lower rank below n, {advice}")):
    sk.scale_by_sketched_conditioning(sk.Conditioning.from_flat(**kwargs)).init({"d": {"kernel": jnp.zeros((8, 3))}})


def test_kernels_alike_fold_as_one_bank_each_member_exactly_as_alone():
  """Kernels of one plan whose rows have one shape fold as one bank (one computation over their stacked rows):
  each member's statistics are its own hand-computed EMA, (1 - nu) I + nu X^T X / m, a stacked kernel's slices
  each their own; an outlier is clipped in its own member only (and counted there); a member whose rows are not
  finite keeps its statistics while the others fold; a kernel of the same n with another number of rows folds
  apart, as exactly."""
  rng = np.random.default_rng(5)
  n, p, m = 6, 3, 8
  params = {k: {"kernel": jnp.asarray(rng.standard_normal((n, p)), jnp.float32)} for k in ("a", "b", "c", "d")}
  params["s"] = {"kernel": jnp.asarray(rng.standard_normal((2, n, p)), jnp.float32)}  # a stack of two layers
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(rank=3,
                      statistics=sk.Statistics(kind="dense", ema_rate=NU, fold_every=1),
                      refresh=sk.Refresh(warm_start=False),
                      input_axes={"s/kernel": sk.Layout((0,), stack=1)}))
  state = tx.init(params)
  rows = {k: rng.standard_normal((m, n)).astype(np.float32) for k in ("a", "b", "c")}
  rows["b"][0] *= 1e3  # an outlier: clipped in b alone
  rows["c"][1, 2] = np.nan  # c keeps its statistics
  rows["d"] = rng.standard_normal((m + 3, n)).astype(np.float32)  # same plan, other rows: its own bank
  rows["s"] = rng.standard_normal((2, m, n)).astype(np.float32)
  rows["s"][1, 3] *= 1e3  # an outlier in the stack's second layer: the stack's count is its layers' sum
  grads = jax.tree.map(jnp.ones_like, params)
  _, new = jax.jit(tx.update)(grads, state, params,
                              layer_inputs={k: {"kernel": jnp.asarray(x)} for k, x in rows.items()})
  ema = lambda x: (1 - NU) * np.eye(n) + NU * x.T.astype(np.float64) @ x / x.shape[0]
  bound = np.sqrt(100.0 * n)  # the guard's bound: 100 x the running tr C = n (the identity prior)
  clipped_b = rows["b"].copy()
  clipped_b[0] *= bound / np.linalg.norm(clipped_b[0])
  expected = {"a": ema(rows["a"]), "b": ema(clipped_b), "c": np.eye(n), "d": ema(rows["d"])}
  for k, c in expected.items():
    np.testing.assert_allclose(new.statistics[f"{k}/kernel"].moments, c, rtol=1e-5, atol=1e-6, err_msg=k)
  clipped_s = rows["s"][1].copy()
  clipped_s[3] *= bound / np.linalg.norm(clipped_s[3])
  for i, x in enumerate([rows["s"][0], clipped_s]):
    np.testing.assert_allclose(new.statistics["s/kernel"].moments[i], ema(x), rtol=1e-5, atol=1e-6)
  assert {k: int(v) for k, v in new.clipped_rows.items()} == {"a/kernel": 0, "b/kernel": 1, "c/kernel": 0,
                                                               "d/kernel": 0, "s/kernel": 1}
