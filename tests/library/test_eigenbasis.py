"""Adam in the sketched conditioner's eigenbasis (scale_by_eigenbasis_adam / scsgd_eigen) against dense numpy:
the full eigenbasis (k = n) of the inputs' C or of the gradient's Gram matrix, the sketched one with each tail
(Adafactor's, a scalar, orthogonalized), the carry at a refresh, Adam on the other leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import scsgd_jax as sk
from scsgd_jax._src import eigen_math as em
from tests import helpers

B1, B2, EPS = 0.9, 0.99, 1e-8
# C of the latest batch alone (rate 1), folded and refreshed at every step from step 0, no floor, no guard
EXACT = dict(statistics="dense", ema_rate=1.0, statistics_every=1, update_every=1, warm_start=False,
             outlier_threshold=float("inf"))


def _batches(rng, steps, n=6, p=3, m=40):
  scales = np.linspace(0.5, 3.0, n)
  return [(rng.standard_normal((m, n)) * scales, rng.standard_normal((n, p))) for _ in range(steps)]


def _run(tx, batches, n=6, p=3):
  params = {"dense": {"kernel": jnp.zeros((n, p)), "bias": jnp.zeros(p)}}
  state, outs = tx.init(params), []
  for x, g in batches:
    grads = {"dense": {"kernel": jnp.asarray(g, jnp.float32), "bias": jnp.asarray(g[0], jnp.float32)}}
    u, state = jax.jit(tx.update)(grads, state, params, layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
    outs.append(jax.tree.map(np.asarray, u))
  return outs, state


def _carry(v, new, old, tail_col=None):
  p = (new.T @ old) ** 2
  v = p @ v
  if tail_col is not None:
    v = v + np.clip(1 - p.sum(1), 0, 1)[:, None] * tail_col
  return v


def test_full_rank_equals_adam_in_the_full_eigenbasis_of_c():
  """k = n: Adam's second moment kept for U^T G with U the eigenvectors of each step's C (numpy eigh), carried
  into each new basis by (U_new^T U_old)^2, the first moment rotated: three steps, every update equal."""
  rng = np.random.default_rng(0)
  batches = _batches(rng, 3)
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(conditioner="full", **EXACT), b1=B1, b2=B2, eps=EPS)
  outs, _ = _run(tx, batches)
  m = v = np.zeros((6, 3))
  u_old = np.eye(6)
  for t, ((x, g), out) in enumerate(zip(batches, outs), start=1):
    _, u = np.linalg.eigh(x.T @ x / len(x))
    v = _carry(v, u, u_old)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * (u.T @ g) ** 2
    c = helpers.adam_ratio_bound(B1, B2, t)
    want = u @ helpers.adam_ratio(u.T @ m / (1 - B1 ** t), v / (1 - B2 ** t), EPS, c)
    np.testing.assert_allclose(out["dense"]["kernel"], want, rtol=2e-4, atol=1e-6)
    u_old = u


def test_full_rank_gradient_basis_equals_adam_in_the_eigenbasis_of_the_gradients_gram():
  """basis='gradients', k = n: U the eigenvectors of each step's G G^T (SOAP's left factor, numpy eigh), with no
  layer inputs given; Adam in U's coordinates as above, in SOAP's order: each step in the basis before its own
  gradient joined the statistics, the moments carried into the new basis after it; three steps."""
  rng = np.random.default_rng(7)
  n, p = 4, 6
  gs = [rng.standard_normal((n, p)) * np.linspace(0.5, 3.0, n)[:, None] for _ in range(3)]
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(conditioner="full", **EXACT),
                                   b1=B1,
                                   b2=B2,
                                   eps=EPS,
                                   basis="gradients")
  params = {"dense": {"kernel": jnp.zeros((n, p))}}
  state = tx.init(params)
  m = v = np.zeros((n, p))
  u_old = np.eye(n)
  for t, g in enumerate(gs, start=1):
    out, state = jax.jit(tx.update)({"dense": {"kernel": jnp.asarray(g, jnp.float32)}}, state, params)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * (u_old.T @ g) ** 2
    want = u_old @ helpers.adam_ratio(u_old.T @ m / (1 - B1 ** t), v / (1 - B2 ** t), EPS,
                                      helpers.adam_ratio_bound(B1, B2, t))
    np.testing.assert_allclose(out["dense"]["kernel"], want, rtol=2e-4, atol=1e-6)
    _, u = np.linalg.eigh(g @ g.T / p)
    v = _carry(v, u, u_old)
    u_old = u


def _carry_both(v, new, old, new_out, old_out, tail_mean=None):
  p, p_out = (new.T @ old) ** 2, (new_out.T @ old_out) ** 2
  lead = p @ v @ p_out.T
  if tail_mean is not None:
    lead = lead + np.clip(1 - np.outer(p.sum(1), p_out.sum(1)), 0, 1) * tail_mean
  return lead


# both sides' bases from an EMA (rate 1/2 from C_0 = I): with the latest gradient's alone, U^T G U_out would be
# its diagonal of singular values and Adam's off-diagonal ratios float32 round-off over round-off
AVERAGED = {**EXACT, "ema_rate": 0.5}


def test_both_sides_at_full_rank_is_soap():
  """sides='both', k = n and k = p: Adam's second moment kept for U^T G U_out with U, U_out the eigenvectors of
  the EMAs of G G^T / p and G^T G / n (SOAP, numpy eigh), in SOAP's order (the step in the bases before its
  gradient joined them), carried by both sides' overlaps, three steps."""
  rng = np.random.default_rng(9)
  n = p = 5
  gs = [rng.standard_normal((n, p)) * np.linspace(0.5, 3.0, n)[:, None] for _ in range(3)]
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(conditioner="full", **AVERAGED),
                                   b1=B1,
                                   b2=B2,
                                   eps=EPS,
                                   basis="gradients",
                                   sides="both")
  left, right = np.eye(n), np.eye(p)
  params = {"dense": {"kernel": jnp.zeros((n, p))}}
  state = tx.init(params)
  m, v = np.zeros((n, p)), np.zeros((n, p))
  u_old, w_old = np.eye(n), np.eye(p)
  for t, g in enumerate(gs, start=1):
    out, state = jax.jit(tx.update)({"dense": {"kernel": jnp.asarray(g, jnp.float32)}}, state, params)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * (u_old.T @ g @ w_old) ** 2
    want = u_old @ helpers.adam_ratio(u_old.T @ m @ w_old / (1 - B1 ** t), v / (1 - B2 ** t), EPS,
                                      helpers.adam_ratio_bound(B1, B2, t)) @ w_old.T
    np.testing.assert_allclose(out["dense"]["kernel"], want, rtol=2e-3, atol=1e-5)
    left, right = 0.5 * left + 0.5 * g @ g.T / p, 0.5 * right + 0.5 * g.T @ g / n
    u, w = np.linalg.eigh(left)[1], np.linalg.eigh(right)[1]
    v = _carry_both(v, u, u_old, w, w_old)
    u_old, w_old = u, w


