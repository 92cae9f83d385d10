"""The state is fixed at ``init``: for every layer kind a user writes and every alias, the state after updates has
``init``'s structure, shapes and dtypes, and restores into a freshly built optimizer; without ``input_axes`` a layout
``init`` could not read from the parameters is stepped plainly from the first update, which names the kernel and the
fix; with them, a layer that contradicts the plans is refused."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax import serialization

import scsgd_jax as sk
from tests.library import test_layers, test_recipes, test_stacks

# the library's aliases at a rate; two-sided reads the output gradients. The eigenbasis keeps moments beside the
# statistics, which these small kernels cannot afford under the memory rule: fixed streaming statistics at rank 2
SMALL = dict(rank=2, statistics=sk.Statistics(kind="streaming"))
ALIASES = {
    "scsgd": (lambda axes: sk.scsgd(0.05, sk.Conditioning(input_axes=axes)), False),
    "scsgd_eigen": (lambda axes: sk.scsgd_eigen(1e-3, sk.Conditioning(input_axes=axes, **SMALL)), False),
    "scsgd_eigen_muon": (lambda axes: sk.scsgd_eigen_muon(1e-3, sk.Conditioning(input_axes=axes, **SMALL)), False),
    "scsgd_eigen_both_sides":
        (lambda axes: sk.scsgd_eigen(1e-3, sk.Conditioning(input_axes=axes, **SMALL), sides="both", basis="gradients"),
         False),
    "scsgd_eigen_muon_both_sides": (lambda axes: sk.scsgd_eigen_muon(
        1e-3, sk.Conditioning(input_axes=axes, **SMALL), sides="both", basis="gradients"), False),
    "scsgd_two_sided": (lambda axes: sk.contrib.scsgd_two_sided(1e-3, sk.Conditioning(input_axes=axes)), True),
}
IMAGES = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)), jnp.float32)
IDS = test_stacks.IDS
MEAN_SQUARE = lambda out: jnp.mean(jnp.square(out))


class DenseNet(nnx.Module):
  def __init__(self, rngs):
    self.l1, self.l2 = nnx.Linear(192, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x.reshape(x.shape[0], -1))))


class EveryLayer(nnx.Module):
  """Every layer kind a user writes, in one model: Dense; Conv, depthwise Conv, ConvTranspose; Einsum,
  LinearGeneral (DenseGeneral), Embed; an nnx.scan stack; an nnx.vmap ensemble."""

  def __init__(self, rngs):
    self.dense, self.convs = DenseNet(rngs), test_layers._Mixed(rngs)
    self.einsums, self.scan = test_recipes.GemmaStyle(rngs), test_stacks.ScannedLM(rngs)
    self.ensemble = test_stacks.Ensemble(rngs)

  def __call__(self, images, ids):
    return (MEAN_SQUARE(self.dense(images)) + MEAN_SQUARE(self.convs(images)) + MEAN_SQUARE(self.einsums(ids))
            + test_stacks._loss(self.scan(ids)) + MEAN_SQUARE(self.ensemble(self.einsums.embed(ids).mean(1))))


@functools.lru_cache(maxsize=None)
def _model():  # only read: each step merges the parameters into a model of its own
  return EveryLayer(nnx.Rngs(0))


def _updated(alias, updates=3, told=True, shared=False):
  """``(tx, params, f)``: ``f(params)`` is the state after ``updates`` of the README's step (capture, gradients,
  update, apply) on a fresh :class:`EveryLayer` under ``alias``, traced (``jax.eval_shape`` of it compiles nothing)."""
  model = _model()
  make, two_sided = ALIASES[alias]
  tx = make((sk.input_axes_nnx(model, IMAGES, IDS) if shared else sk.input_axes_nnx(model)) if told else None)
  graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
  merged = lambda p: nnx.merge(graphdef, nnx.State(p))

  def run(params):
    state = tx.init(params)
    for _ in range(updates):
      loss_fn = lambda p, perturbations: sk.capture_nnx(merged(p), IMAGES, IDS, max_rows=None,
                                                        output_perturbations=perturbations)
      perturbations = sk.contrib.output_perturbations_nnx(merged(params), IMAGES, IDS) if two_sided else None
      (_, inputs), (grads, deltas) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, perturbations)
      updates_, state = tx.update(grads, state, params, layer_inputs=inputs,
                                  **({"output_grads": deltas} if two_sided else {}))
      params = optax.apply_updates(params, updates_)
    return state

  return tx, params, run


def _layout(tree):
  return [(jax.tree_util.keystr(p), np.shape(v), np.result_type(v)) for p, v in jax.tree_util.tree_leaves_with_path(tree)]


def _summary_after_updates_as_at_init(alias, **kwargs):
  """``(tx, params, summary)`` of :func:`_updated`, having checked that the state after its updates has ``init``'s
  structure, shapes and dtypes; ``summary``: the conditioning's plans."""
  tx, params, run = _updated(alias, **kwargs)
  fresh, after = jax.eval_shape(tx.init, params), jax.eval_shape(run, params)
  assert jax.tree.structure(after) == jax.tree.structure(fresh)
  assert _layout(after) == _layout(fresh)
  conditioning = next(s for s in jax.tree.leaves(fresh, is_leaf=lambda x: hasattr(x, "summary")) if hasattr(
      s, "summary"))
  return tx, params, getattr(conditioning, "conditioning", conditioning).summary()


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_state_after_updates_has_inits_layout_and_restores_into_a_fresh_optimizer(alias):
  """Every layer kind, every alias: the state after 3 updates has ``init``'s structure, shapes and dtypes (so a
  checkpoint of it restores into the state of a freshly built optimizer), and every kind of kernel is planned."""
  tx, params, summary = _summary_after_updates_as_at_init(alias)
  kernels = ["dense/l1/kernel", "convs/conv/kernel", "convs/dw/kernel", "einsums/q/kernel", "einsums/kv/kernel",
             "scan/blocks/up/kernel", "ensemble/members/l1/kernel"]
  if alias.startswith("scsgd_eigen_muon"):  # Muon's filter leaves a grouped conv to the AdamW part
    kernels.remove("convs/dw/kernel")
    assert summary["convs/dw/kernel"] == "not conditioned: excluded by kernel_filter"
  for kernel in kernels:
    assert not summary[kernel].startswith("not conditioned"), (kernel, summary[kernel])
  assert summary["convs/up/kernel"].startswith("not conditioned")  # the transposed conv: plain, and said
  # a msgpack checkpoint restores into a freshly built optimizer's state (the template every restore uses)
  state = tx.init(params)
  restored = serialization.from_bytes(_updated(alias)[0].init(params), serialization.to_bytes(state))
  jax.tree.map(np.testing.assert_array_equal, restored, state)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_shared_statistics_keep_inits_layout(alias):
  """Every layer kind, every alias, with the kernels that read one array sharing its statistics (the scanned
  attention's query, key and value, per slice): the state after 3 updates has ``init``'s layout."""
  _, _, summary = _summary_after_updates_as_at_init(alias, shared=True)
  assert summary["scan/blocks/attn/value/kernel"].endswith("statistics shared with scan/blocks/attn/query/kernel")


