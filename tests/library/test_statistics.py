"""Statistics: streaming Nystrom vs dense, diagonal/embedding, bias-corrected warm start, memory rule, outlier guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scsgd_jax as sk
from scsgd_jax._src import defaults
from scsgd_jax._src import budget
from scsgd_jax._src import fold
from tests.helpers import kernel_lines


def _decaying(n, rng, decay=5.0):
  u, _ = np.linalg.qr(rng.standard_normal((n, n)))
  return u, np.exp(-np.arange(n) / decay) + 1e-3


def test_streaming_sketch_is_exactly_the_dense_ema_times_omega():
  """C -> C Omega is linear, so the EMA of the per-batch sketches is the dense EMA's sketch, with or without prior."""
  rng = np.random.default_rng(0)
  n, k = 30, 4
  for prior in (True, False):
    dense = sk.sketch.ema_correlation(0.2, identity_prior=prior)
    stream = sk.sketch.nystrom_correlation(k, 0.2, identity_prior=prior)
    sd, ss = dense.init(n, None), stream.init(n, jax.random.PRNGKey(1))
    for _ in range(5):
      rows = jnp.asarray(rng.standard_normal((16, n)) * np.linspace(0.1, 3, n), jnp.float32)
      sd, ss = dense.update(sd, rows), stream.update(ss, rows)
    c = np.asarray(sd.moments) / float(sd.weight)  # the bias-corrected EMA itself (no isotropic fill)
    y, trace = (np.asarray(m) / float(ss.ema.weight) for m in ss.ema.moments)
    np.testing.assert_allclose(y, c @ np.asarray(ss.omega), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trace, np.trace(c), rtol=1e-5)
    np.testing.assert_allclose(float(stream.trace(ss)), float(dense.trace(sd)), rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_streaming_factor_bound_terms_within_factor_of_dense_sketch(seed):
  """Fast-decaying spectrum: Nystrom's tr(A) tr(A^-1 C) is within 1.25x of Algorithm 1 on the dense C (power iteration 1)."""
  rng = np.random.default_rng(seed)
  n, k = 256, 16
  u, evals = _decaying(n, rng)
  x = rng.standard_normal((4096, n)) * np.sqrt(evals) @ u.T
  dense = sk.sketch.ema_correlation(1.0)
  stream = sk.sketch.nystrom_correlation(k, 1.0)
  rows = jnp.asarray(x, jnp.float32)
  sd = dense.update(dense.init(n, None), rows)
  ss = stream.update(stream.init(n, jax.random.PRNGKey(seed)), rows)
  c = jnp.asarray(x.T @ x / x.shape[0], jnp.float32)
  key = jax.random.PRNGKey(seed + 10)

  def product(f):
    t = sk.sketch.bound_terms(f, c)
    return float(t.trace_a * t.trace_a_inv_c)

  ratio = product(stream.factor(ss, key, k)) / product(dense.factor(sd, key, k))
  assert 0.95 < ratio < 1.25, ratio


def test_nystrom_is_exact_when_c_has_rank_at_most_k():
  rng = np.random.default_rng(1)
  n, k = 40, 5
  z = rng.standard_normal((n, k))
  c = z @ z.T + 0.0
  omega, _ = np.linalg.qr(rng.standard_normal((n, k + 6)))
  f = sk.sketch.nystrom_factor(jnp.asarray(c @ omega, jnp.float32), jnp.asarray(omega, jnp.float32), np.trace(c), k)
  exact = sk.sketch.low_rank_factor(jnp.asarray(c, jnp.float32), k)
  np.testing.assert_allclose(np.asarray(f.q @ f.q.T), np.asarray(exact.q @ exact.q.T), atol=1e-3)
  np.testing.assert_allclose(np.sort(np.diag(f.b_inv)), np.sort(np.linalg.eigvalsh(np.asarray(exact.b_inv))), rtol=1e-2)


def test_diagonal_factor_and_embedding_statistic_oracle():
  ids = jnp.asarray([[0, 0, 3], [3, 3, 1]], jnp.int32)
  stats = sk.sketch.diagonal_correlation(1.0, takes_ids=True)
  s = stats.update(stats.init(5), ids)
  freq = np.array([2, 1, 0, 3, 0]) / 6
  np.testing.assert_allclose(np.diag(stats.correlation(s)), freq, rtol=1e-6)
  f = stats.factor(s, None, 0)
  floor = defaults.EIGENVALUE_FLOOR * 1.0 / 5  # the optimizer statistics' floor, relative to tr C / n
  np.testing.assert_allclose(f.a_inv, 1 / np.sqrt(np.maximum(freq, floor)), rtol=1e-5)
  g = np.arange(10.0).reshape(5, 2)
  np.testing.assert_allclose(sk.sketch.precondition_kernel(f, jnp.asarray(g, jnp.float32)),
                             g / np.sqrt(np.maximum(freq, floor))[:, None], rtol=1e-5)
  np.testing.assert_allclose(sk.sketch.inverse_matrix(f), np.diag(np.asarray(f.a_inv)), rtol=1e-6)


def test_bias_corrected_ema_is_the_weighted_mean_of_batches():
  """Without the prior, with w_t = 1 - (1-nu)^t: C_t = sum_s nu (1-nu)^(t-s) B_s / w_t + (1 - w_t) (tr C_t / n) I."""
  rng = np.random.default_rng(2)
  nu, n = 0.3, 4
  stats = sk.sketch.ema_correlation(nu, identity_prior=False)
  s = stats.init(n, None)
  batches = [rng.standard_normal((8, n)) for _ in range(3)]
  for t, b in enumerate(batches, start=1):
    s = stats.update(s, jnp.asarray(b, jnp.float32))
    weights = [nu * (1 - nu) ** (t - i) for i in range(1, t + 1)]
    w_t = 1 - (1 - nu) ** t
    mean = sum(w * bb.T @ bb / 8 for w, bb in zip(weights, batches)) / w_t
    expected = mean + (1 - w_t) * np.trace(mean) / n * np.eye(n)
    np.testing.assert_allclose(stats.correlation(s), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(stats.trace(s)), np.trace(mean), rtol=1e-5)


# ---------------------------------------------------------------- memory


def _floats(tree):
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("kind,k", [("dense", None), ("dense", 7), ("streaming", 7), ("diagonal", 0)])
def test_memory_rule_counts_the_real_state(kind, k):
  n, p = 40, 200
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(
          rank=k or 7,
          statistics=sk.Statistics(kind=kind, oversample=None if kind == "diagonal" or k is None else 5),
          conditioner=sk.Conditioner(kind="full" if k is None else "sketched" if kind != "diagonal" else "auto")))
  state = jax.eval_shape(tx.init, {"kernel": jnp.zeros((n, p))})
  real = _floats((state.statistics, state.factors))
  assert real == budget.state_floats(kind, n, k, min((k or 0) + 5, n))