def test_both_sides_of_the_captured_rows_at_full_rank_is_ekfac():
  """sides='both' with the inputs' basis, k = n and k = p: U, U_out the eigenvectors of each step's C = X^T X / m
  and Delta = D^T D / m of the captured output-gradient rows (EKFAC's two factors, numpy eigh); Adam's second
  moment kept for U^T G U_out, the step in the bases refreshed with its own rows (the inputs' order), the
  moments carried by both overlaps first; three steps."""
  rng = np.random.default_rng(12)
  n, p, m_rows = 5, 4, 40
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(conditioner="full", **EXACT),
                                   b1=B1,
                                   b2=B2,
                                   eps=EPS,
                                   sides="both")
  params = {"dense": {"kernel": jnp.zeros((n, p))}}
  state = tx.init(params)
  m, v = np.zeros((n, p)), np.zeros((n, p))
  u_old, w_old = np.eye(n), np.eye(p)
  for t in range(1, 4):
    x = rng.standard_normal((m_rows, n)) * np.linspace(0.5, 3.0, n)
    d = rng.standard_normal((m_rows, p)) * np.linspace(2.0, 0.3, p)
    g = x.T @ d / m_rows
    out, state = jax.jit(tx.update)({"dense": {"kernel": jnp.asarray(g, jnp.float32)}}, state, params,
                                    layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}},
                                    output_grads={"dense": {"kernel": jnp.asarray(d, jnp.float32)}})
    u, w = np.linalg.eigh(x.T @ x / m_rows)[1], np.linalg.eigh(d.T @ d / m_rows)[1]
    v = _carry_both(v, u, u_old, w, w_old)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * (u.T @ g @ w) ** 2
    want = u @ helpers.adam_ratio(u.T @ m @ w / (1 - B1 ** t), v / (1 - B2 ** t), EPS,
                                  helpers.adam_ratio_bound(B1, B2, t)) @ w.T
    np.testing.assert_allclose(out["dense"]["kernel"], want, rtol=2e-3, atol=1e-5)
    u_old, w_old = u, w


