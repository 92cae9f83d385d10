"""Models that are not Flax's (an Equinox MLP with ``(out, in)`` weights, a plain dict of arrays), against the dense
oracle; and the choices that used to pass silently: a head name no kernel has, a model none of whose leaves is
conditioned, an argument the eigenbasis would ignore."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scsgd_jax as sk
from tests import helpers
from tests.helpers import kernel_lines

# C of the latest batch alone, refreshed every step, the full C^{-1/2} without a floor: an exact oracle
EXACT = dict(statistics=sk.Statistics(kind="dense", ema_rate=1.0, fold_every=1, outlier_threshold=float("inf")),
             refresh=sk.Refresh(every=1, warm_start=False),
             conditioner=sk.Conditioner(kind="full", eigenvalue_floor=0.0))


def test_equinox_mlp_with_out_in_weights_equals_the_dense_oracle():
  """The README's Equinox recipe: each ``(out, in)`` weight named by its path with ``Layout(input_axes=(1,))``,
  its inputs passed at that path: the update is ``G C^{-1/2}`` (``C`` the inputs' correlation), the bias plain."""
  import equinox as eqx

  mlp = eqx.nn.MLP(6, 3, width_size=5, depth=1, key=jax.random.PRNGKey(0))
  params = eqx.filter(mlp, eqx.is_array)
  axes = {"layers/0/weight": sk.Layout(input_axes=(1,)), "layers/1/weight": sk.Layout(input_axes=(1,))}
  tx = sk.scale_by_sketched_conditioning(sk.Conditioning(input_axes=axes, **EXACT))
  state = tx.init(params)
  assert set(kernel_lines(state.summary())) == set(axes), state.summary()

  x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 6)) * np.linspace(0.3, 3.0, 6), jnp.float32)

  def loss(params):
    model = eqx.combine(params, mlp)
    hidden = jax.vmap(model.layers[0])(x)
    inputs = {"layers/0/weight": x, "layers/1/weight": model.activation(hidden)}
    return jnp.sum(jax.vmap(model.layers[1])(inputs["layers/1/weight"]) ** 2), inputs

  (_, inputs), grads = eqx.filter_value_and_grad(loss, has_aux=True)(params)
  updates, _ = tx.update(grads, state, params, layer_inputs=inputs)
  for i, rows in ((0, x), (1, inputs["layers/1/weight"])):
    c = np.asarray(rows, np.float64).T @ np.asarray(rows, np.float64) / rows.shape[0]
    want = np.asarray(grads.layers[i].weight, np.float64) @ helpers.psd_power(c, -0.5)
    np.testing.assert_allclose(updates.layers[i].weight, want, rtol=2e-3, atol=1e-5)
    np.testing.assert_array_equal(updates.layers[i].bias, grads.layers[i].bias)


def test_plain_dict_takes_inputs_nested_as_the_parameters_or_flat_by_path():
  """A plain dict ``{'l1': {'w': (in, out)}}``: ``input_axes`` names the kernel, and its inputs may sit at its path
  nested as the parameters or under the flat path string: the same update, the dense oracle's ``C^{-1/2} G``."""
  rng = np.random.default_rng(1)
  params = {"l1": {"w": jnp.zeros((4, 2))}}
  tx = sk.scale_by_sketched_conditioning(sk.Conditioning(input_axes={"l1/w": (0,)}, **EXACT))
  x = jnp.asarray(rng.standard_normal((16, 4)) * np.linspace(0.5, 2.0, 4), jnp.float32)
  g = {"l1": {"w": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)}}
  nested, _ = tx.update(g, tx.init(params), params, layer_inputs={"l1": {"w": x}})
  flat, _ = tx.update(g, tx.init(params), params, layer_inputs={"l1/w": x})
  np.testing.assert_array_equal(nested["l1"]["w"], flat["l1"]["w"])
  c = np.asarray(x, np.float64).T @ np.asarray(x, np.float64) / 16
  np.testing.assert_allclose(nested["l1"]["w"], helpers.psd_power(c, -0.5) @ np.asarray(g["l1"]["w"]),
                             rtol=2e-3, atol=1e-5)


def test_a_model_with_no_conditioned_leaf_is_warned_at_init_naming_what_the_filter_saw():
  params = {"layers": [{"weight": jnp.zeros((5, 4)), "bias": jnp.zeros(5)}]}
  with pytest.warns(UserWarning, match=r"no leaf is conditioned.*'layers/0/weight'.*input_axes="):
    sk.scsgd(0.1).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a model with a conditioned kernel: no warning
    sk.scsgd(0.1).init({"dense": {"kernel": jnp.zeros((4, 3))}})


def test_output_layer_that_matches_no_kernel_is_refused_naming_the_kernels():
  params = {"body": {"kernel": jnp.zeros((4, 4))}, "head": {"kernel": jnp.zeros((4, 2))}}
  with pytest.raises(ValueError, match=r"output_layer='haed' is in no kernel's path.*'body/kernel', 'head/kernel'"):
    sk.scsgd_eigen_muon(0.02, output_layer="haed").init(params)
  sk.scsgd_eigen_muon(0.02, output_layer="head").init(params)