N_GRID = [8, 25, 64, 256, 500, 800, 1024, 4096, 16384]
P_GRID = [1, 2, 10, 64, 1000, 4096]


@pytest.mark.parametrize("budget", ["kernel", "model"])
def test_default_state_is_at_most_adams_for_every_kernel_shape(budget):
  for n in N_GRID:
    for p in P_GRID:
      params = {"dense": {"kernel": jnp.zeros((n, p)), "bias": jnp.zeros((p,))}}
      ours = _floats(
          jax.eval_shape(sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(budget=budget))).init, params))
      adam = _floats(jax.eval_shape(optax.adam(1e-3).init, params))
      assert ours <= adam, (n, p, ours, adam)
      if budget == "model":  # no bias: the bound is the kernel's alone
        kernel = {"kernel": jnp.zeros((n, p))}
        ours = _floats(
            jax.eval_shape(sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(budget=budget))).init, kernel))
        assert ours <= _floats(jax.eval_shape(optax.adam(1e-3).init, kernel)), (n, p)


def test_default_statistics_of_n16384_at_rank_64_fit_in_10_mib():
  params = {"kernel": jnp.zeros((16384, 1024))}
  state = jax.eval_shape(sk.scale_by_sketched_conditioning(sk.Conditioning(rank=64)).init, params)
  stats_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.statistics))
  assert stats_bytes <= 10 * 2**20, stats_bytes / 2**20
  assert state.factors["kernel"].q.shape == (16384, 64)  # streaming keeps the full rank here