def test_both_sides_sketched_with_the_scalar_tail_equals_numpy():
  """sides='both', k = 2 on each side: U = Q V, U_out = Q_out V_out from the state's factors; Adam on the k x k
  block U^T G U_out in the bases before the step, the rest of G (the tail) scaled by one scalar second moment;
  then carried by both overlaps into the refreshed bases."""
  rng = np.random.default_rng(10)
  n, p = 6, 5
  gs = [rng.standard_normal((n, p)) * np.linspace(0.5, 3.0, n)[:, None] for _ in range(3)]
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(rank=2, conditioner="sketched", **AVERAGED),
                                   b1=B1,
                                   b2=B2,
                                   eps=EPS,
                                   basis="gradients",
                                   sides="both",
                                   tail="scalar")
  params = {"dense": {"kernel": jnp.zeros((n, p))}}
  state = tx.init(params)
  m, lead, col = np.zeros((n, p)), np.zeros((2, 2)), 0.0

  def bases(state):
    out = []
    for side in (state.conditioning, state.output):
      q, b_inv, _ = (np.asarray(a, np.float64) for a in side.factors["dense/kernel"])
      out.append(q @ np.linalg.eigh(b_inv)[1])
    return out

  u, w = bases(state)
  for t, g in enumerate(gs, start=1):
    out, state = jax.jit(tx.update)({"dense": {"kernel": jnp.asarray(g, jnp.float32)}}, state, params)
    m = B1 * m + (1 - B1) * g
    gt = g - u @ (u.T @ g @ w) @ w.T
    lead = B2 * lead + (1 - B2) * (u.T @ g @ w) ** 2
    col = B2 * col + (1 - B2) * (gt ** 2).mean()
    m_hat, c2 = m / (1 - B1 ** t), 1 - B2 ** t
    core = u.T @ m_hat @ w
    c = helpers.adam_ratio_bound(B1, B2, t)
    tail_step = helpers.capped((m_hat - u @ core @ w.T) / (np.sqrt(col / c2) + EPS), c * (np.sqrt(n * p) - 2))
    want = u @ helpers.adam_ratio(core, lead / c2, EPS, c) @ w.T + tail_step
    np.testing.assert_allclose(out["dense"]["kernel"], want, rtol=2e-3, atol=1e-5)
    u_new, w_new = bases(state)
    lead = _carry_both(lead, u_new, u, w_new, w, col)
    u, w = u_new, w_new


def test_both_sides_leave_a_stacked_kernel_to_its_input_side_and_the_inputs_basis_needs_output_grads():
  """A stacked kernel is rotated on its input side alone under sides='both': its updates equal sides='input''s;
  sides='both' with the inputs' basis and no captured output gradients is refused, naming what it needs."""
  rng = np.random.default_rng(11)
  n, p = 6, 3
  make = lambda sides: sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(
      rank=2, input_axes={"dense/kernel": sk.Layout((0,), stack=1)}, conditioner="sketched", **EXACT),
                                                   basis="gradients",
                                                   sides=sides)
  params = {"dense": {"kernel": jnp.zeros((2, n, p))}}
  txs = [make("both"), make("input")]
  states = [tx.init(params) for tx in txs]
  assert states[0].output_rotations == {} and states[1].output is None
  assert states[0].output.statistics == {} and states[0].output.factors == {}  # no output side it never reads
  for _ in range(2):
    g = {"dense": {"kernel": jnp.asarray(rng.standard_normal((2, n, p)), jnp.float32)}}
    outs = []
    for i, tx in enumerate(txs):
      o, states[i] = tx.update(g, states[i], params)
      outs.append(o["dense"]["kernel"])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-7)
  tx = sk.scale_by_eigenbasis_adam(sides="both")  # the inputs' basis: the output side reads captured rows
  params = {"dense": {"kernel": jnp.zeros((n, p))}}
  with pytest.raises(ValueError, match="output_grads"):
    tx.update({"dense": {"kernel": jnp.ones((n, p))}}, tx.init(params), params,
              layer_inputs={"dense": {"kernel": jnp.ones((4, n))}})


def test_both_sides_keep_output_statistics_only_for_the_kernels_they_rotate_on_both_sides():
  """In a tree with a stacked kernel and a kernel ``kernel_filter`` leaves to Adam beside a plain one, the output
  side keeps statistics for the plain kernel alone, and the plain kernel's updates equal those of sides='both' on
  it alone (SOAP at full rank, tested against numpy above)."""
  rng = np.random.default_rng(12)
  n, p = 6, 3
  make = lambda axes={
      "stack/kernel": sk.Layout((0,), stack=1)
  }: sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(input_axes=axes,
                                                           kernel_filter=lambda path, leaf: path.endswith("kernel") and
                                                           not path.startswith("head"),
                                                           conditioner="full",
                                                           **EXACT),
                                 basis="gradients",
                                 sides="both")
  params = {"plain": {"kernel": jnp.zeros((n, p))}, "stack": {"kernel": jnp.zeros((2, n, p))},
            "head": {"kernel": jnp.zeros((p, n))}}
  alone = {"plain": params["plain"]}
  tx, tx_alone = make(), make({})  # input_axes names only the parameters of its tree
  state, state_alone = tx.init(params), tx_alone.init(alone)
  assert set(state.output.statistics) == set(state.output.factors) == {"plain/kernel"}
  assert set(state.conditioning.factors) == {"plain/kernel", "stack/kernel"}
  assert "input side alone" in dict(state.output.plan.items)["stack/kernel"]
  for _ in range(3):
    g = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
    out, state = tx.update(g, state, params)
    out_alone, state_alone = tx_alone.update({"plain": g["plain"]}, state_alone, alone)
    np.testing.assert_allclose(out["plain"]["kernel"], out_alone["plain"]["kernel"], rtol=1e-5, atol=1e-7)
  assert set(state.output_rotations) == {"plain/kernel"}