@pytest.mark.parametrize("name,value", [("eigenvalue_floor", 0.1), ("normalize", "all")])
def test_eigenbasis_refuses_arguments_that_reach_only_the_eigenvalues(name, value):
  """The eigenbasis reads the conditioner's eigenvectors; a floor or a normalization of its eigenvalues would change
  nothing: refused by every alias built on it, naming the setting."""
  conditioner = sk.Conditioner(**{name: value})
  for make in (sk.scsgd_eigen, sk.scsgd_eigen_muon):
    with pytest.raises(TypeError, match=rf"Conditioner\({name}=.*eigenvalues only"):
      make(1e-3, sk.Conditioning(conditioner=conditioner))
  with pytest.raises(TypeError, match=rf"Conditioner\({name}="):
    sk.scale_by_eigenbasis_adam(sk.Conditioning(conditioner=conditioner))
  optax.chain(sk.scale_by_sketched_conditioning(sk.Conditioning(conditioner=conditioner)),
              optax.adamw(1e-3))  # where it acts: taken


def test_a_rank_the_memory_rule_cuts_is_said_in_the_summary():
  """rank=1000 on 24-wide layers: the memory rule plans a lower rank, and the summary says it was cut."""
  params = {"a": {"kernel": jnp.zeros((24, 24))}}
  summary = sk.scsgd(0.1, sk.Conditioning(rank=1000)).init(params)[0].summary()
  assert summary["a/kernel"].endswith("rank 1000 asked: cut by the memory rule"), summary


def test_options_a_custom_statistics_object_does_not_read_are_refused():
  """A CorrelationStatistics carries its own rate, sketch, prior and floor: given as a Statistics' kind, the rate,
  sketch and memory rule beside it are refused, naming them, and so is a Conditioner's floor; the fold period, the
  outlier guard and the refresh schedule act (an oracle below: one fold in three)."""
  custom = sk.sketch.ema_correlation(0.1)
  for name, value in (("ema_rate", 0.2), ("oversample", 4), ("power_iterations", 2), ("budget", "kernel")):
    with pytest.raises(ValueError, match=re.escape(f"does not read {{'{name}': {value!r}}}")):
      sk.Statistics(kind=custom, **{name: value})
  with pytest.raises(ValueError, match=re.escape("['Conditioner.eigenvalue_floor'] would do nothing")):
    sk.scsgd(0.1, sk.Conditioning(statistics=custom, conditioner=sk.Conditioner(eigenvalue_floor=0.1)))
  sk.scsgd(0.1, sk.Conditioning(statistics=custom, refresh=sk.Refresh(warm_start=False)))
  for bad, arg in (("dense", "statistics"), ({"every": 3}, "refresh"), ("full", "conditioner")):
    with pytest.raises(TypeError, match=rf"^{arg} must be a scsgd_jax\."):
      sk.Conditioning(**{arg: bad})
  # the fold period acts on a custom statistics: folded every third step it holds step 0's rows alone (the custom
  # EMA at rate 1/2 from its identity prior: (I + x^T x / 3) / 2 for three rows x), every step it mixes in the rest
  params = {"d": {"kernel": jnp.zeros((4, 2))}}
  x = jnp.arange(12.0).reshape(3, 4)
  held = {}
  for every in (1, 3):
    tx = sk.scale_by_sketched_conditioning(
        sk.Conditioning(statistics=sk.Statistics(kind=sk.sketch.ema_correlation(0.5), fold_every=every),
                        conditioner=sk.Conditioner(kind="full")))
    state = tx.init(params)
    for t in range(3):
      _, state = tx.update(params, state, params, layer_inputs={"d": {"kernel": (t + 1.0) * x}})
    held[every] = np.asarray(state.statistics["d/kernel"].moments)
  np.testing.assert_allclose(held[3], (np.eye(4) + np.asarray(x.T @ x) / 3) / 2, rtol=1e-5)
  assert not np.allclose(held[1], held[3], rtol=1e-3)


@pytest.mark.parametrize("make,unread", [
    (lambda: sk.Statistics(kind="diagonal", oversample=4), "{'oversample': 4}"),
    (lambda: sk.Statistics(kind="streaming", power_iterations=2), "{'power_iterations': 2}"),
    (lambda: sk.Statistics(kind="dense", budget="kernel"), "{'budget': 'kernel'}"),
    (lambda: sk.Conditioner(kind="sketched", full_max_dim=64), "{'full_max_dim': 64}"),
    (lambda: sk.scsgd(
        0.1,
        sk.Conditioning(statistics=sk.Statistics(kind="dense", oversample=4), conditioner=sk.Conditioner(kind="full"))),
     "{'Statistics.oversample': 4}"),
])
def test_each_option_refuses_a_setting_its_choice_does_not_read(make, unread):
  with pytest.raises(ValueError, match=re.escape(f"does not read {unread}: leave it out")):
    make()


def test_options_that_cannot_run_together_are_refused_and_defaults_resolve_in_one_place():
  for kind in ("streaming", "diagonal"):
    with pytest.raises(ValueError, match=r"Conditioner\(kind='full'\) needs the dense C"):
      sk.scsgd(0.1, sk.Conditioning(statistics=sk.Statistics(kind=kind), conditioner=sk.Conditioner(kind="full")))
  assert sk.Statistics().resolved() == dict(kind="auto",
                                            ema_rate=0.05,
                                            fold_every=2,
                                            outlier_threshold=100.0,
                                            oversample=10,
                                            power_iterations=1,
                                            budget="model")
  assert sk.Refresh().resolved() == dict(every=50, stagger=True, warm_start=True, apart=False)
  assert sk.Conditioner().resolved(8) == dict(kind="auto",
                                              full_max_dim=32,
                                              eigenvalue_floor=0.01,
                                              normalize="embeddings",
                                              rank=8)
  assert sk.Conditioner().resolved()["rank"] == 32