def test_auto_gives_each_kernel_alone_its_best_option_within_n_times_p():
  tx = sk.scale_by_sketched_conditioning(sk.Conditioning(rank=8))
  shapes = {"wide": (20, 400), "mid": (200, 60), "thin": (200, 10), "column": (200, 1)}
  kinds = {}
  for name, shape in shapes.items():
    kinds.update(jax.eval_shape(tx.init, {name: {"kernel": jnp.zeros(shape)}}).summary())
  assert kinds == {
      "wide/kernel": "dense C, full C^(1/2), n=20",  # n <= 4 * rank
      "mid/kernel": "streaming C Omega, rank 8, n=200",  # dense C (40,000 floats) > 12,000
      "thin/kernel": "diagonal C, n=200",  # streaming at rank 1 (4,604 floats) > 2,000
      # p = 1: nothing fits beside the momentum: plain SGD, and the summary says so
      "column/kernel": "not conditioned: no statistics fit its memory budget (Statistics(kind='auto'))",
  }


def test_model_budget_spends_the_leftover_floats_on_the_smallest_n_first():
  """budget='model', LeNet's kernels: alone, conv1 (25 x 20) and dense2 (500 x 10) get only diagonal statistics and conv2
  (500 x 50) streaming at rank 9; the floats dense1 (800 x 500) leaves pay for conv1's dense C and full
  C^{1/2}, then conv2's dense C, then dense2's streaming at the full rank, smallest n first. (The default.)"""
  shapes = {"conv1": (5, 5, 1, 20), "conv2": (5, 5, 20, 50), "dense1": (800, 500), "dense2": (500, 10)}
  params = {k: {"kernel": jnp.zeros(s), "bias": jnp.zeros(s[-1])} for k, s in shapes.items()}
  state = jax.eval_shape(sk.scale_by_sketched_conditioning().init, params)
  assert kernel_lines(state.summary()) == {
      "conv1/kernel": "dense C, full C^(1/2), n=25", "conv2/kernel": "dense C, rank 32, n=500",
      "dense1/kernel": "streaming C Omega, rank 32, n=800", "dense2/kernel": "streaming C Omega, rank 32, n=500"}
  assert _floats((state.statistics, state.factors)) <= _floats(params)
  alone = {}  # budget='kernel' gives each kernel of the model what it gets alone
  assert kernel_lines(
      jax.eval_shape(
          sk.scale_by_sketched_conditioning(sk.Conditioning(statistics=sk.Statistics(budget="kernel"))).init,
          params).summary()) == {
              "conv1/kernel": "diagonal C, n=25",
              "conv2/kernel": "streaming C Omega, rank 9, n=500, rank 32 asked: cut by the memory rule",
              "dense1/kernel": "streaming C Omega, rank 32, n=800",
              "dense2/kernel": "diagonal C, n=500"
          }
  for k in shapes:
    alone.update(
        jax.eval_shape(
            sk.scale_by_sketched_conditioning(sk.Conditioning(statistics=sk.Statistics(budget="model"))).init, {
                k: params[k]
            }).summary())
  assert kernel_lines(alone) == {
      "conv1/kernel": "diagonal C, n=25",
      "conv2/kernel": "streaming C Omega, rank 9, n=500, rank 32 asked: cut by the memory rule",
      "dense1/kernel": "streaming C Omega, rank 32, n=800", "dense2/kernel": "diagonal C, n=500"}
  # A narrower dense1 leaves too little for conv2's dense C: conv2 takes its next best option (streaming).
  small = dict(params, dense1={"kernel": jnp.zeros((800, 300)), "bias": jnp.zeros(300)})
  kinds = jax.eval_shape(
      sk.scale_by_sketched_conditioning(sk.Conditioning(statistics=sk.Statistics(budget="model"))).init,
      small).summary()
  assert kinds["conv1/kernel"] == "dense C, full C^(1/2), n=25"
  assert kinds["conv2/kernel"] == kinds["dense2/kernel"] == "streaming C Omega, rank 32, n=500"


