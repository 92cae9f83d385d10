"""The capture reaches every layer Flax ships as its authors write it: stand-ins that keep their originals'
signatures, recurrent cells under ``nn.RNN``/``nn.Bidirectional``/``nnx.RNN`` (their rows checked against the cell
stepped by hand), raw parameters handed over with ``sow_rows``, the row budget per step, and plans that say what every
leaf gets under every alias."""

import functools
import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import scsgd_jax as sk
from scsgd_jax._src import captured as captured_lib
from scsgd_jax._src import capture_nnx as capture_nnx_lib

B, T, F, H = 2, 5, 4, 8
X = jax.random.normal(jax.random.PRNGKey(0), (B, T, F))


# ------------------------------------------------------------------------------------------ stand-ins


def _layers():
  rngs = nnx.Rngs(0)
  return {
      nnx.Linear: (nnx.Linear(F, 3, rngs=rngs), jnp.ones((2, F))),
      nnx.Conv: (nnx.Conv(F, 3, (2,), rngs=rngs), jnp.ones((1, 5, F))),
      nnx.ConvTranspose: (nnx.ConvTranspose(F, 3, (2,), rngs=rngs), jnp.ones((1, 5, F))),
      nnx.LinearGeneral: (nnx.LinearGeneral(F, 3, rngs=rngs), jnp.ones((2, F))),
      nnx.Einsum: (nnx.Einsum("bf,fo->bo", (F, 3), rngs=rngs), jnp.ones((2, F))),
      nnx.Embed: (nnx.Embed(7, F, rngs=rngs), jnp.ones((2,), jnp.int32)),
      nnx.RNN: (nnx.RNN(nnx.SimpleCell(F, H, rngs=rngs)), X),
  }


def _every_argument(method, x):
  """Each parameter of ``method`` after ``self`` by name: the input ``x``, the others at their defaults."""
  params = list(inspect.signature(method).parameters.values())[1:]
  return {p.name: x if i == 0 else (None if p.default is p.empty else p.default) for i, p in enumerate(params)}


def test_every_stand_in_keeps_its_originals_signature_and_forwards_every_argument(monkeypatch):
  calls = []

  def recorder(orig):
    @functools.wraps(orig)
    def record(self, *args, **kwargs):
      calls.append((args, kwargs))
      return jnp.zeros(())
    return record

  layers = _layers()
  cap = captured_lib.Capture(captured_lib.NNX_HELPER)
  originals = {}
  for (cls, name) in capture_nnx_lib.stand_ins(cap, {}):
    originals[cls, name] = getattr(cls, name)
    monkeypatch.setattr(cls, name, recorder(getattr(cls, name)))
  stand_ins = capture_nnx_lib.stand_ins(cap, {})
  assert {cls for cls, _ in stand_ins} >= set(layers) and (nnx.Embed, "attend") in stand_ins
  for (cls, name), stand_in in stand_ins.items():
    layer, x = layers[cls]
    assert inspect.signature(stand_in) == inspect.signature(originals[cls, name]), (cls, name)
    kwargs = _every_argument(originals[cls, name], x)
    nnx.capture(lambda m: stand_in(m, **kwargs), capture_nnx_lib.LayerInput)(layer)
    assert calls[-1] == ((), kwargs), (cls, name)  # every argument, by name, as given