def test_both_sides_memory_rule_pools_only_the_kernels_rotated_on_both_sides():
  """Under the memory rule pooled over the model, a stacked kernel (rotated on its input side alone) lends the
  output side no memory: the plain kernel's output plan is the one it gets alone, and the stack has none."""
  make = lambda axes={
      "stack/kernel": sk.Layout((0,), stack=1)
  }: sk.scale_by_eigenbasis_adam(
      sk.Conditioning(statistics=sk.Statistics(budget="model"), input_axes=axes), basis="gradients", sides="both")
  mixed = {"plain": {"kernel": jnp.zeros((96, 64))}, "stack": {"kernel": jnp.zeros((4, 96, 64))}}
  got = dict(make().init(mixed).output.plan.items)
  alone = dict(make({}).init({"plain": mixed["plain"]}).output.plan.items)  # input_axes names its tree's parameters
  assert got["plain/kernel"] == alone["plain/kernel"], (got, alone)
  assert "input side alone" in got["stack/kernel"]


def test_orthogonalize_is_the_newton_schulz_iteration_and_keeps_the_column_space():
  """orthogonalize equals the iteration by hand; its singular values land near 1 (Muon's quintic: in [0.6, 1.25]);
  a matrix confined to a subspace (a tail, (I - U U^T) M) stays in it."""
  from scsgd_jax._src import eigen_math as eb
  rng = np.random.default_rng(8)
  for shape in ((6, 3), (3, 6)):
    x = rng.standard_normal(shape)
    got = np.asarray(eb.orthogonalize(jnp.asarray(x, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, helpers.newton_schulz(x), rtol=1e-3, atol=1e-5)
    sv = np.linalg.svd(got, compute_uv=False)
    assert sv.min() > 0.6 and sv.max() < 1.25, sv
  u = np.linalg.qr(rng.standard_normal((6, 2)))[0]
  tail = (np.eye(6) - u @ u.T) @ rng.standard_normal((6, 3))
  got = np.asarray(eb.orthogonalize(jnp.asarray(tail, jnp.float32)), np.float64)
  np.testing.assert_allclose(u.T @ got, 0.0, atol=1e-5)


@pytest.mark.parametrize("tail", ["factored", "scalar", "orthogonal"])
def test_sketched_basis_with_its_tail_equals_numpy(tail):
  """k < n: U = Q V from the state's factor, Adam in U's coordinates, the tail G - U U^T G scaled by Adafactor's
  factored moments (or one scalar), or its first moment orthogonalized at 0.2 sqrt(max(n, p)) (COSMOS's split,
  no state); the moments carried at each refresh with the tail's share (an orthogonalized tail: the old lead's
  mean per column)."""
  rng = np.random.default_rng(1)
  batches = _batches(rng, 3)
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(rank=2, conditioner="sketched", **EXACT),
                                   b1=B1,
                                   b2=B2,
                                   eps=EPS,
                                   tail=tail)
  params = {"dense": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(3)}}
  state = tx.init(params)
  m = np.zeros((6, 3))
  lead, row, col = np.zeros((2, 3)), np.zeros(6), np.zeros(3) if tail == "factored" else 0.0
  u_old = np.eye(6, 2)
  for t, (x, g) in enumerate(batches, start=1):
    grads = {"dense": {"kernel": jnp.asarray(g, jnp.float32), "bias": jnp.zeros(3)}}
    out, state = jax.jit(tx.update)(grads, state, params,
                                    layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
    q, b_inv, _ = (np.asarray(a, np.float64) for a in state.conditioning.factors["dense/kernel"])
    u = q @ np.linalg.eigh(b_inv)[1]
    np.testing.assert_allclose(np.abs(u.T @ np.asarray(sk.sketch.eigenbasis(state.conditioning.factors["dense/kernel"]))),
                               np.eye(2), atol=1e-4)
    lead = _carry(lead, u, u_old, lead.mean(0) if tail == "orthogonal" else col)
    m = B1 * m + (1 - B1) * g
    gl = u.T @ g
    gt = g - u @ gl
    lead = B2 * lead + (1 - B2) * gl ** 2
    if tail == "factored":
      row, col = B2 * row + (1 - B2) * (gt ** 2).mean(1), B2 * col + (1 - B2) * (gt ** 2).mean(0)
      v_tail = np.outer(row, col) / row.mean()
    elif tail == "scalar":
      col = B2 * col + (1 - B2) * (gt ** 2).mean()
      v_tail = col
    m_hat, c2 = m / (1 - B1 ** t), 1 - B2 ** t
    ml = u.T @ m_hat
    c = helpers.adam_ratio_bound(B1, B2, t)
    want, limit = u @ helpers.adam_ratio(ml, lead / c2, EPS, c), c * (np.sqrt(6 * 3) - np.sqrt(2 * 3))
    if tail == "orthogonal":
      want = want + helpers.capped(0.2 * np.sqrt(6) * helpers.newton_schulz(m_hat - u @ ml), limit)
      assert state.moments["dense/kernel"].row is None and state.moments["dense/kernel"].col is None
    else:
      want = want + helpers.capped((m_hat - u @ ml) / (np.sqrt(v_tail / c2) + EPS), limit)
    np.testing.assert_allclose(out["dense"]["kernel"], want, rtol=2e-3, atol=1e-5)
    u_old = u


@pytest.mark.parametrize("basis", ["inputs", "gradients"])
def test_directions_outside_the_inputs_span_do_not_move(basis, monkeypatch):
  """A gradient's rows lie in its inputs' span (G = X^T dY); C's eigenbasis is arbitrary in the null space, where
  U^T G holds float32 round-off alone. Adam would scale that round-off to a step of the rate (a dead ReLU unit's
  row moving at random), and Muon's orthogonalization after it to a full one; each rotated coordinate's step
  weighted by 1 / (1 + (f / v)^2), f = 2^-30 its column's sum, keeps the step in the span: the part of the update
  outside it (numpy's projector) under 1e-5 of the update for the eigenbasis and 1e-4 in front of Muon (Muon's
  own: 1e-5), against order 1 without the weight (the inputs' basis). Two inputs always 0 (dead units) keep
  their rows still alike."""
  rng = np.random.default_rng(3)
  n, p, m = 12, 8, 3
  x = rng.standard_normal((m, n)) * 10.0
  x[:, [2, 7]] = 0.0  # dead units
  outside = np.eye(n) - x.T @ np.linalg.pinv(x.T)
  batches = [(x, x.T @ rng.standard_normal((m, p))) for _ in range(3)]
  c = sk.Conditioning.from_flat(conditioner="full", **EXACT)

  def leak(make, floor):
    monkeypatch.setattr(em, "_ROUND_OFF", floor)
    u = _run(make(), batches, n=n, p=p)[0][-1]["dense"]["kernel"]
    return max(np.linalg.norm(outside @ u) / np.linalg.norm(u), np.abs(u[[2, 7]]).max() / np.abs(u).max())

  eigen = lambda: sk.scale_by_eigenbasis_adam(c, b1=B1, b2=B2, eps=EPS, basis=basis)
  eigen_muon = lambda: sk.scsgd_eigen_muon(1.0, c) if basis == "inputs" else None
  assert leak(eigen, 2.0**-15) < 1e-5
  if basis == "inputs":  # without the weight, the round-off Adam scales up (the gradients' Gram holds less here)
    assert leak(eigen_muon, 2.0**-15) < 1e-4
    assert min(leak(eigen, 0.0), leak(eigen_muon, 0.0)) > 0.1


@pytest.mark.parametrize("basis", ["inputs", "gradients"])
def test_other_leaves_and_embeddings_get_adam_itself(basis):
  """A bias and an embedding (a diagonal kind: the coordinate basis) are updated exactly as optax.adam's, with
  either basis."""
  rng = np.random.default_rng(2)
  params = {"embed": {"embedding": jnp.zeros((7, 4))}, "dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)}}
  tx = sk.scsgd_eigen(1e-2, b1=B1, b2=B2, eps=EPS, basis=basis)
  ref = optax.adam(1e-2, b1=B1, b2=B2, eps=EPS)
  state, ref_state = tx.init(params), ref.init(params)
  for _ in range(3):
    grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
    inputs = {"embed": {"embedding": jnp.asarray(rng.integers(0, 7, (5,)))},
              "dense": {"kernel": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)}}
    out, state = tx.update(grads, state, params, layer_inputs=inputs)
    want, ref_state = ref.update(grads, ref_state, params)
    for path in (("embed", "embedding"), ("dense", "bias")):
      np.testing.assert_allclose(out[path[0]][path[1]], want[path[0]][path[1]], rtol=1e-5, atol=1e-8)
  assert "token frequencies" in state[0].summary()["embed/embedding"]


@pytest.mark.parametrize("basis", ["inputs", "gradients"])
def test_stacked_kernel_equals_each_slice_alone(basis):
  """A stack of two kernels (leading layer axis, Layout(stack=1)): each slice's update equals the same
  transformation on that slice alone, with the basis of the inputs or of each slice's own gradient rows."""
  rng = np.random.default_rng(3)
  n, p = 6, 3
  xs = [rng.standard_normal((2, 20, n)) * np.linspace(0.5, 3, n) for _ in range(2)]
  gs = [rng.standard_normal((2, n, p)) for _ in range(2)]
  make = lambda axes: sk.scale_by_eigenbasis_adam(
      sk.Conditioning.from_flat(rank=2, input_axes=axes, conditioner="sketched", **EXACT), basis=basis)
  stacked = make({"dense/kernel": sk.Layout((0,), stack=1)})
  params = {"dense": {"kernel": jnp.zeros((2, n, p))}}
  state = stacked.init(params)
  alone = [make(None) for _ in range(2)]
  alone_states = [tx.init({"dense": {"kernel": jnp.zeros((n, p))}}) for tx in alone]
  for x, g in zip(xs, gs):
    out, state = stacked.update({"dense": {"kernel": jnp.asarray(g, jnp.float32)}}, state, params,
                                layer_inputs={"dense": {"kernel": jnp.asarray(x, jnp.float32)}})
    for i in range(2):
      want, alone_states[i] = alone[i].update({"dense": {"kernel": jnp.asarray(g[i], jnp.float32)}}, alone_states[i],
                                              layer_inputs={"dense": {"kernel": jnp.asarray(x[i], jnp.float32)}})
      np.testing.assert_allclose(out["dense"]["kernel"][i], want["dense"]["kernel"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("basis", ["inputs", "gradients"])
def test_a_bank_of_alike_kernels_equals_each_kernel_alone(basis, monkeypatch):
  """Kernels alike (three layers of one shape, a second stack of two beside a first) keep their moments and
  rotations in one bank and take their step as one computation over it: with staggered refreshes (each member's
  basis moving at its own steps), every update, moment and rotation equals the same transformation's with every
  kernel in a bank of its own."""
  rng = np.random.default_rng(11)
  n, p = 6, 3
  names = ("a", "b", "c", "d")
  params = {**{k: {"kernel": jnp.zeros((n, p))} for k in names[:3]}, "d": {"kernel": jnp.zeros((n, 2 * p))},
            "s": {"kernel": jnp.zeros((2, n, p))}, "t": {"kernel": jnp.zeros((2, n, p))}}
  axes = {"s/kernel": sk.Layout((0,), stack=1), "t/kernel": sk.Layout((0,), stack=1)}
  # 8 slices over 4 steps: a, b refresh at 0, 4; c, d at 1, 5; s at 2, 6; t at 3, 7
  c = sk.Conditioning.from_flat(rank=2, input_axes=axes, conditioner="sketched",
                                **{**EXACT, "update_every": 4, "stagger": True})
  make = lambda: sk.scale_by_eigenbasis_adam(c, b1=B1, b2=B2, eps=EPS, basis=basis)
  batches = []
  for _ in range(8):
    rows = {k: rng.standard_normal((20, n)) * np.linspace(0.5, 3, n) for k in names}
    rows.update({k: rng.standard_normal((2, 20, n)) * np.linspace(0.5, 3, n) for k in "st"})
    grads = jax.tree.map(lambda x: rng.standard_normal(x.shape), params)
    batches.append((jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), grads),
                    {k: {"kernel": jnp.asarray(x, jnp.float32)} for k, x in rows.items()}))

  def run(tx):
    state, outs = tx.init(params), []
    for grads, rows in batches:
      out, state = jax.jit(tx.update)(grads, state, params, layer_inputs=rows)
      outs.append(out)
    return outs, state

  banked, banked_state = run(make())
  assert [b.paths for b in banked_state.moments.index.banks] == [
      ("a/kernel", "b/kernel", "c/kernel"), ("d/kernel",), ("s/kernel", "t/kernel")]
  monkeypatch.setattr(sk._src.eigen_banks, "index",
                      lambda tree, plans, two: sk._src.banks.BankIndex.of(plans, lambda path: path))
  alone, alone_state = run(make())
  assert len(alone_state.moments.index.banks) == 6
  # atol: a kernel's first steps before its first refresh are in init's coordinate basis, where the factored tail's
  # rows inside it hold round-off alone (over their floor, 1e-3 of the rows' scale, it steps by about 1e-4)
  for got, want in zip(banked, alone):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-4), got, want)
  for path in alone_state.moments:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 (banked_state.moments[path], banked_state.rotations[path]),
                 (alone_state.moments[path], alone_state.rotations[path]))