def test_model_budget_plans_the_same_layer_of_each_block_alike():
  """Two blocks' identical kernels (64 x 64) beside a wide one (256 x 136) whose leftover pays for one block's
  dense C and full C^{1/2} but not for both: both blocks take the best option the leftover pays for twice (so they
  form one bank, one program), where a kernel-by-kernel rule gave block 0 the dense C and block 1 rank 13. Another
  layer of the same shape is not bound to them: alone it takes the dense C the leftover pays for."""
  params = {"wide": {"kernel": jnp.zeros((256, 136))},
            **{f"block{i}": {"q": {"kernel": jnp.zeros((64, 64))}} for i in range(2)}}
  state = jax.eval_shape(sk.scale_by_sketched_conditioning().init, params)
  kinds = state.summary()
  assert kinds["block0/q/kernel"] == kinds["block1/q/kernel"] == (
      "streaming C Omega, rank 22, n=64, rank 32 asked: cut by the memory rule")
  assert _floats((state.statistics, state.factors)) <= _floats(params)
  # rank 23 for both would not fit beside the wide kernel's plan and the counters (count, key, one per kernel)
  more = jax.eval_shape(
      sk.scale_by_sketched_conditioning(sk.Conditioning(rank=23, statistics=sk.Statistics(kind="streaming"))).init,
      params)
  assert _floats((more.statistics["block0/q/kernel"], more.factors["block0/q/kernel"])) * 2 + _floats(
      (state.statistics["wide/kernel"], state.factors["wide/kernel"])) + 2 + 3 > _floats(params)
  other = dict(params, block1={"k": params["block1"]["q"]})
  kinds = jax.eval_shape(sk.scale_by_sketched_conditioning().init, other).summary()
  assert kinds["block0/q/kernel"] == "dense C, full C^(1/2), n=64", kinds
  assert kinds["block1/k/kernel"] == "streaming C Omega, rank 13, n=64, rank 32 asked: cut by the memory rule", kinds


def test_summary_names_embeddings_custom_statistics_and_the_forced_kinds():
  params = {"embed": {"embedding": jnp.zeros((100, 16))}, "head": {"kernel": jnp.zeros((16, 100))}}
  assert jax.eval_shape(sk.scale_by_sketched_conditioning().init, params).summary() == {
      "embed/embedding": "token frequencies, n=100", "head/kernel": "dense C, full C^(1/2), n=16"}
  custom = sk.scale_by_sketched_conditioning(
      sk.Conditioning(statistics=sk.sketch.ema_correlation(), conditioner=sk.Conditioner(kind="sketched"), rank=4))
  assert jax.eval_shape(custom.init, {"d": {"kernel": jnp.zeros((16, 3))}}).summary() == {
      "d/kernel": "custom statistics, rank 4, n=16"}  # the plan says what was asked for
  forced = sk.scale_by_sketched_conditioning(sk.Conditioning(statistics=sk.Statistics(kind="diagonal")))
  assert jax.eval_shape(forced.init, {"d": {"kernel": jnp.zeros((16, 3))}}).summary() == {"d/kernel": "diagonal C, n=16"}


# ---------------------------------------------------------------- warm start


def _factor_history(tx, n, steps, rng):
  params = {"d": {"kernel": jnp.zeros((n, 3))}}
  state = tx.init(params)
  step = jax.jit(tx.update)
  grads = jax.tree.map(jnp.ones_like, params)
  history = []
  for t in range(steps):
    x = jnp.asarray(rng.standard_normal((8, n)) * (t + 1), jnp.float32)
    _, state = step(grads, state, params, layer_inputs={"d": {"kernel": x}})
    history.append(np.asarray(state.factors["d/kernel"].b_inv))
  return [t for t in range(steps) if t == 0 or not np.allclose(history[t], history[t - 1])]


def test_warm_start_refreshes_after_1_2_4_8_folds_then_every_period():
  rng = np.random.default_rng(3)
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(conditioner=sk.Conditioner(kind="full"),
                      statistics=sk.Statistics(kind="dense", fold_every=1),
                      refresh=sk.Refresh(every=10)))
  assert _factor_history(tx, 4, 25, rng) == [0, 1, 3, 7, 10, 20]
  # the default folds every other step (0, 2, 4, ...): after 1, 2, 4 folds are steps 0, 2, 6
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(conditioner=sk.Conditioner(kind="full"),
                      statistics=sk.Statistics(kind="dense"),
                      refresh=sk.Refresh(every=10)))
  assert _factor_history(tx, 4, 25, rng) == [0, 2, 6, 10, 20]
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(conditioner=sk.Conditioner(kind="full"),
                      statistics=sk.Statistics(kind="dense"),
                      refresh=sk.Refresh(every=10, warm_start=False)))
  assert _factor_history(tx, 4, 25, rng) == [0, 10, 20]