class TiedOutSharding(nnx.Module):
  """Flax's Gemma example's decoder: the logits from ``attend`` with its ``out_sharding``."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 8, rngs=rngs)
    self.mid = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(self.mid(self.embed(ids)), out_sharding=None)


def test_a_tied_table_read_with_out_sharding_trains_through_the_recipe_and_zero_config():
  ids = jnp.arange(12).reshape(2, 6) % 11
  for input_axes in (sk.input_axes_nnx(TiedOutSharding(nnx.Rngs(0)), ids), None):
    model = TiedOutSharding(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, sk.scsgd(0.05, sk.Conditioning(input_axes=input_axes)), wrt=nnx.Param)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      losses = [float(_nnx_step(model, optimizer, ids, ids, i)) for i in range(15)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    said = [str(w.message) for w in caught if "embed/embedding (not conditioned: a tied table" in str(w.message)]
    if input_axes is None:  # init could not know: the first update says it, once
      assert len(said) == 1, said
    else:  # the recipe planned it plain at init
      assert not said and sk.plans(optimizer.opt_state)["embed/embedding"].startswith("not conditioned: a tied")


@nnx.jit
def _nnx_step(model, optimizer, x, y, seed):
  def loss_fn(model):
    logits, layer_inputs = sk.capture_nnx(model, x, rng=jax.random.PRNGKey(seed))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), layer_inputs
  (loss, layer_inputs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads, layer_inputs=layer_inputs)
  return loss


class Interrupted(nnx.Module):
  def __init__(self, error, rngs):
    self.error, self.a = error, nnx.Linear(F, F, rngs=rngs)
    self.rnn = nnx.RNN(nnx.SimpleCell(F, H, rngs=rngs))

  def __call__(self, x):
    self.rnn(self.a(x))
    raise self.error


class LinenInterrupted(nn.Module):
  error: type = None

  @nn.compact
  def __call__(self, x):
    y = nn.RNN(nn.SimpleCell(H))(nn.Dense(F)(x))
    if self.error is not None:
      raise self.error
    return y


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_every_patched_method_is_restored_after_an_exception_inside_the_model(error):
  before = {(cls, name): cls.__dict__.get(name) for cls, name in capture_nnx_lib.stand_ins(
      captured_lib.Capture(captured_lib.NNX_HELPER), {})}
  model = Interrupted(error, nnx.Rngs(0))
  with pytest.raises(error):
    sk.capture_nnx(model, X)
  assert {(cls, name): cls.__dict__.get(name) for cls, name in before} == before
  assert not [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and "_scsgd_jax_path" in vars(m)]
  assert not captured_lib._ACTIVE
  variables = LinenInterrupted().init(jax.random.PRNGKey(0), X)
  with pytest.raises(error):
    sk.capture_linen(LinenInterrupted(error), variables, X)
  assert not captured_lib._ACTIVE
  _, li = sk.capture_linen(LinenInterrupted(), variables, X)  # the next capture runs as if nothing happened
  assert sorted(captured_lib.flat(li)) == ["Dense_0/kernel", "SimpleCell_0/h/kernel", "SimpleCell_0/i/kernel"]


# ------------------------------------------------------------------------------------------ recurrent cells


def _cell_inputs(cell, xs, carry):
  """``(input rows, hidden rows)`` the cell's kernels read, the cell stepped by hand over ``xs`` (``(B, T, F)``)."""
  inputs, hidden = [], []
  for t in range(xs.shape[1]):
    hidden.append(carry[1] if isinstance(carry, tuple) else carry)
    inputs.append(xs[:, t])
    carry, _ = cell(carry, xs[:, t])
  return np.concatenate(inputs), np.concatenate(hidden)


def _gram(rows):
  rows = np.asarray(rows, np.float64).reshape(-1, np.shape(rows)[-1])
  return rows.shape[0], rows.T @ rows


def _assert_same_rows(got, want):
  (m_got, c_got), (m_want, c_want) = _gram(got), _gram(want)
  assert m_got == m_want
  np.testing.assert_allclose(c_got, c_want, rtol=1e-5, atol=1e-5)


NNX_CELLS = {"lstm": nnx.LSTMCell, "optimized_lstm": nnx.OptimizedLSTMCell, "gru": nnx.GRUCell,
             "simple": nnx.SimpleCell}
# which kernels read the cell's input, the rest its hidden state
NNX_INPUT_KERNELS = {"lstm": ("ii", "if_", "ig", "io"), "optimized_lstm": ("dense_i",), "gru": ("dense_i",),
                     "simple": ("dense_i",)}


@pytest.mark.parametrize("kind", sorted(NNX_CELLS))
def test_nnx_rnn_cells_rows_are_every_step_s_inputs_and_hidden_states(kind):
  cell = NNX_CELLS[kind](F, H, rngs=nnx.Rngs(0))
  model = nnx.RNN(cell)
  _, li = sk.capture_nnx(model, X, max_rows=None)
  inputs, hidden = _cell_inputs(cell, X, cell.initialize_carry((B, F), nnx.Rngs(1)))
  kernels = {p: rows for p, rows in captured_lib.flat(li).items()}
  assert kernels and all(p.startswith("cell/") for p in kernels)
  for path, rows in kernels.items():
    _assert_same_rows(rows, inputs if path.split("/")[1] in NNX_INPUT_KERNELS[kind] else hidden)
  axes = sk.input_axes_nnx(model, X)
  assert set(axes) == set(kernels) and all(isinstance(a, sk.Layout) and a.stack == 0 for a in axes.values())


