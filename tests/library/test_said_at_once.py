"""Mistakes a user cannot see are said at once, in one line naming the culprit and the fix: ``input_axes`` keys that
name no parameter, ``Layout`` axes beyond the kernel, an asked rank the plan cuts, the earlier flat keywords, a wrong
sharding tree; and the README's recipes run as written (Linen with BatchNorm and Dropout, returning the loss; the
plans read from any state)."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import scsgd_jax
from tests.helpers import kernel_lines

PARAMS = {"layers": {"0": {"weight": jnp.ones((24, 8)), "kernel": jnp.ones((24, 8))}, "1": {"kernel": jnp.ones((8, 4))}}}


def test_an_input_axes_key_naming_no_parameter_is_refused_with_the_closest_paths():
  with pytest.raises(ValueError, match=r"'layers/0/wieght' \(closest: 'layers/0/weight'"):
    scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(input_axes={"layers/0/wieght": (1,)})).init(PARAMS)


def test_layout_axes_beyond_the_kernel_are_refused_quoting_what_was_passed():
  with pytest.raises(ValueError, match=r"input axes \(5,\) of kernel 'layers/0/kernel' \(24, 8\): each must lie in"):
    scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(input_axes={"layers/0/kernel": scsgd_jax.Layout((5,))})).init(PARAMS)
  scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(input_axes={"layers/0/kernel": scsgd_jax.Layout((-2,))})).init(
      PARAMS)  # in range: taken


def test_an_asked_rank_the_plan_cuts_is_warned_naming_kernel_asked_and_planned():
  params = {"a": {"kernel": jnp.ones((600, 24))}}
  with pytest.warns(UserWarning, match=r"rank=1000 was asked.*a/kernel \(rank \d+, n=600: the memory rule\)"):
    scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(rank=1000)).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    scsgd_jax.scsgd(0.1).init(params)  # the default rank, cut or not, is no mistake of the user's


@pytest.mark.parametrize("build", [scsgd_jax.scsgd, scsgd_jax.scsgd_eigen, scsgd_jax.scsgd_eigen_muon,
                                   scsgd_jax.contrib.scsgd_two_sided,
                                   lambda *a, **k: scsgd_jax.scale_by_sketched_conditioning(**k),
                                   lambda *a, **k: scsgd_jax.scale_by_eigenbasis_adam(**k),
                                   lambda *a, **k: scsgd_jax.contrib.scale_by_output_conditioning(**k)])
@pytest.mark.parametrize("old,new", [("update_every", "refresh=scsgd_jax.Refresh(every=...)"),
                                     ("ema_rate", "statistics=scsgd_jax.Statistics(ema_rate=...)"),
                                     ("eigenvalue_floor", "conditioner=scsgd_jax.Conditioner(eigenvalue_floor=...)"),
                                     ("rank", "rank=..."), ("input_axes", "input_axes=..."), ("seed", "seed=...")])
def test_the_earlier_keywords_are_refused_naming_their_place_in_the_conditioning(build, old, new):
  with pytest.raises(TypeError, match=re.escape(f"{old} is scsgd_jax.Conditioning({new})")):
    build(0.1, **{old: 1})


@pytest.mark.parametrize("build", [scsgd_jax.scsgd, scsgd_jax.scsgd_eigen, scsgd_jax.scsgd_eigen_muon,
                                   scsgd_jax.contrib.scsgd_two_sided])
def test_a_rank_passed_where_the_conditioning_goes_is_refused_naming_the_fix(build):
  with pytest.raises(TypeError, match=re.escape("got 4 (a rank? pass scsgd_jax.Conditioning(rank=4))")):
    build(0.1, 4)


class Net(nnx.Module):
  def __init__(self, rngs):
    self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))


EXPECTED = {"a/kernel": "dense C, full C^(1/2), n=8", "b/kernel": "diagonal C, n=16",
            "a/bias": "not conditioned: a bias, a norm's scale or another vector",
            "b/bias": "not conditioned: a bias, a norm's scale or another vector"}


@pytest.mark.parametrize("wrap", [lambda tx: tx, lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx),
                                  lambda tx: optax.MultiSteps(tx, 2),
                                  lambda tx: optax.masked(tx, lambda p: jax.tree.map(lambda _: True, p))])
def test_the_plans_are_read_from_any_state_the_transform_sits_in(wrap):
  params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
  assert scsgd_jax.plans(jax.eval_shape(wrap(scsgd_jax.scsgd(0.1)).init, params)) == EXPECTED
  injected = optax.inject_hyperparams(scsgd_jax.scsgd)(0.1)
  assert scsgd_jax.plans(injected.init(params)) == EXPECTED
  optimizer = nnx.Optimizer(Net(nnx.Rngs(0)), wrap(scsgd_jax.scsgd(0.1)), wrt=nnx.Param)
  assert scsgd_jax.plans(optimizer.opt_state) == EXPECTED
  two = scsgd_jax.plans(jax.eval_shape(scsgd_jax.contrib.scsgd_two_sided(0.1).init, params))
  assert two["a/kernel"].startswith(EXPECTED["a/kernel"] + " | ")
  with pytest.raises(ValueError, match="holds no scsgd_jax conditioning state"):
    scsgd_jax.plans(optax.sgd(0.1).init(params))


def test_state_shardings_takes_what_nnx_users_hold_and_refuses_a_wrong_tree():
  params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
  named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tx = scsgd_jax.scsgd(0.1)
  as_tree = scsgd_jax.state_shardings(tx, params, jax.tree.map(lambda _: named, params))
  by_dict = scsgd_jax.state_shardings(tx, params, jax.tree.map(lambda _: named, nnx.to_pure_dict(params)))
  by_nnx = scsgd_jax.state_shardings(tx, params, nnx.get_named_sharding(params, mesh))
  assert jax.tree.structure(as_tree) == jax.tree.structure(by_dict) == jax.tree.structure(by_nnx)
  with pytest.raises(ValueError, match=r"param_shardings must hold .* nnx.get_named_sharding"):
    scsgd_jax.state_shardings(tx, params, {"a": {"kernel": named}})


class DropoutResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
    x = nn.Dropout(0.2, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(4)(x)


class TrainState(train_state.TrainState):
  batch_stats: dict


def _readme_linen_step() -> str:
  """The README's Linen training step, as written."""
  with open(__file__.rsplit("/tests/", 1)[0] + "/README.md") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  return next(b for b in blocks if "capture_linen" in b)