def test_warm_start_conditions_the_first_step_with_the_first_batch():
  """Step 0 uses C = B + (1 - w) (tr B / n) I from the first batch B (the paper's: (1 - w) I + w B), w the
  first fold's weight: 1 - (1 - nu)^2 at the default fold every other step."""
  rng = np.random.default_rng(4)
  n = 5
  x = rng.standard_normal((32, n)) * np.linspace(0.2, 4, n)
  g = rng.standard_normal((n, 2))
  params = {"d": {"kernel": jnp.zeros((n, 2))}}
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(conditioner=sk.Conditioner(kind="full"), statistics=sk.Statistics(kind="dense")))
  u, _ = tx.update({"d": {"kernel": jnp.asarray(g, jnp.float32)}}, tx.init(params), params,
                   layer_inputs={"d": {"kernel": jnp.asarray(x, jnp.float32)}})
  b = x.T @ x / 32
  w, v = np.linalg.eigh(b + 0.95 ** 2 * np.trace(b) / n * np.eye(n))
  np.testing.assert_allclose(u["d"]["kernel"], (v / np.sqrt(w)) @ v.T @ g, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("warm_start,kernels,update_every,statistics_every,expected", [
    (False, 4, 8, 2, {"l0/kernel": [0, 8], "l1/kernel": [2, 10], "l2/kernel": [4, 12], "l3/kernel": [6, 14]}),
    # warm: every kernel also after 1, 2, 4 folds (steps 0, 2, 6), then at its phase
    (True, 4, 8, 2, {"l0/kernel": [0, 2, 6, 8], "l1/kernel": [0, 2, 6, 10], "l2/kernel": [0, 2, 4, 6, 12],
                     "l3/kernel": [0, 2, 6, 14]}),
    # more kernels than steps in the window: two kernels share each phase
    (False, 4, 2, 1, {"l0/kernel": list(range(0, 16, 2)), "l1/kernel": list(range(0, 16, 2)),
                      "l2/kernel": list(range(1, 16, 2)), "l3/kernel": list(range(1, 16, 2))}),
])
def test_staggered_refreshes_spread_kernels_over_the_window(warm_start, kernels, update_every, statistics_every,
                                                            expected):
  """Kernel ``i`` of ``K`` refreshes at steps ``phase_i + j N`` (``phase_i = i N // K``), and, warm, also at the
  warm start's steps; read off the factors that change (each refresh sees newly folded rows)."""
  tx = sk.scale_by_sketched_conditioning(
      sk.Conditioning(statistics=sk.Statistics(kind="dense", fold_every=statistics_every),
                      conditioner=sk.Conditioner(kind="full"),
                      refresh=sk.Refresh(every=update_every, warm_start=warm_start)))
  params = {f"l{i}": {"kernel": jnp.zeros((3, 4))} for i in range(kernels)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  grads = jax.tree.map(jnp.ones_like, params)
  rng = np.random.default_rng(5)
  refreshed = {p: [] for p in state.factors}
  for t in range(16):
    li = {f"l{i}": {"kernel": jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)} for i in range(kernels)}
    _, new = step(grads, state, params, layer_inputs=li)
    for p in refreshed:
      if not np.allclose(new.factors[p].b_inv, state.factors[p].b_inv):
        refreshed[p].append(t)
    state = new
  assert refreshed == expected


# ---------------------------------------------------------------- outliers


def _least_squares_run(outlier_scale, steps=400, seed=6):
  """Linear regression with scaled inputs; at step 50, 4 of 64 rows of the captured inputs are multiplied by outlier_scale."""
  rng = np.random.default_rng(seed)
  n, p = 16, 4
  scales = np.logspace(-1, 1, n)
  w_true = rng.standard_normal((n, p))
  tx = sk.scsgd(0.05, sk.Conditioning(statistics=sk.Statistics(kind="dense"), conditioner=sk.Conditioner(kind="full")))
  params = {"d": {"kernel": jnp.zeros((n, p))}}
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y, x_stats):
    loss, g = jax.value_and_grad(lambda q: jnp.mean((x @ q["d"]["kernel"] - y) ** 2))(params)
    u, state = tx.update(g, state, params, layer_inputs={"d": {"kernel": x_stats}})
    return optax.apply_updates(params, u), state, loss

  losses = []
  for t in range(steps):
    x = rng.standard_normal((64, n)) * scales
    y = x @ w_true
    x_stats = x.copy()
    if t == 50 and outlier_scale:
      x_stats[:4] = outlier_scale
    params, state, loss = step(params, state, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
                               jnp.asarray(x_stats, jnp.float32))
    losses.append(float(loss))
  return np.array(losses), state