def test_state_serializes_and_stays_within_adams_floats():
  """flax.serialization round trip into a fresh init; with the default half budget the state of a wide layer
  holds fewer floats than Adam's two per parameter."""
  rng = np.random.default_rng(4)
  params = {"dense": {"kernel": jnp.zeros((256, 128)), "bias": jnp.zeros(128)}}
  tx = sk.scsgd_eigen(1e-3)
  state = tx.init(params)
  grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
  _, state = jax.jit(tx.update)(grads, state, params,
                                layer_inputs={"dense": {"kernel": jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)}})
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  floats = sum(a.size for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating))
  assert floats <= 2 * sum(a.size for a in jax.tree.leaves(params)), floats


def test_a_state_of_moments_per_kernel_is_refused_naming_the_field():
  """The state before banks kept ``{kernel path: EigenMoments}`` dicts: refused at the first update, naming
  ``state.moments`` and how to restore."""
  params = {"a": {"kernel": jnp.zeros((6, 3))}, "b": {"kernel": jnp.zeros((6, 3))}}
  tx = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(rank=2, conditioner="sketched", **EXACT))
  state = tx.init(params)
  assert [b.paths for b in state.moments.index.banks] == [("a/kernel", "b/kernel")]
  old = state._replace(moments=dict(state.moments.items()))
  rows = {k: {"kernel": jnp.ones((4, 6))} for k in "ab"}
  with pytest.raises(TypeError, match=r"state\.moments is a dict, not the banks"):
    tx.update(jax.tree.map(jnp.ones_like, params), old, params, layer_inputs=rows)


