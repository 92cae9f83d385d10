"""Every captured layer type, NNX and Linen: rows reproduce the layer's output, and one step equals a dense oracle."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import scsgd_jax as sk
from scsgd_jax._src import defaults
from scsgd_jax._src import layout as layout_lib
from tests import helpers

LR = 0.1
RNG = np.random.default_rng(0)
X3 = jnp.asarray(RNG.standard_normal((2, 5, 8)), jnp.float32)      # (batch, length, features)
X4 = jnp.asarray(RNG.standard_normal((4, 5, 4, 3)), jnp.float32)   # (batch, length, heads, head_dim)
IDS = jnp.asarray(RNG.integers(0, 11, (3, 7)), jnp.int32)

# (name, NNX layer factory, Linen module, input, input axes of its kernel)
CASES = [
    ("linear", lambda r: nnx.Linear(8, 6, use_bias=False, rngs=r), nn.Dense(6), X3, (0,)),
    ("query_like", lambda r: nnx.LinearGeneral(8, (4, 3), use_bias=False, rngs=r), nn.DenseGeneral((4, 3)), X3, (0,)),
    ("out_like", lambda r: nnx.LinearGeneral((4, 3), 6, axis=(-2, -1), use_bias=False, rngs=r),
     nn.DenseGeneral(6, axis=(-2, -1)), X4, (0, 1)),
    ("einsum", lambda r: nnx.Einsum("btd,dnh->btnh", (8, 2, 3), rngs=r),
     nn.Einsum((8, 2, 3), "btd,dnh->btnh"), X3, (0,)),
    ("einsum_kernel_last", lambda r: nnx.Einsum("btd,od->bto", (6, 8), rngs=r),
     nn.Einsum((6, 8), "btd,od->bto"), X3, (1,)),
    ("embed", lambda r: nnx.Embed(11, 4, rngs=r), nn.Embed(11, 4), IDS, (0,)),
]


def _kernel_matrix(kernel, axes):
  """The kernel as the (n, p) matrix over its input axes (explicit transpose)."""
  kernel = np.asarray(kernel)
  rest = [a for a in range(kernel.ndim) if a not in axes]
  moved = np.transpose(kernel, list(axes) + rest)
  n = int(np.prod([kernel.shape[a] for a in axes]))
  return moved.reshape(n, -1), moved.shape


def _nnx_layer(make):
  return make(nnx.Rngs(0))  # no biases: the rows times the kernel are the whole output


@pytest.mark.parametrize("name,make,_,x,axes", CASES, ids=[c[0] for c in CASES])
def test_nnx_rows_reproduce_layer_output(name, make, _, x, axes):
  layer = _nnx_layer(make)
  out, li = sk.capture_nnx(layer, x, max_rows=None)
  param = "embedding" if name == "embed" else "kernel"
  rows = np.asarray(li[param])
  if name == "embed":
    rows = np.eye(11)[rows]  # ids -> one-hot rows
  mat, _ = _kernel_matrix(getattr(layer, param)[...], axes)
  np.testing.assert_allclose(rows @ mat, np.asarray(out).reshape(rows.shape[0], -1), rtol=1e-5, atol=1e-5)
  assert sk.input_axes_nnx(layer) == {param: sk.Layout(axes)}


@pytest.mark.parametrize("name,_,module,x,axes", CASES, ids=[c[0] for c in CASES])
def test_linen_rows_reproduce_layer_output(name, _, module, x, axes):
  if hasattr(module, "use_bias"):
    module = module.clone(use_bias=False)
  variables = module.init(jax.random.PRNGKey(0), x)
  out, li = sk.capture_linen(module, variables, x, max_rows=None)
  param = "embedding" if name == "embed" else "kernel"
  rows = np.asarray(li[param])
  if name == "embed":
    rows = np.eye(11)[rows]
  mat, _ = _kernel_matrix(variables["params"][param], axes)
  np.testing.assert_allclose(rows @ mat, np.asarray(out).reshape(rows.shape[0], -1), rtol=1e-5, atol=1e-5)
  assert sk.input_axes_linen(module, variables, x) == {param: sk.Layout(axes)}


def _assert_stepped_plainly(layer, x, match):
  """Without ``input_axes``, a kernel its layer reads by another layout than ``init`` guessed: the first update
  steps it plainly (``-lr G``), says so naming it (``match``) and the fix, and the plans show it."""
  with pytest.warns(UserWarning, match=r"plain updates.*" + match + r".*input_axes=scsgd_jax.input_axes_nnx\(model, x\)"):
    grads, _, updates, new = _one_dense_step(layer, x)
  for path, g in grads.items():
    np.testing.assert_allclose(updates[path], -LR * np.asarray(g), rtol=1e-6, atol=1e-9)
    assert sk.plans(new)[path].startswith("not conditioned: its layer reads it"), sk.plans(new)


def _one_dense_step(layer, x, input_axes=None):
  """One step of the full conditioner from this batch alone (ema_rate = 1) on the loss sum(layer(x) * target):
  the gradients, the captured rows, the updates and the new state."""
  tx = optax.chain(
      sk.scale_by_sketched_conditioning(
          sk.Conditioning(conditioner=sk.Conditioner(kind="full"),
                          statistics=sk.Statistics(kind="dense", ema_rate=1.0),
                          refresh=sk.Refresh(every=1),
                          input_axes=input_axes)), optax.sgd(LR))
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  target = jnp.asarray(RNG.standard_normal(layer(x).shape), jnp.float32)

  def loss(m):
    out, li = sk.capture_nnx(m, x, max_rows=None)
    return jnp.sum(out * target), li

  (_, li), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
  grads = nnx.as_pure(grads)
  updates, new = jax.jit(lambda g, s, li: tx.update(g, s, params, layer_inputs=li))(grads, tx.init(params), li)
  return grads, li, updates, new


@pytest.mark.parametrize("told", [False, True], ids=["captured_axes", "input_axes_given"])
@pytest.mark.parametrize("name,make,_,x,axes", CASES, ids=[c[0] for c in CASES])
def test_one_conditioned_step_equals_dense_oracle(name, make, _, x, axes, told):
  """C from this batch alone (ema_rate = 1), A = C^{1/2} (an embedding's at SGD's scale, the default): the update
  is -lr A^{-1} G in the kernel's layout, told up front or read by init's defaults; without input_axes, a layout
  the capture reads otherwise than init planned is stepped plainly (-lr G), naming the kernel and the fix."""
  layer = _nnx_layer(make)
  param = "embedding" if name == "embed" else "kernel"
  leaf = nnx.as_pure(nnx.state(layer, nnx.Param))[param]
  if not told and sk.Layout(tuple(axes)) != sk.Layout(tuple(layout_lib.default_input_axes(param, leaf))):
    # plans are fixed at init, which reads the parameters alone: a layout it cannot see is stepped plainly
    _assert_stepped_plainly(layer, x, rf"{param} .* read as Layout\(input_axes={re.escape(str(tuple(axes)))}")
    return
  grads, li, updates, _ = _one_dense_step(layer, x, {param: axes} if told else None)
  g_mat, moved_shape = _kernel_matrix(grads[param], axes)
  if name == "embed":
    counts = np.bincount(np.asarray(IDS).reshape(-1), minlength=11) / IDS.size
    floor = defaults.EIGENVALUE_FLOOR * counts.sum() / 11
    # the default normalize='embeddings': A from C / (tr C / n), i.e. A^{-1} times sqrt(tr C / n)
    expected = g_mat * np.sqrt(counts.sum() / 11) / np.sqrt(np.maximum(counts, floor))[:, None]
  else:
    rows = np.asarray(li[param], np.float64)
    expected = helpers.psd_power(rows.T @ rows / rows.shape[0], -0.5) @ g_mat
  got, _ = _kernel_matrix(updates[param], axes)
  np.testing.assert_allclose(got, -LR * expected, rtol=2e-3, atol=1e-4)


def test_attention_kernels_read_by_true_input_axes():
  """nnx.MultiHeadAttention: q/k/v (in, heads, head_dim) have n = in, out (heads, head_dim, out) has n = heads * head_dim."""
  attn = nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=32, out_features=8, decode=False,
                                rngs=nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(attn, nnx.Param))
  state = sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(kind="dense"),
                                        conditioner=sk.Conditioner(kind="full"))).init(params)
  dims = {p: f.dim for p, f in state[0].factors.items()}
  assert dims == {"query/kernel": 16, "key/kernel": 16, "value/kernel": 16, "out/kernel": 32}
  assert sk.input_axes_nnx(attn) == {f"{p}/kernel": sk.Layout(ax) for p, ax in
                                     [("query", (0,)), ("key", (0,)), ("value", (0,)), ("out", (0, 1))]}


def test_captured_inputs_carry_the_axes_and_survive_tree_maps_and_jit():
  layer = nnx.Einsum("btd,od->bto", (6, 8), rngs=nnx.Rngs(0))   # input axis is 1, the default reads 0
  _, li = sk.capture_nnx(layer, X3)
  assert isinstance(li, sk.CapturedInputs) and li.input_axes == {"kernel": sk.Layout((1,))}
  assert jax.tree.map(lambda r: r * 2, li).input_axes == {"kernel": sk.Layout((1,))}
  assert jax.jit(lambda t: t)(li).input_axes == {"kernel": sk.Layout((1,))}
  flat, _ = jax.tree_util.tree_flatten_with_path(li)
  assert [jax.tree_util.keystr(p) for p, _ in flat] == ["['kernel']"]


def test_wrong_input_axes_are_reported_naming_the_kernel():
  layer = nnx.Einsum("btd,od->bto", (6, 8), rngs=nnx.Rngs(0))   # input axis is 1, the default reads 0
  params = nnx.as_pure(nnx.state(layer, nnx.Param))
  tx = sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(kind="dense", fold_every=1)))
  _, li = sk.capture_nnx(layer, X3)
  grads = jax.tree.map(jnp.ones_like, params)
  # rows without the captured axes (a plain dict) are read by the name-based default, axis 0
  with pytest.raises(ValueError, match=r"'kernel' read with input axes \(0,\) \(n=6\).*input_axes_nnx"):
    tx.update(grads, tx.init(params), params, layer_inputs=dict(li))
  # input_axes= overrides what the capture read
  told = sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(kind="dense"), input_axes={"kernel": (0,)}))
  with pytest.raises(ValueError, match=r"'kernel' read with input axes \(0,\) \(n=6\)"):
    told.update(grads, told.init(params), params, layer_inputs=li)
  # the captured inputs alone: init's plan (n = 6) is not redone (plans are fixed at init): stepped plainly, with the fix
  with pytest.warns(UserWarning, match=r"plain updates.*kernel .*\(6, 8\) read as Layout\(input_axes=\(1,\).*\(n=8\), "
                    r"planned as Layout\(input_axes=\(0,\).*\(n=6\).*input_axes_nnx"):
    jax.jit(tx.update)(grads, tx.init(params), params, layer_inputs=li)
  # told up front, init plans n = 8 and the state keeps it
  told = sk.scsgd(
      0.1, sk.Conditioning(statistics=sk.Statistics(kind="dense", fold_every=1), input_axes=sk.input_axes_nnx(layer)))
  _, state = jax.jit(told.update)(grads, told.init(params), params, layer_inputs=li)
  assert state[0].summary() == {"kernel": "dense C, full C^(1/2), n=8"}
  assert state[0].statistics["kernel"].moments.shape == (8, 8)


def test_unknown_layer_kernel_gets_a_clear_error():
  class Custom(nnx.Module):
    def __init__(self):
      self.kernel = nnx.Param(jnp.ones((5, 3)))

    def __call__(self, x):
      return x @ self.kernel[...]

  model = Custom()
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  _, li = sk.capture_nnx(model, jnp.ones((2, 5)))
  tx = sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(kind="dense")))
  with pytest.raises(ValueError, match="no entry for the conditioned kernel 'kernel'"):
    tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params, layer_inputs=li)


@pytest.mark.parametrize("bad", [0, -3])
def test_max_rows_must_be_positive(bad):
  layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_rows must be a positive int"):
    sk.capture_nnx(layer, jnp.ones((2, 3)), max_rows=bad)
  module = nn.Dense(2)
  variables = module.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="max_rows must be a positive int"):
    sk.capture_linen(module, variables, jnp.ones((2, 3)), max_rows=bad)


def test_einsum_with_shared_batch_label_is_left_unconditioned_and_named():
  layer = nnx.Einsum("bnd,nde->bne", (3, 4, 5), rngs=nnx.Rngs(0))
  _, li = sk.capture_nnx(layer, jnp.ones((2, 3, 4)))
  assert "shares labels" in li.unconditioned["kernel"] and dict(li) == {}


class _Mixed(nnx.Module):
  """A CNN as vision code writes it: a conv, a depthwise conv, a transposed conv, a head."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.dw = nnx.Conv(8, 8, (3, 3), feature_group_count=8, rngs=rngs)
    self.up = nnx.ConvTranspose(8, 4, (2, 2), strides=(2, 2), rngs=rngs)
    self.head = nnx.Linear(4 * 16 * 16, 5, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.up(nnx.relu(self.dw(nnx.relu(self.conv(x))))))
    return self.head(y.reshape(y.shape[0], -1))