MISREAD = ("convs/dw/kernel", "einsums/q/kernel", "ensemble/members/l1/kernel", "scan/blocks/up/kernel")


def test_without_input_axes_a_layout_init_could_not_read_is_stepped_plainly_and_named():
  """Zero-config never refuses: without ``input_axes``, ``init`` reads a grouped conv, an Einsum, a stack or an
  ensemble by the name-based defaults; the first update, whose capture says the layer's layout, steps each kernel
  it read otherwise plainly (Nesterov SGD on its raw gradient, to the float), says so once naming each and the fix,
  and the plans show it; the state keeps ``init``'s layout."""
  tx, params, run = _updated("scsgd", updates=1, told=False)
  with pytest.warns(UserWarning, match=r"plain updates.*'?convs/dw/kernel.*einsums/q/kernel.*ensemble/members/l1/"
                    r"kernel.*scan/blocks/up/kernel.*input_axes=scsgd_jax.input_axes_nnx\(model, x\)"):
    state = run(params)
  fresh = tx.init(params)
  assert _layout(state) == _layout(fresh)
  plans = sk.plans(state)
  for path in MISREAD:
    assert plans[path].startswith("not conditioned: its layer reads it"), (path, plans[path])
    assert not sk.plans(fresh)[path].startswith("not conditioned"), path  # planned at init
  model = _model()
  grads = nnx.grad(lambda m: sk.capture_nnx(m, IMAGES, IDS, max_rows=None)[0])(model)
  grads = nnx.to_pure_dict(nnx.state(grads, nnx.Param))
  inputs = sk.capture_nnx(model, IMAGES, IDS, max_rows=None)[1]
  with pytest.warns(UserWarning, match="plain updates"):
    updates, _ = tx.update(grads, fresh, params, layer_inputs=inputs)
  path = lambda key: jax.tree_util.keystr(key).replace("']['", "/").strip("[']")
  # Nesterov's first step on the raw gradient, -rate (1 + momentum) g, under scsgd's default step bound
  bound = sk.clip_by_relative_norm(inspect.signature(sk.scsgd).parameters["max_relative_step"].default)
  plain = bound.update(jax.tree.map(lambda g: -0.05 * (1 + 0.9) * g, grads), optax.EmptyState(), params)[0]
  flat_u, flat_g, flat_plain = ({path(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)}
                                for t in (updates, grads, plain))
  for p in MISREAD:
    np.testing.assert_allclose(flat_u[p], flat_plain[p], rtol=1e-6, atol=1e-9)
  assert not np.allclose(flat_u["dense/l1/kernel"], -0.05 * 1.9 * flat_g["dense/l1/kernel"])  # conditioned