def test_bad_tail_is_refused():
  with pytest.raises(ValueError, match="tail must be 'factored', 'scalar' or 'orthogonal'"):
    sk.scale_by_eigenbasis_adam(tail="adafactor")
  with pytest.raises(ValueError, match="basis must be 'inputs' or 'gradients'"):
    sk.scale_by_eigenbasis_adam(basis="outputs")
  with pytest.raises(TypeError, match="scale_by_eigenbasis_adam"):
    sk.scale_by_eigenbasis_adam(momentum=0.9)
  with pytest.raises(ValueError, match="memory_share"):
    sk.scale_by_eigenbasis_adam(memory_share=0.0)
  with pytest.raises(TypeError, match="budget_share"):  # its meaning changed: memory_share counts the whole state
    sk.scale_by_eigenbasis_adam(budget_share=0.5)


@pytest.mark.parametrize("kw", [dict(conditioner="full"), dict(conditioner="sketched", rank=2),
                                dict(statistics="diagonal")])
def test_kernel_diagnostics_equal_the_dense_inverse_spectrum(kw):
  """kernel_diagnostics' extreme eigenvalues and tail are those of the dense A^{-1} (inverse_matrix) of the state's
  factor, for the full, sketched and diagonal conditioners, read through the scsgd_eigen state too."""
  kw = {**EXACT, **kw}
  rank = kw.pop("rank", None)
  rng = np.random.default_rng(5)
  outs = []
  for tx in (sk.scsgd(0.1, sk.Conditioning.from_flat(rank=rank, **kw)),
             sk.scsgd_eigen(1e-3, sk.Conditioning.from_flat(rank=rank, **kw))):
    _, state = _run(tx, _batches(rng, 2))
    diag = sk.kernel_diagnostics(state)["dense/kernel"]
    factor = (state[0].conditioning if hasattr(state[0], "conditioning") else state[0]).factors["dense/kernel"]
    evals = np.linalg.eigvalsh(np.asarray(sk.sketch.inverse_matrix(factor), np.float64))
    np.testing.assert_allclose([diag["inverse_max"], diag["inverse_min"]], [evals[-1], evals[0]], rtol=1e-4)
    np.testing.assert_allclose(diag["spread"], evals[-1] / evals[0], rtol=1e-3)
    assert (float(diag["tail_inverse"]) > 0) == (rank is not None)
    outs.append(evals)
  assert outs[0][-1] / outs[0][0] > 2.0  # the data's scales spread the conditioner: not the identity's 1