@pytest.mark.parametrize("groups,cin,cout", [(2, 4, 6), (8, 8, 8), (4, 4, 8)],
                         ids=["grouped", "depthwise", "depthwise_multiplier"])
def test_grouped_conv_step_equals_per_group_dense_oracle(groups, cin, cout):
  """A grouped conv is ``groups`` problems: group g's output channels read input channels block g only, so
  each block of the kernel gets ``C_g^{-1/2} G_g`` with ``C_g`` from the explicit im2col of its channels."""
  layer = nnx.Conv(cin, cout, (3, 3), feature_group_count=groups, use_bias=False, rngs=nnx.Rngs(0))
  x = jnp.asarray(RNG.standard_normal((2, 6, 6, cin)), jnp.float32)
  if groups > 1:  # init cannot read the groups from the parameters: stepped plainly without input_axes, naming the fix
    _assert_stepped_plainly(layer, x, r"kernel .*\(3, 3, \d+, \d+\) read as .*groups=\d+")
  grads, li, updates, new = _one_dense_step(layer, x, sk.input_axes_nnx(layer))
  assert li.input_axes == {"kernel": sk.Layout((0, 1, 2), 0, groups)}
  assert new[0].summary()["kernel"] == f"dense C, full C^(1/2), n={9 * cin // groups}, per group of {groups}"
  g, got = np.asarray(grads["kernel"]), np.asarray(updates["kernel"])
  ci, co = cin // groups, cout // groups
  for i in range(groups):
    rows = helpers.im2col(np.asarray(x)[..., i * ci:(i + 1) * ci], (3, 3), pads=((1, 1), (1, 1)))
    c = rows.T @ rows / rows.shape[0]
    block = lambda k: k[..., i * co:(i + 1) * co].reshape(9 * ci, co)
    np.testing.assert_allclose(block(got), -LR * helpers.psd_power(c, -0.5) @ block(g), rtol=2e-3, atol=1e-4)


