"""The benchmark's peers (optional `bench` extra): each compatibility patch is still needed (these
tests fail once upstream no longer needs it: remove the patch then), and each peer takes a step."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("precondition")
pytest.importorskip("kfac_jax")

from experiments.optim import peers  # noqa: E402
from experiments.optim import registry  # noqa: E402

@pytest.fixture(autouse=True)
def allow_rank_promotion():
  """The peers broadcast implicitly; the library's own tests keep rank promotion an error (conftest)."""
  with jax.numpy_rank_promotion("allow"):
    yield

# the head to head's checks: CI runs them in a step of their own when its files change (.ci/run)
pytestmark = pytest.mark.head_to_head



ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KFAC_STEP = """
import jax, jax.numpy as jnp, optax, kfac_jax
def loss_fn(params, batch):
  x, y = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
params = {"w1": jnp.ones((5, 4)) * 0.1, "w2": jnp.ones((4, 3)) * 0.1}
x = jax.random.normal(jax.random.PRNGKey(0), (16, 5)); y = jnp.arange(16) % 3
pre = kfac_jax.OptaxPreconditioner(loss_fn, damping=0.1, distributed_inverses=False, distributed_precon_apply=False)
tx = optax.chain(pre.as_gradient_transform(), optax.sgd(0.05, momentum=0.9, nesterov=True))
ps, s = pre.init((params, (x, y)), jax.random.PRNGKey(1)), tx.init(params)
first = float(loss_fn(params, (x, y)))
for i in range(5):
  ps = pre.maybe_update(ps, (params, (x, y)), jax.random.PRNGKey(i))
  u, s = tx.update(jax.grad(loss_fn)(params, (x, y)), s, params, precond_state=ps)
  params, ps = optax.apply_updates(params, u), pre.increment_count(ps)
print("LOSS", first, float(loss_fn(params, (x, y))))
"""

SHAMPOO_STEP = """
import jax, jax.numpy as jnp
from precondition import distributed_shampoo as ds
params = {"w": jnp.ones((8, 4))}
tx = ds.distributed_shampoo(0.01, 128, precondtioner_type=ds.PreconditionerType.INPUT,
                             best_effort_shape_interpretation=False, skip_preconditioning_rank_lt=2)
u, _ = tx.update(params, tx.init(params), params)
"""


def _python(code):
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_precondition_still_needs_the_jax_aliases():
  out = _python(SHAMPOO_STEP)  # a fresh process, unpatched
  assert out.returncode != 0 and "module 'jax' has no attribute 'tree_map'" in out.stderr, out.stderr[-500:]
  patched = _python("from experiments.optim import upstream; upstream.patch_precondition()\n" + SHAMPOO_STEP)
  assert patched.returncode == 0, patched.stderr[-2000:]


PSGD_STEP = """
import jax, jax.numpy as jnp
from psgd_jax.kron import kron
params = {"w": jnp.ones((8, 4))}
tx = kron(0.01)
u, _ = tx.update(params, tx.init(params), params)
print("FINITE", bool(jnp.all(jnp.isfinite(u["w"]))))
"""


def test_psgd_still_needs_the_clipping_module_and_then_steps():
  out = _python(PSGD_STEP)  # a fresh process, unpatched
  assert out.returncode != 0 and "clipping" in out.stderr, out.stderr[-500:]
  patched = _python("from experiments.optim import upstream; upstream.patch_psgd()\n" + PSGD_STEP)
  assert patched.returncode == 0 and "FINITE True" in patched.stdout, patched.stderr[-2000:]


def test_kfac_still_needs_the_bind_params_patch_and_then_learns():
  out = _python(KFAC_STEP)
  assert out.returncode != 0 and "too many values to unpack" in out.stderr, out.stderr[-500:]
  patched = _python("from experiments.optim import upstream; upstream.patch_kfac()\n" + KFAC_STEP)
  assert patched.returncode == 0, patched.stderr[-2000:]
  first, last = map(float, patched.stdout.split("LOSS")[1].split())
  assert last < first


def _step(tx, params, grads):
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return updates


def _second_step(tx, params, grads, first=None):
  """The update of a second step on ``grads`` after a first on ``first`` (default: ``grads``)."""
  update = jax.jit(tx.update)
  _, state = update(grads if first is None else first, tx.init(params), params)
  return update(grads, state, params)[0]