def test_others_identity_passes_unconditioned_leaves_through_without_state():
  """others='identity': the bias leaves unchanged and holds no moments; the kernel's update is the default's."""
  rng = np.random.default_rng(6)
  batches = _batches(rng, 2)
  kw = dict(conditioner="sketched", **EXACT)
  ident, _ = _run(sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(rank=2, **kw), others="identity"), batches)
  adam, _ = _run(sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(rank=2, **kw)), batches)
  for (x, g), a, b in zip(batches, ident, adam):
    np.testing.assert_array_equal(a["dense"]["bias"], np.asarray(g[0], np.float32))
    np.testing.assert_allclose(a["dense"]["kernel"], b["dense"]["kernel"], rtol=1e-5, atol=1e-7)
  state = sk.scale_by_eigenbasis_adam(sk.Conditioning.from_flat(rank=2, **kw), others="identity").init(
      {"dense": {
          "kernel": jnp.zeros((6, 3)),
          "bias": jnp.zeros(3)
      }})
  assert jax.tree.leaves(state.mu["dense"]["bias"]) == [] and jax.tree.leaves(state.nu["dense"]["bias"]) == []


def _floats(tree) -> int:
  """Floats of a state's arrays of more than one element (its scalars, counts and key, aside)."""
  return sum(a.size for a in jax.tree.leaves(tree) if a.size > 1 and jnp.issubdtype(a.dtype, jnp.floating))


@pytest.mark.parametrize("tail", ["factored", "scalar", "orthogonal"])
def test_memory_rule_takes_the_largest_rank_whose_whole_state_fits_adams(tail):
  """budget='kernel': the rank the memory rule picks for a (96, 40) kernel is the largest whose measured state
  (first moment, rotated second moment, tail, rotation, statistics, factor) fits Adam's 2 n p floats: the state
  built at that rank fits, at one rank more it does not."""
  n, p = 96, 40
  params = {"dense": {"kernel": jnp.zeros((n, p))}}
  state = sk.scsgd_eigen(1e-3, sk.Conditioning(statistics=sk.Statistics(budget="kernel")), tail=tail).init(params)
  summary = state[0].summary()["dense/kernel"]
  assert "streaming" in summary, summary
  k = int(summary.split("rank ")[1].split(",")[0])
  fixed = lambda rank: sk.scsgd_eigen(
      1e-3, sk.Conditioning(rank=rank, statistics=sk.Statistics(kind="streaming")), tail=tail).init(params)
  assert _floats(state) == _floats(fixed(k)) <= 2 * n * p < _floats(fixed(k + 1))