def test_depthwise_conditioned_per_group_and_transposed_conv_trains_plain(caplog):
  """No model fails to train because of one layer kind: the depthwise conv is conditioned per group, the
  transposed conv gets exactly Nesterov SGD's update (its statistics untouched), and the summary and the log
  name it with the reason."""
  import logging

  model = _Mixed(nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)), jnp.float32)
  y = jnp.array([0, 1, 2, 3])

  def loss_fn(params):
    logits, li = sk.capture_nnx(nnx.merge(nnx.graphdef(model), params), x, rng=jax.random.PRNGKey(0))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), li

  (_, li), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  tx = sk.scsgd(0.1, sk.Conditioning(input_axes=sk.input_axes_nnx(model)), max_relative_step=None)  # step bound aside
  sgd = optax.sgd(0.1, 0.9, nesterov=True)
  with caplog.at_level(logging.INFO, logger="scsgd_jax"):  # said once, at init (or at the first update)
    state = tx.init(params)
    updates, new = jax.jit(lambda g, s, li: tx.update(g, s, params, layer_inputs=li))(grads, state, li)
  plain, _ = jax.jit(lambda g: sgd.update(g, sgd.init(params), params))(grads)
  np.testing.assert_allclose(updates["up"]["kernel"], plain["up"]["kernel"], rtol=1e-6, atol=1e-9)
  assert "up/kernel" not in state[0].statistics  # planned plain at init: no statistics kept for it
  for layer in ("conv", "dw"):
    assert np.abs(np.asarray(updates[layer]["kernel"]) - np.asarray(plain[layer]["kernel"])).max() > 1e-4
  summary = new[0].summary()
  assert summary == state[0].summary()  # planned at init with the layers' layouts: the plan in use
  assert summary["dw/kernel"] == "dense C, full C^(1/2), n=9, per group of 8"
  assert summary["up/kernel"] == "not conditioned: layer 'up' is a transposed convolution (its inputs are dilated)"
  assert summary["conv/kernel"] == "dense C, full C^(1/2), n=27"
  assert any("up/kernel" in r.getMessage() for r in caplog.records)
  # Linen: the same layers, the same outcome
  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(8, (3, 3), feature_group_count=1, name="conv")(x)
      x = nn.Conv(8, (3, 3), feature_group_count=8, name="dw")(x)
      x = nn.ConvTranspose(4, (2, 2), strides=(2, 2), name="up")(x)
      return nn.Dense(5, name="head")(x.reshape(x.shape[0], -1))

  variables = Linen().init(jax.random.PRNGKey(0), x)
  _, li = sk.capture_linen(Linen(), variables, x, rng=jax.random.PRNGKey(0))
  assert sorted(li.unconditioned) == ["up/kernel"] and sorted(li) == ["conv", "dw", "head"]
  assert li["dw"]["kernel"].shape[0] == 8 and li.input_axes["dw/kernel"] == sk.Layout((0, 1, 2), 0, 8)
  told = sk.input_axes_linen(Linen(), variables, x)
  assert isinstance(told["up/kernel"], sk.Plain) and "transposed" in told["up/kernel"].why
  assert sk.scsgd(0.1, sk.Conditioning(input_axes=told)).init(variables["params"])[0].summary()["up/kernel"].startswith(
      "not conditioned: layer 'up' is a transposed convolution")