@pytest.mark.parametrize("name", ["shampoo_input", "sketchy"])
def test_input_side_shampoo_and_sketchy_condition_only_the_input_side(name):
  """Input-side only: a kernel's update is G times nothing on the output side, i.e. P G with P from
  the input statistics; for a gradient G = u v^T the update stays in span(v) on the output side, even after a
  full-rank gradient made the output-side statistics full rank (two-sided Shampoo then leaves span(v))."""
  rng = np.random.default_rng(0)
  u, v = rng.standard_normal((8, 1)), rng.standard_normal((1, 4))
  params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
  grads = {"w": jnp.asarray(u @ v, jnp.float32), "b": jnp.ones(4)}
  first = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), "b": jnp.ones(4)}
  kwargs = {"compression_rank": 4} if name == "sketchy" else {}
  # the first step is the grafting optimizer's alone (before start_preconditioning_step): read the second,
  # without momentum, so that it is the preconditioned gradient alone
  upd = np.asarray(_second_step(getattr(peers, name)(0.1, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                                     beta1=0.0, **kwargs), params, grads, first)["w"])
  assert np.all(np.isfinite(upd)) and np.abs(upd).max() > 0
  # every row of the update is a multiple of v (no output-side mixing)
  resid = upd - (upd @ v.T) @ v / (v @ v.T)
  assert np.abs(resid).max() < 1e-4 * np.abs(upd).max()
  two_sided = np.asarray(_second_step(peers.shampoo(0.1, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                                    beta1=0.0), params, grads, first)["w"])
  resid = two_sided - (two_sided @ v.T) @ v / (v @ v.T)
  assert np.abs(resid).max() > 1e-2 * np.abs(two_sided).max()  # the same check fails for two-sided Shampoo


def test_conv_kernels_routed_to_grafting_take_the_graft_only_step():
  """``graft_conv``: a 4-D kernel's update equals that of a Shampoo that preconditions nothing; a matrix's
  does not."""
  rng = np.random.default_rng(1)
  params = {"conv": jnp.zeros((3, 3, 2, 4)), "dense": jnp.zeros((6, 5))}
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  first = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  common = dict(start_preconditioning_step=1, preconditioning_compute_steps=1)  # the second step is preconditioned
  routed = _second_step(peers.shampoo(0.1, graft_conv=True, **common), params, grads, first)
  graft_only = _second_step(peers.shampoo(0.1, skip_preconditioning_rank_lt=99, **common), params, grads, first)
  full = _second_step(peers.shampoo(0.1, **common), params, grads, first)
  np.testing.assert_allclose(routed["conv"], graft_only["conv"], rtol=1e-5, atol=1e-7)
  # (upstream pads every statistic of one instance to the largest: the inverse roots differ in rounding)
  np.testing.assert_allclose(routed["dense"], full["dense"], rtol=1e-3, atol=1e-3)
  assert np.abs(np.asarray(routed["dense"]) - np.asarray(graft_only["dense"])).max() > 1e-4


def test_adamw_decays_only_matrices_when_asked():
  """Zero gradients: AdamW's update is -lr wd w on decayed leaves, 0 elsewhere (nanoGPT's mask)."""
  params = {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2), "table": jnp.ones((4, 3))}
  grads = jax.tree.map(jnp.zeros_like, params)
  for fn in (peers.adamw, peers.nadamw):
    masked = _step(fn(0.1, weight_decay=0.5, decay_matrices_only=True), params, grads)
    np.testing.assert_allclose(masked["kernel"], -0.05 * np.ones((3, 2)), rtol=1e-6)
    np.testing.assert_allclose(masked["table"], -0.05 * np.ones((4, 3)), rtol=1e-6)
    np.testing.assert_allclose(masked["bias"], 0.0)
    plain = _step(fn(0.1, weight_decay=0.5), params, grads)
    np.testing.assert_allclose(plain["bias"], -0.05 * np.ones(2), rtol=1e-6)


def test_muon_sends_tables_and_the_output_layer_to_adamw_at_its_own_rate():
  params = {"embed": {"embedding": jnp.zeros((10, 4))}, "pos": jnp.zeros((8, 4)),
            "hidden": {"kernel": jnp.zeros((4, 6))}, "head": {"kernel": jnp.zeros((6, 10))}}
  dims = peers.muon_dimension_numbers(params, output_layer="head")
  assert dims["hidden"]["kernel"].reduction_axis == (0,)
  assert dims["head"]["kernel"] is None and dims["embed"]["embedding"] is None and dims["pos"] is None
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  upd = _step(peers.muon(0.02, output_layer="head", adam_learning_rate=0.001), params, grads)
  # the AdamW part (weight decay 0, Nesterov as Muon's) at AdamW's rate: its first step is
  # lr (1 + b1 (1 - b1) / (1 - b1^2)) sign(g) (bias-corrected Nesterov moments, up to eps)
  for leaf in (upd["head"]["kernel"], upd["pos"]):
    np.testing.assert_allclose(np.abs(np.asarray(leaf)), 0.001 * (1 + 0.9 * 0.1 / 0.19), rtol=1e-4)
  s = np.linalg.svd(np.asarray(upd["hidden"]["kernel"]), compute_uv=False)
  raw = np.linalg.svd(np.asarray(grads["hidden"]["kernel"]), compute_uv=False)
  assert s.max() / s.min() < 2.0 < raw.max() / raw.min(), (s, raw)  # orthogonalised (5 Newton-Schulz steps)