def test_a_kernel_fitting_only_diagonal_statistics_gets_adam_and_keeps_no_statistics():
  """A (784, 10) kernel (logistic regression on MNIST: no rank-1 sketch fits its n p floats) keeps no statistics
  and is updated exactly as optax.scale_by_adam's, also with others='identity' (the kernels kernel_filter selects are
  this transformation's); the state is Adam's floats."""
  rng = np.random.default_rng(7)
  params = {"dense": {"kernel": jnp.zeros((784, 10)), "bias": jnp.zeros(10)}}
  ref = optax.scale_by_adam(b1=B1, b2=B2, eps=EPS)
  for others in ("adam", "identity"):
    tx = sk.scale_by_eigenbasis_adam(b1=B1, b2=B2, eps=EPS, others=others)
    state, ref_state = tx.init(params), ref.init(params)
    assert state.conditioning.statistics == {} and "memory budget" in state.summary()["dense/kernel"]
    assert _floats(state) == _floats(ref_state) - (10 if others == "identity" else 0) * 2
    for _ in range(3):
      grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
      inputs = {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 784)), jnp.float32)}}
      out, state = jax.jit(tx.update)(grads, state, params, layer_inputs=inputs)
      want, ref_state = ref.update(grads, ref_state, params)
      np.testing.assert_allclose(out["dense"]["kernel"], want["dense"]["kernel"], rtol=1e-5, atol=1e-7)


def _transformer_params(d=64, vocab=50, blocks=2):
  dense = lambda n, p: {"kernel": jnp.zeros((n, p)), "bias": jnp.zeros(p)}
  tree = {"embed": {"embedding": jnp.zeros((vocab, d))}, "head": dense(d, vocab)}
  for i in range(blocks):
    tree[f"block{i}"] = {"attn": dense(d, 3 * d), "proj": dense(d, d), "fc1": dense(d, 4 * d),
                         "fc2": dense(4 * d, d), "norm": {"scale": jnp.ones(d)}}
  return tree


def _lenet_params():
  return {"conv1": {"kernel": jnp.zeros((5, 5, 1, 20))}, "conv2": {"kernel": jnp.zeros((5, 5, 20, 50))},
          "dense1": {"kernel": jnp.zeros((800, 500))}, "dense2": {"kernel": jnp.zeros((500, 10))}}


@pytest.mark.parametrize("params", [_transformer_params(), _lenet_params(),
                                    {"dense": {"kernel": jnp.zeros((784, 10)), "bias": jnp.zeros(10)}},
                                    {"wide": {"kernel": jnp.zeros((784, 10))}, "dense": {"kernel": jnp.zeros((64, 64))}}],
                         ids=["transformer", "lenet", "logistic", "unplanned_beside_planned"])
@pytest.mark.parametrize("rate", [1e-3, optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)],
                         ids=["constant", "schedule"])
def test_default_state_is_at_most_adams_on_every_model(params, rate):
  """The default memory rule (budget='model') keeps the eigenbasis' whole state within AdamW's, counted in bytes
  (counters and key included) alone; in front of Muon (Muon's AdamW part holding the leaves Muon does not
  orthogonalize) its floats are within AdamW's, beside Muon's three Newton-Schulz coefficients and a counter per
  transform of the chain, at a constant rate and on a schedule; a kernel left unplanned
  keeps Adam's second moment, so its floats pay for no other kernel's statistics. With no kernel conditioned
  (logistic regression's) the state is AdamW's to the byte: one counter, no key."""
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  floats = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.dtype != jnp.int32)
  adamw_state = optax.adamw(rate).init(params)
  adamw = nbytes(adamw_state)
  eigen = sk.scsgd_eigen(rate).init(params)
  eigen_muon = sk.scsgd_eigen_muon(rate, output_layer="head" if "head" in params else "").init(params)
  assert nbytes(eigen) <= adamw and floats(eigen_muon) - 4 * 3 <= floats(adamw_state)  # less Muon's 3 coefficients
  counters = lambda tree: [x for x in jax.tree.leaves(tree) if x.dtype == jnp.int32 and x.ndim == 0]
  schedules = 2 if callable(rate) else 0  # Muon's part and its AdamW part each count their own schedule's steps
  assert len(counters(eigen_muon[1])) == 2 + schedules  # Muon's own, its AdamW part's and the schedules'
  if not eigen[0].conditioning.factors:
    assert eigen[0].conditioning.key is None and nbytes(eigen) == adamw