def test_nnx_bidirectional_rows_are_each_direction_s_own():
  rngs = nnx.Rngs(0)
  model = nnx.Bidirectional(nnx.RNN(nnx.GRUCell(F, H, rngs=rngs)), nnx.RNN(nnx.GRUCell(F, H, rngs=rngs)))
  _, li = sk.capture_nnx(model, X, max_rows=None)
  kernels = captured_lib.flat(li)
  for direction, xs in (("forward_rnn", X), ("backward_rnn", X[:, ::-1])):
    cell = getattr(model, direction).cell
    inputs, hidden = _cell_inputs(cell, xs, cell.initialize_carry((B, F), nnx.Rngs(1)))
    _assert_same_rows(kernels[f"{direction}/cell/dense_i/kernel"], inputs)
    _assert_same_rows(kernels[f"{direction}/cell/dense_h/kernel"], hidden)
  assert set(sk.input_axes_nnx(model, X)) == set(kernels) and len(kernels) == 4


LINEN_CELLS = {"lstm": nn.LSTMCell, "optimized_lstm": nn.OptimizedLSTMCell, "gru": nn.GRUCell,
               "simple": nn.SimpleCell}


@pytest.mark.parametrize("kind", sorted(LINEN_CELLS))
@pytest.mark.parametrize("bidirectional", [False, True])
def test_linen_rnn_cells_rows_are_every_step_s_inputs_and_hidden_states(kind, bidirectional):
  make = lambda: nn.RNN(LINEN_CELLS[kind](H))
  model = nn.Bidirectional(make(), make()) if bidirectional else make()
  variables = model.init(jax.random.PRNGKey(0), X)
  _, li = sk.capture_linen(model, variables, X, max_rows=None)
  kernels = captured_lib.flat(li)
  directions = {"forward_rnn": X, "backward_rnn": X[:, ::-1]} if bidirectional else {"": X}
  for prefix, xs in directions.items():
    cell = LINEN_CELLS[kind](H)
    params = variables["params"][prefix]["cell"] if prefix else variables["params"]["cell"]
    step = lambda carry, x: cell.apply({"params": params}, carry, x)
    inputs, hidden = _cell_inputs(step, xs, cell.initialize_carry(jax.random.PRNGKey(0), (B, F)))
    mine = {p: r for p, r in kernels.items() if p.startswith(f"{prefix}/cell/" if prefix else "cell/")}
    assert set(mine) == {f"{prefix + '/' if prefix else ''}cell/{k}/kernel" for k in params}
    for path, rows in mine.items():
      _assert_same_rows(rows, inputs if path.split("/")[-2].startswith("i") else hidden)
  assert set(sk.input_axes_linen(model, variables, X)) == set(kernels)


class NNXLSTMModel(nnx.Module):
  def __init__(self, rngs):
    self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(F, H, rngs=rngs))
    self.head = nnx.Linear(H, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(x))


class LinenLSTMModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.RNN(nn.OptimizedLSTMCell(H))(x))


LABELS = jnp.arange(B * T).reshape(B, T) % 3