def test_a_layout_contradicting_the_input_axes_given_is_refused_naming_each_kernel_and_the_fix():
  """With ``input_axes`` given (here one layer's only), ``init`` plans by it and the defaults; a layer the capture
  reads by another layout than planned is refused at the first update, naming each kernel and the fix."""
  model = _model()
  tx = sk.scsgd(0.05, sk.Conditioning(input_axes={"dense/l1/kernel": (0,)}))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state = tx.init(params)
  loss, inputs = sk.capture_nnx(model, IMAGES, IDS, max_rows=None)
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"fixed at init.*'convs/dw/kernel' .*'einsums/q/kernel' .*'ensemble/members/"
                     r"l1/kernel' .*'scan/blocks/up/kernel' .*input_axes=scsgd_jax.input_axes_nnx\(model, x\)"):
    tx.update(grads, state, params, layer_inputs=inputs)


def test_state_shardings_follow_each_kernels_axes_and_the_parameters():
  """``state_shardings`` from PartitionSpecs (no devices needed): a kernel's dense ``C`` (n, n) sharded as the
  kernel (n's axes, then p's), a streaming sketch (n, l) and factor ``Q`` (n, k) along n, the rotated moments
  (k, p) along p, a stack's statistics along its stack axis; an ``n`` or ``p`` its kernel does not shard along the
  kernel's other axes (tensor parallel, FSDP); momentum as its parameter; the rest replicated."""
  from jax.sharding import PartitionSpec as P
  params = {"a": {"kernel": jnp.ones((16, 64)), "bias": jnp.ones(64)}, "b": {"kernel": jnp.ones((1024, 64))},
            "s": {"kernel": jnp.ones((3, 16, 8))}}
  specs = {"a": {"kernel": P("fsdp", "tp"), "bias": P("tp")}, "b": {"kernel": P("fsdp", None)},
           "s": {"kernel": P("stage", None, "tp")}}
  axes = {"s/kernel": sk.Layout((0,), 1)}
  got = sk.state_shardings(sk.scsgd(0.1, sk.Conditioning(input_axes=axes)), params, specs)
  inner, momentum = got[0], got[1][0].trace
  state = sk.scsgd(0.1, sk.Conditioning(input_axes=axes)).init(params)[0]
  assert state.summary()["a/kernel"].startswith("dense C") and state.summary()["b/kernel"].startswith("streaming")
  assert inner.statistics["a/kernel"].moments == P("fsdp", "tp")
  assert inner.factors["a/kernel"].b_inv == P("fsdp", "tp")
  assert inner.statistics["b/kernel"].omega == P("fsdp", None)
  assert inner.factors["b/kernel"].q == P("fsdp", None) and inner.factors["b/kernel"].b_inv == P(None, None)
  assert inner.statistics["s/kernel"].moments == P("stage", None, "tp")  # (3, 16, 16): stack, n, and n taking p's
  # tensor parallel (a kernel split on p only): the sketch and Q split along n over p's axes, never whole
  tp = sk.state_shardings(sk.scsgd(0.1), {"t": {"kernel": params["b"]["kernel"]}}, {"t": {"kernel": P(None, "tp")}})
  assert tp[0].statistics["t/kernel"].omega == P("tp", None) and tp[0].factors["t/kernel"].q == P("tp", None)
  assert inner.count == P() and inner.key == P() and inner.clipped_rows["a/kernel"] == P()
  assert momentum == specs
  eigen = sk.state_shardings(sk.scsgd_eigen(1e-3, sk.Conditioning(input_axes=axes)), params, specs)[0]
  # Adam's moment of U^T G: (n, p) at full rank, (k, p) sketched, a stack's per slice; b's p, which its kernel does
  # not shard (FSDP), along the kernel's axis that no other dimension took
  assert eigen.moments["a/kernel"].lead == P("fsdp", "tp")
  assert eigen.moments["b/kernel"] == type(eigen.moments["b/kernel"])(P(None, "fsdp"), P("fsdp"), P("fsdp"))
  assert eigen.moments["s/kernel"] == type(eigen.moments["s/kernel"])(P("stage", None, "tp"), P("stage", "tp"),
                                                                      P("stage", "tp"))
  assert eigen.mu == specs


@pytest.mark.parametrize("fields", [("statistics", "factors", "clipped_rows"), ("clipped_rows",)])
def test_a_state_of_an_earlier_format_is_refused_at_the_first_update(fields):
  """A state keeping its statistics, factors or clipped-row counts as ``{kernel path: ...}`` dicts (the formats
  before banks, and before banked counts, as a restored checkpoint of those versions would) is refused in words."""
  params = {"a": {"kernel": jnp.ones((6, 5))}, "b": {"kernel": jnp.ones((6, 3))}}
  tx = sk.scale_by_sketched_conditioning(sk.Conditioning(rank=2))
  state = tx.init(params)
  old = state._replace(**{f: {p: getattr(state, f)[p] for p in getattr(state, f)} for f in fields})
  rows = {k: {"kernel": jnp.ones((4, 6))} for k in params}
  with pytest.raises(ValueError, match="statistics, factors or clipped-row counts per kernel, a format of an earlier"):
    tx.update(jax.tree.map(jnp.ones_like, params), old, params, layer_inputs=rows)
  tx.update(jax.tree.map(jnp.ones_like, params), state, params, layer_inputs=rows)  # the banked state runs