def test_muon_gets_conv_kernels_too():
  params = {"conv": {"kernel": jnp.zeros((3, 3, 2, 4)), "bias": jnp.zeros(4)},
            "embed": {"embedding": jnp.zeros((10, 4))}, "dense": {"kernel": jnp.zeros((6, 5))}}
  dims = peers.muon_dimension_numbers(params)
  assert dims["conv"]["kernel"].reduction_axis == (0, 1, 2) and dims["conv"]["kernel"].output_axis == (3,)
  assert dims["dense"]["kernel"].reduction_axis == (0,)
  assert dims["conv"]["bias"] is None and dims["embed"]["embedding"] is None
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  upd = _step(peers.muon(0.1), params, grads)
  # Muon orthogonalises the (kh*kw*cin, cout) matrix of the conv update: its singular values are equal
  s = np.linalg.svd(np.asarray(upd["conv"]["kernel"]).reshape(18, 4), compute_uv=False)
  assert s.max() / s.min() < 1.6, s


def test_kfac_step_is_the_pi_damped_kronecker_inverse_of_the_input_and_output_factors():
  """kfac-jax's input factor of a dense layer is SCSGD's C (inputs with a ones column for the bias):
  after one step it is exactly [X, 1]^T [X, 1] / B, and the first update is Nesterov SGD's
  -lr (1 + momentum) of (A + pi sqrt(l) I)^-1 [g_W; g_b] (G + sqrt(l)/pi I)^-1, pi^2 = (tr A/7)/(tr G/3)."""
  params = {"dense": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(3)}}

  def apply_fn(p, inputs):
    return inputs @ p["dense"]["kernel"] + p["dense"]["bias"]

  x, y = jax.random.normal(jax.random.PRNGKey(1), (8, 6)), jnp.arange(8) % 3
  lr, momentum, damping = 0.1, 0.9, 1e-3
  tx = peers.kfac(lr, apply_fn=apply_fn, example_batch=(jnp.zeros_like(x), y), damping=damping, momentum=momentum)
  grads = jax.grad(lambda p: peers.kfac_loss(apply_fn, p, (x, y)))(params)
  updates, state = tx.update(grads, tx.init(params), params, batch=(x, y), key=jax.random.PRNGKey(2))
  a, g = (f.value for f in state.preconditioner.estimator_state.blocks_states[0].factors)
  x1 = np.concatenate([np.asarray(x), np.ones((8, 1))], 1)
  np.testing.assert_allclose(a, x1.T @ x1 / 8, rtol=1e-5, atol=1e-6)
  pi = np.sqrt((np.trace(a) / 7) / (np.trace(g) / 3))
  gm = np.concatenate([grads["dense"]["kernel"], grads["dense"]["bias"][None]], 0)
  p = np.linalg.solve(a + pi * np.sqrt(damping) * np.eye(7), gm) @ np.linalg.inv(g + np.sqrt(damping) / pi * np.eye(3))
  got = np.concatenate([updates["dense"]["kernel"], updates["dense"]["bias"][None]], 0)
  np.testing.assert_allclose(got, -lr * (1 + momentum) * p, rtol=1e-4, atol=1e-6)
  assert int(state.preconditioner.count) == 1


@pytest.mark.parametrize("explicit", [True, False])
def test_kfac_conv_input_factor_is_the_second_moment_of_the_im2col_patches(explicit):
  """A conv layer's K-FAC input factor after one step is [P, 1]^T [P, 1] / (B L) for P the im2col patches
  (rows (i, j) of each image, columns (di, dj, c)), built here by explicit loops: the same with the
  extracted-patches implementation the benchmark uses and with upstream's 4-D convolution loop."""
  params = {"conv": {"kernel": 0.1 * jax.random.normal(jax.random.PRNGKey(0), (3, 3, 2, 4)), "bias": jnp.zeros(4)}}

  def apply_fn(p, inputs):
    out = jax.lax.conv_general_dilated(inputs, p["conv"]["kernel"], (1, 1), "VALID",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["conv"]["bias"]
    return out.sum(axis=(1, 2))

  x, y = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 5, 2)), jnp.array([0, 3])
  tx = peers.kfac(0.1, apply_fn=apply_fn, example_batch=(jnp.zeros_like(x), y), explicit_conv_patches=explicit)
  grads = jax.grad(lambda p: peers.kfac_loss(apply_fn, p, (x, y)))(params)
  _, state = tx.update(grads, tx.init(params), params, batch=(x, y), key=jax.random.PRNGKey(2))
  a = np.asarray(state.preconditioner.estimator_state.blocks_states[0].factors[0].value)
  xn = np.asarray(x)
  rows = [np.append(xn[b, i:i + 3, j:j + 3, :].reshape(-1), 1.0) for b in range(2) for i in range(4) for j in range(3)]
  p = np.stack(rows)
  np.testing.assert_allclose(a, p.T @ p / len(rows), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", registry.KINDS)
def test_scsgd_muon_fresh_is_scsgd_muon_with_the_fresher_statistics(kind):
  base, fresh = registry.recipe("scsgd_muon", kind), registry.recipe("scsgd_muon_fresh", kind)
  assert fresh.learning_rate == base.learning_rate
  assert fresh.settings == {**base.settings, "update_every": 10, "ema_rate": 0.2}
  assert registry.entry("scsgd_muon_fresh").adam_rate == registry.entry("scsgd_muon").adam_rate