@pytest.mark.parametrize("recipe", [True, False], ids=["recipe", "zero_config"])
def test_a_recurrent_model_trains_through_the_recipe_and_zero_config_and_the_plans_agree(recipe):
  model = NNXLSTMModel(nnx.Rngs(0))
  axes = sk.input_axes_nnx(model, X)
  optimizer = nnx.Optimizer(model, sk.scsgd(0.1, sk.Conditioning(input_axes=axes if recipe else None)), wrt=nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every kernel read: nothing to say
    losses = [float(_nnx_step(model, optimizer, X, LABELS, i)) for i in range(20)]
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
  conditioned = {p for p, why in sk.plans(optimizer.opt_state).items() if not why.startswith("not conditioned")}
  assert conditioned == set(axes) == {"rnn/cell/dense_i/kernel", "rnn/cell/dense_h/kernel", "head/kernel"}

  linen = LinenLSTMModel()
  variables = linen.init(jax.random.PRNGKey(0), X)
  axes = sk.input_axes_linen(linen, variables, X)
  tx = sk.scsgd(0.1, sk.Conditioning(input_axes=axes if recipe else None))
  params, state = variables["params"], tx.init(variables["params"])
  for i in range(20):
    params, state, loss = _linen_step(linen, tx, params, state, i)
  assert np.isfinite(loss) and loss < losses[0]
  conditioned = {p for p, why in sk.plans(state).items() if not why.startswith("not conditioned")}
  assert conditioned == {p for p, a in axes.items() if isinstance(a, sk.Layout)} and len(conditioned) == 9


@functools.partial(jax.jit, static_argnums=(0, 1))
def _linen_step(model, tx, params, state, seed):
  def loss_fn(p):
    logits, li = sk.capture_linen(model, {"params": p}, X, rng=jax.random.PRNGKey(seed))
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean(), li
  (loss, li), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, state = tx.update(grads, state, params, layer_inputs=li)
  return optax.apply_updates(params, updates), state, loss


# ------------------------------------------------------------------------------------------ the row budget


class CalledOften(nnx.Module):
  def __init__(self, rngs):
    self.cell = nnx.Linear(F, F, rngs=rngs)

  def __call__(self, x):
    for _ in range(48):
      x = jnp.tanh(self.cell(x))
    return x


def test_max_rows_caps_a_layer_s_rows_per_step_across_its_calls_each_a_row_it_read():
  x = jax.random.normal(jax.random.PRNGKey(1), (32, F))
  model = CalledOften(nnx.Rngs(0))
  _, li = sk.capture_nnx(model, x, rng=jax.random.PRNGKey(0), max_rows=256)
  rows = np.asarray(li["cell"]["kernel"])
  assert rows.shape == (256, F)  # 48 calls of 32 rows: 1,536 rows read, 256 kept
  _, every = sk.capture_nnx(model, x, max_rows=None)
  read = np.asarray(every["cell"]["kernel"])
  assert read.shape == (48 * 32, F)
  assert all(np.abs(read - r).max(axis=1).min() < 1e-6 for r in rows)


# ------------------------------------------------------------------------------------------ raw parameters


E, D, HID = 4, 16, 32
EXPERTS = sk.Layout((0,), stack=1)


class MoE(nnx.Module):
  """A mixture of experts' MLP whose weights are raw parameters used with ``jnp.einsum``, every expert dense."""

  def __init__(self, rngs):
    self.router = nnx.Linear(D, E, rngs=rngs)
    self.w_in = nnx.Param(jax.random.normal(rngs.params(), (E, D, HID)) / D**0.5)
    self.w_out = nnx.Param(jax.random.normal(rngs.params(), (E, HID, D)) / HID**0.5)

  def __call__(self, x):
    gate = jax.nn.softmax(self.router(x), axis=-1)
    h = jax.nn.gelu(jnp.einsum("td,edh->eth", x, self.w_in[...]))
    sk.sow_rows(self, "w_in", jnp.broadcast_to(x, (E, *x.shape)), EXPERTS)
    sk.sow_rows(self, "w_out", h, EXPERTS)
    return jnp.einsum("eth,ehd,te->td", h, self.w_out[...], gate)


class MoEModel(nnx.Module):
  def __init__(self, rngs):
    self.inp, self.moe, self.head = nnx.Linear(3, D, rngs=rngs), MoE(rngs), nnx.Linear(D, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.moe(self.inp(x)))


XM = jax.random.normal(jax.random.PRNGKey(2), (24, 3))


def test_sow_rows_hands_the_capture_exactly_the_rows_and_layout_and_outside_a_capture_does_nothing():
  model = MoEModel(nnx.Rngs(0))
  _, li = sk.capture_nnx(model, XM, max_rows=None)
  x = model.inp(XM)
  np.testing.assert_allclose(li["moe"]["w_in"], np.broadcast_to(x, (E, *x.shape)), rtol=1e-6)
  assert li.input_axes["moe/w_in"] == EXPERTS == sk.input_axes_nnx(model, XM)["moe/w_out"]
  before = nnx.state(model)
  model(XM)
  assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(before)


def _aliases():
  return {
      "scsgd": lambda **k: sk.scsgd(0.1, sk.Conditioning(**k)),
      "scsgd_eigen": lambda **k: sk.scsgd_eigen(1e-3, sk.Conditioning(**k)),
      "scsgd_eigen_muon": lambda **k: sk.scsgd_eigen_muon(0.02, sk.Conditioning(**k), output_layer="head"),
      "scsgd_two_sided": lambda **k: sk.contrib.scsgd_two_sided(1e-3, sk.Conditioning(**k)),
      "scale_by_sketched_conditioning": lambda **k: sk.scale_by_sketched_conditioning(sk.Conditioning(**k)),
      "scale_by_eigenbasis_adam": lambda **k: sk.scale_by_eigenbasis_adam(sk.Conditioning(**k)),
  }


@pytest.mark.parametrize("alias", sorted(_aliases()))
def test_every_alias_honours_input_axes_naming_a_raw_parameter_and_kernel_filter_alike(alias):
  build = _aliases()[alias]
  params = nnx.state(MoEModel(nnx.Rngs(0)), nnx.Param)
  dense = dict(statistics=sk.Statistics(kind="dense"))
  named = sk.plans(jax.eval_shape(build(input_axes={"moe/w_in": EXPERTS}, **dense).init, params))
  assert named["moe/w_in"].split(" | ")[0].startswith("dense C") and "stack (4,)" in named["moe/w_in"], named
  assert named["moe/w_out"].startswith("not conditioned: a raw parameter"), named
  kept = lambda path, leaf: path in ("moe/w_in", "inp/kernel")
  filtered = sk.plans(jax.eval_shape(build(input_axes={"moe/w_in": EXPERTS}, kernel_filter=kept, **dense).init,
                                     params))
  assert {p for p, why in filtered.items() if not why.startswith("not conditioned")} == {"moe/w_in", "inp/kernel"}


@pytest.mark.parametrize("alias", sorted(_aliases()))
def test_plans_say_what_every_float_leaf_gets_and_init_names_raw_parameters_once(alias):
  params = nnx.state(MoEModel(nnx.Rngs(0)), nnx.Param)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = _aliases()[alias]().init(params)
  raw = [str(w.message) for w in caught if "raw parameter" in str(w.message)]
  assert len(raw) == 1 and "moe/w_in, moe/w_out" in raw[0] and "sow_rows" in raw[0] and "input_axes" in raw[0]
  leaves = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(params)}
  assert set(sk.plans(state)) == leaves