@pytest.mark.parametrize("scale", [1e6, 1e18])
def test_outlier_rows_are_clipped_counted_and_training_recovers(scale):
  clean, _ = _least_squares_run(None)
  hit, state = _least_squares_run(scale)
  assert int(state[0].clipped_rows["d/kernel"]) == 4
  assert np.isfinite(hit).all()
  trace = float(sk.sketch.ema_correlation().trace(state[0].statistics["d/kernel"]))
  assert trace < 1e4  # tr C of the clean data is sum(scales^2) ~ 216: the outlier did not blow it up
  assert hit[-50:].mean() < 2 * clean[-50:].mean() + 1e-6


def test_guard_clips_rows_above_threshold_times_reference():
  rows = jnp.asarray(np.r_[np.ones((6, 4)), np.full((2, 4), 100.0)], jnp.float32)
  clipped, count = fold.guard_rows(rows, jnp.asarray(4.0), 100.0)
  assert int(count) == 2
  np.testing.assert_allclose(np.sum(np.asarray(clipped[6:]) ** 2, axis=1), 400.0, rtol=1e-5)
  np.testing.assert_array_equal(clipped[:6], rows[:6])
  # no reference yet (warm start, first batch): the batch median is the reference
  clipped, count = fold.guard_rows(rows, jnp.asarray(0.0), 100.0)
  assert int(count) == 2


@pytest.mark.parametrize("scale,reference", [(1.0, 30.0), (1e19, 3e37), (1e-18, 3e-35)])
def test_guard_clips_to_the_bound_at_any_scale(scale, reference):
  """Against float64: rows over ``sqrt(threshold * reference)`` come back with exactly that norm, the others
  unchanged, also where float32's squared norms overflow (1e19) or lose precision (1e-18) and the norms
  are taken again with a per-row rescale."""
  rows64 = np.r_[np.ones((6, 4)), np.full((2, 4), 100.0)] * scale
  rows = jnp.asarray(rows64, jnp.float32)
  clipped, count = fold.guard_rows(rows, jnp.asarray(reference, jnp.float32), 100.0)
  bound = np.sqrt(100.0 * np.float64(np.float32(reference)))
  norms = np.linalg.norm(np.asarray(rows, np.float64), axis=1)
  expected = np.asarray(rows, np.float64) * np.where(norms > bound, bound / norms, 1.0)[:, None]
  assert int(count) == 2
  np.testing.assert_allclose(np.asarray(clipped, np.float64), expected, rtol=1e-5, atol=0)
  assert np.all(np.isfinite(np.asarray(clipped)))


@pytest.mark.parametrize("odd_row", [0.0, 1e-21, 1e20])
@pytest.mark.parametrize("reference", [30.0, 0.0])
def test_guard_matches_float64_with_zero_tiny_or_huge_rows_among_ordinary_ones(odd_row, reference):
  """One zero, subnormal-squared or overflowing row in a batch of ordinary ones: the clipped rows against
  float64, with the running reference and with none (the batch's median squared norm)."""
  rows64 = np.r_[np.random.default_rng(0).standard_normal((7, 5)), np.full((1, 5), odd_row), np.full((2, 5), 60.0)]
  rows = jnp.asarray(rows64, jnp.float32)
  clipped, count = fold.guard_rows(rows, jnp.asarray(reference, jnp.float32), 100.0)
  norms = np.linalg.norm(np.asarray(rows, np.float64), axis=1)
  ref = reference if reference > 0 else np.median(norms ** 2)
  bound = np.sqrt(100.0 * ref)
  expected = np.asarray(rows, np.float64) * np.where(norms > bound, bound / np.maximum(norms, 1e-300), 1.0)[:, None]
  assert int(count) == int(np.sum(norms > bound)) >= 2
  np.testing.assert_allclose(np.asarray(clipped, np.float64), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("warm_start", [False, True])
def test_state_can_be_donated(warm_start):
  """No buffer appears twice in the state (the paper-mode streaming state once held Omega twice)."""
  tx = sk.scsgd(
      0.1, sk.Conditioning(statistics=sk.Statistics(kind="streaming"),
                           refresh=sk.Refresh(warm_start=warm_start),
                           rank=2))
  params = {"d": {"kernel": jnp.zeros((12, 3))}}
  state = tx.init(params)
  step = jax.jit(lambda g, s, li: tx.update(g, s, params, layer_inputs=li), donate_argnums=(1,))
  li = {"d": {"kernel": jnp.ones((4, 12))}}
  for _ in range(2):
    _, state = step(jax.tree.map(jnp.ones_like, params), state, li)
  assert np.all(np.isfinite(np.asarray(state[0].statistics["d/kernel"].ema.moments[0])))