def test_the_readme_linen_recipe_runs_as_written_with_batchnorm_and_dropout_and_returns_the_loss():
  model = DropoutResNet()
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal((16, 8, 8, 3)).astype(np.float32) for _ in range(4)]
  label = lambda x: (x[..., 0].mean(axis=(1, 2)) > 0).astype(np.int32) + 2 * (x[..., 1].mean(axis=(1, 2)) > 0)
  data = [(jnp.asarray(x), jnp.asarray(label(x))) for x in xs]
  x = data[0][0]
  variables = model.init(jax.random.PRNGKey(0), x, train=False)
  tx = scsgd_jax.scsgd(0.05,
                       scsgd_jax.Conditioning(input_axes=scsgd_jax.input_axes_linen(model, variables, x, train=True)))
  state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                            batch_stats=variables["batch_stats"])
  scope = {"jax": jax, "optax": optax, "scsgd_jax": scsgd_jax, "model": model}
  exec(_readme_linen_step(), scope)
  losses = []
  for i in range(80):
    state, loss = scope["train_step"](state, *data[i % 4], jax.random.PRNGKey(i))
    losses.append(float(loss))
  assert all(np.isfinite(losses)) and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
  assert set(kernel_lines(scsgd_jax.plans(state.opt_state))) == {"Conv_0/kernel", "Dense_0/kernel"}


def test_input_axes_may_name_a_parameter_that_optax_masked_hides():
  params = {"a": {"kernel": jnp.ones((8, 4))}, "b": {"kernel": jnp.ones((4, 2))}}
  tx = optax.masked(scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(input_axes={"b/kernel": (0,)})), {
      "a": {
          "kernel": True
      },
      "b": {
          "kernel": False
      }
  })
  assert set(scsgd_jax.plans(tx.init(params))) == {"a/kernel"}