def test_a_model_with_raw_parameters_trains_through_the_recipe_and_zero_config():
  for input_axes in (sk.input_axes_nnx(MoEModel(nnx.Rngs(0)), XM), None):
    model = MoEModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, sk.scsgd(0.05, sk.Conditioning(input_axes=input_axes)), wrt=nnx.Param)
    y = jnp.arange(24) % 3
    losses = [float(_nnx_step(model, optimizer, XM, y, i)) for i in range(20)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    plans = sk.plans(optimizer.opt_state)
    assert plans["moe/w_in"].startswith("not conditioned" if input_axes is None else "dense C"), plans


# ------------------------------------------------------------------------------------------ messages


class LinenDepthwise(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.Conv(4, (3, 3), feature_group_count=4)(x).reshape(x.shape[0], -1))


def test_a_refused_layout_in_a_linen_model_names_the_linen_helper():
  model, x = LinenDepthwise(), jnp.ones((2, 5, 5, 4))
  variables = model.init(jax.random.PRNGKey(0), x)
  tx = sk.scsgd(0.1)
  state = tx.init(variables["params"])
  _, li = sk.capture_linen(model, variables, x)
  with pytest.warns(UserWarning, match=re.escape("input_axes=scsgd_jax.input_axes_linen(module, variables, x)")
                    ) as said:
    tx.update(variables["params"], state, variables["params"], layer_inputs=li)
  assert not any("input_axes_nnx" in str(w.message) for w in said if "plain updates" in str(w.message))


@pytest.mark.parametrize("alias,gets", [("scsgd", "Nesterov SGD"), ("scsgd_eigen", "AdamW"),
                                        ("scsgd_eigen_muon", "Muon's AdamW part")])
def test_the_nothing_conditioned_warning_says_what_plain_leaves_get_under_each_alias(alias, gets):
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  build = {"scsgd": sk.scsgd, "scsgd_eigen": sk.scsgd_eigen, "scsgd_eigen_muon": sk.scsgd_eigen_muon}[alias]
  with pytest.warns(UserWarning, match=re.escape(gets)):
    build(0.01).init(params)
