"""The optimizer factory: schedule, per-optimizer sub-configs passed with **, what update needs."""

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scsgd_jax
from configs import default
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.optim import peers
from experiments.run import train
from experiments.run import workdir
from tests import helpers


def test_schedule_values():
  lr = optimizers.learning_rate(helpers.smoke_config())
  np.testing.assert_allclose(lr(0), 0.01)
  np.testing.assert_allclose(lr(1000), 0.01 * 1.1 ** -0.75, rtol=1e-6)
  np.testing.assert_allclose(lr(10000), 0.01 * 2.0 ** -0.75, rtol=1e-6)


def test_warmup_cosine_by_hand_and_muons_adamw_part_follows_the_same_shape():
  config = helpers.smoke_config()
  config.num_steps = 200
  config.schedule = dict(name="warmup_cosine", base=0.1, warmup_fraction=0.05)  # warmup 10 steps
  lr = optimizers.learning_rate(config)
  np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 0.05, 0.1], rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(lr(105), 0.1 * 0.5 * (1 + np.cos(np.pi * 95 / 190)), rtol=1e-5)
  np.testing.assert_allclose(lr(200), 0.0, atol=1e-9)
  np.testing.assert_allclose(optimizers.learning_rate(config, 0.002)(105), 0.002 * 0.5, rtol=1e-4)


def test_weight_decay_is_added_to_the_gradient_first():
  config = helpers.smoke_config()
  config.optimizer.name = "sgd"
  config.optimizer.sgd.momentum = None
  config.optimizer.weight_decay = 0.1
  tx = optimizers.create(config).tx
  params = {"w": jnp.ones(3)}
  updates, _ = tx.update({"w": jnp.zeros(3)}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.01 * 0.1 * np.ones(3), rtol=1e-6)


def test_factory_says_what_the_update_needs():
  config = helpers.smoke_config()
  for name, capture in (("scsgd", "inputs"), ("sgd", "none"), ("adam", "none"), ("scsgd_two_sided", "two_sided"),
                        ("scsgd_muon", "inputs")):
    config.optimizer.name = name
    assert optimizers.create(config).capture == capture, name


def test_sub_config_reaches_the_optimizer_and_defaults_stay_the_librarys():
  """The default scsgd sub-config sets nothing (configs are data; completed, every argument is a placeholder),
  so the state is exactly the library default's; a key set in the sub-config (rank) reaches the library,
  where the old flat config pinned full_max_dim = 128."""
  config = default.get_config()
  assert config.optimizer.scsgd.to_dict() == {}
  config = optimizers.complete(config)
  assert "rank" in config.optimizer.scsgd and "ema_rate" in config.optimizer.scsgd
  assert all(v is None for v in config.optimizer.scsgd.values())
  assert config.optimizer.sgd.momentum == 0.9 and config.optimizer.adam.learning_rate == 1e-3  # set values kept
  params = {"dense": {"kernel": jnp.zeros((200, 1000))}}
  ours = jax.eval_shape(optimizers.create(config).tx.init, params)
  library = jax.eval_shape(
      scsgd_jax.scsgd(optimizers.learning_rate(config), scsgd_jax.Conditioning(seed=config.seed)).init, params)
  assert jax.tree.structure(ours) == jax.tree.structure(library)
  assert [x.shape for x in jax.tree.leaves(ours)] == [x.shape for x in jax.tree.leaves(library)]
  config.optimizer.scsgd.rank = 8  # the library then derives full_max_dim = 4 * 8 = 32 < 200: sketched at rank 8
  state = jax.eval_shape(optimizers.create(config).tx.init, params)
  assert state[0].factors["dense/kernel"].q.shape == (200, 8)


def test_adam_takes_its_own_learning_rate_from_its_sub_config():
  config = helpers.smoke_config()
  config.optimizer.name = "adam"
  config.optimizer.adam.learning_rate = 0.5
  tx = optimizers.create(config).tx
  params = {"w": jnp.zeros(2)}
  updates, _ = tx.update({"w": jnp.array([1.0, -2.0])}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.5, 0.5], rtol=1e-3)
  ref = optax.adam(0.5)
  expected, _ = ref.update({"w": jnp.array([1.0, -2.0])}, ref.init(params), params)
  np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "nadamw", "scsgd_adamw", "scsgd_graft", "scsgd_muon", "muon", "shampoo",
                                  "shampoo_input", "sketchy", "scsgd_eigen", "scsgd_eigen_full", "scsgd_eigen_muon", "psgd_kron"])
def test_every_benchmark_optimizer_builds_from_its_sub_config_and_steps(name):
  pytest.importorskip("precondition")
  config = helpers.smoke_config()
  config.optimizer.name = name
  config.optimizer[name] = optimizers.sub_config(name)
  if name == "sketchy":
    config.optimizer.sketchy.compression_rank = 2  # < the kernel's input side, 6
  opt = optimizers.create(config)
  assert (opt.capture == "inputs") is name.startswith("scsgd_")
  params = {"dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}}
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5), params)
  extra = {"layer_inputs": {"dense": {"kernel": jnp.eye(6)}}} if opt.capture == "inputs" else {}
  with jax.numpy_rank_promotion("allow"):
    updates, _ = opt.tx.update(grads, opt.tx.init(params), params, **extra)
  assert all(np.all(np.isfinite(u)) and np.abs(u).max() > 0 for u in jax.tree.leaves(updates))


def test_eigen_rows_are_the_library_alias_at_adamws_recipe_and_full_rank():
  """scsgd_eigen_full keeps Adam's second moment for all n eigen-directions (no tail); scsgd_eigen's sketch keeps
  k of them and a tail; both on AdamW's transformer recipe (weight decay on matrices only)."""
  params = {"dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}}
  shapes = {}
  for name in ("scsgd_eigen", "scsgd_eigen_full"):
    config = helpers.smoke_config()
    config.optimizer.name = name
    config.optimizer[name] = optimizers.sub_config(name, rank=2, statistics="dense", conditioner="sketched")
    nu = optimizers.create(config).tx.init(params)[0].moments["dense/kernel"]
    shapes[name] = (nu.lead.shape, nu.col is None)
  assert shapes == {"scsgd_eigen": ((2, 3), False), "scsgd_eigen_full": ((6, 3), True)}
  settings = registry.recipe("scsgd_eigen", "transformer").settings
  assert settings == registry.adam_settings("transformer")


def test_eigen_two_sided_row_is_the_library_alias_on_both_sides():
  """scsgd_eigen_two_sided (the EKFAC probe) captures the output gradients and equals scsgd_eigen(sides='both')
  built by hand: the same update from the same inputs and output rows."""
  config = helpers.smoke_config()
  config.optimizer.name = "scsgd_eigen_two_sided"
  config.optimizer.scsgd_eigen_two_sided = optimizers.sub_config("scsgd_eigen_two_sided", update_every=1)
  opt = optimizers.create(config)
  assert opt.capture == "two_sided"
  by_hand = scsgd_jax.scsgd_eigen(optimizers.learning_rate(config),
                                  scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(every=1), seed=config.seed),
                                  sides="both")
  params = {"dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}}
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  extra = {"layer_inputs": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)}},
           "output_grads": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)}}}
  got, _ = opt.tx.update(grads, opt.tx.init(params), params, **extra)
  want, _ = by_hand.update(grads, by_hand.init(params), params, **extra)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


def test_scsgd_graft_is_the_library_recipe_with_its_graft_settings():
  """The factory's scsgd_graft equals chain(graft(normalized RMSprop, conditioning), Nesterov SGD 0.9)
  built by hand from the library, with the sub-config's graft_decay reaching RMSprop."""
  config = helpers.smoke_config()
  config.optimizer.name = "scsgd_graft"
  config.optimizer.scsgd_graft = optimizers.sub_config("scsgd_graft", graft_decay=0.9, update_every=1)
  opt = optimizers.create(config)
  by_hand = optax.chain(
      scsgd_jax.contrib.scale_by_grafting(
          scsgd_jax.contrib.scale_by_normalized_rms(decay=0.9),
          scsgd_jax.scale_by_sketched_conditioning(
              scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(every=1), seed=config.seed))),
      optax.sgd(optimizers.learning_rate(config), momentum=0.9, nesterov=True))
  rng = np.random.default_rng(0)
  params = {"dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}}
  s1, s2 = opt.tx.init(params), by_hand.init(params)
  for _ in range(3):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    extra = {"layer_inputs": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)}}}
    u1, s1 = opt.tx.update(grads, s1, params, **extra)
    u2, s2 = by_hand.update(grads, s2, params, **extra)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  # the record writes out the grafting part's library defaults next to the settings given
  resolved = optimizers.resolved_settings(config)
  assert resolved["graft_decay"] == 0.9
  assert resolved["graft_eps"] == inspect.signature(scsgd_jax.contrib.scale_by_normalized_rms).parameters["eps"].default
  assert resolved["update_every"] == 1 and resolved["rank"] == scsgd_jax.Conditioner().resolved()["rank"]


@pytest.mark.parametrize("name,fixed", [("scsgd_two_sided", {}),
                                        ("scsgd_two_sided_lean", {"magnitude": "sign", "memory_share": 0.5})])
def test_scsgd_two_sided_is_the_library_alias_with_its_settings(name, fixed):
  """The factory's scsgd_two_sided (and its Adam-memory row, whose builder fixes two arguments) equals
  scsgd_jax.contrib.scsgd_two_sided built by hand (the sub-config's graft and conditioning settings reach it), asks the
  step for both the input rows and the output gradients, and its record writes the fixed arguments out."""
  config = helpers.smoke_config()
  config.optimizer.name = name
  config.optimizer[name] = optimizers.sub_config(name, graft_decay=0.9, update_every=1)
  opt = optimizers.create(config)
  assert opt.capture == "two_sided"
  by_hand = scsgd_jax.contrib.scsgd_two_sided(
      optimizers.learning_rate(config), scsgd_jax.Conditioning(seed=config.seed, refresh=scsgd_jax.Refresh(every=1)),
      graft_decay=0.9, **fixed)
  rng = np.random.default_rng(0)
  params = {"dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}}
  s1, s2 = opt.tx.init(params), by_hand.init(params)
  for _ in range(3):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    extra = {"layer_inputs": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)}},
             "output_grads": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)}}}
    u1, s1 = opt.tx.update(grads, s1, params, **extra)
    u2, s2 = by_hand.update(grads, s2, params, **extra)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  resolved = optimizers.resolved_settings(config)
  assert resolved["graft_decay"] == 0.9 and resolved["update_every"] == 1
  assert {k: resolved[k] for k in fixed} == fixed


def test_scsgd_muon_is_the_conditioning_in_front_of_the_benchmarks_muon():
  """The factory's scsgd_muon equals chain(conditioning, peers.muon) built by hand, with the sub-config's
  muon_* arguments reaching Muon (its output layer on AdamW at its own rate)."""
  config = helpers.smoke_config()
  config.optimizer.name = "scsgd_muon"
  config.optimizer.scsgd_muon = optimizers.sub_config("scsgd_muon", update_every=1, muon_output_layer="head",
                                                      muon_adam_learning_rate=0.003)
  opt = optimizers.create(config)
  by_hand = optax.chain(
      scsgd_jax.scale_by_sketched_conditioning(
          scsgd_jax.Conditioning(refresh=scsgd_jax.Refresh(every=1), seed=config.seed)),
      peers.muon(optimizers.learning_rate(config),
                 output_layer="head",
                 adam_learning_rate=optimizers.learning_rate(config, 0.003)))
  rng = np.random.default_rng(0)
  params = {"dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}, "head": {"kernel": jnp.ones((3, 4))}}
  s1, s2 = opt.tx.init(params), by_hand.init(params)
  for _ in range(3):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    extra = {"layer_inputs": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)},
                              "head": {"kernel": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)}}}
    u1, s1 = opt.tx.update(grads, s1, params, **extra)
    u2, s2 = by_hand.update(grads, s2, params, **extra)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  # and the conditioning acts: from the same state, plain Muon's first step differs on the kernels
  plain = peers.muon(optimizers.learning_rate(config), output_layer="head",
                     adam_learning_rate=optimizers.learning_rate(config, 0.003))
  first, _ = opt.tx.update(grads, opt.tx.init(params), params, **extra)
  u3, _ = plain.update(grads, plain.init(params), params)
  assert not np.allclose(u3["dense"]["kernel"], first["dense"]["kernel"], rtol=1e-3)


def test_two_sided_probes_momentum_first_and_unconditioned_embeddings():
  """The development probes of issue 20's direction 4: ``momentum_first`` is Nesterov momentum of the raw
  gradient in front of the alias without momentum (its first step is the default's over ``1 + momentum``: the
  grafted direction does not see the trace's scale); ``condition_embeddings=False`` plans no embedding."""
  rng = np.random.default_rng(0)
  params = {"embed": {"embedding": jnp.ones((5, 6))}, "dense": {"kernel": jnp.ones((6, 3)), "bias": jnp.zeros(3)}}
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  extra = {"layer_inputs": {"embed": {"embedding": jnp.asarray([0, 1, 1, 3], jnp.int32)},
                            "dense": {"kernel": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)}},
           "output_grads": {"dense": {"kernel": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)}}}
  steps = {}
  for probe in ("", "momentum_first", "condition_embeddings"):
    config = helpers.smoke_config()
    config.optimizer.name = "scsgd_two_sided"
    values = {"momentum_first": True} if probe == "momentum_first" else (
        {"condition_embeddings": False} if probe else {})
    config.optimizer.scsgd_two_sided = optimizers.sub_config("scsgd_two_sided", **values)
    opt = optimizers.create(config)
    state = opt.tx.init(params)
    steps[probe], state = opt.tx.update(grads, state, params, **extra)
    sides = [x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "summary")) if hasattr(x, "summary")]
    summary = sides[0].summary()  # the input side's kernels
    conditioned = {p for p, how in summary.items() if not how.startswith("not conditioned")}
    if probe == "condition_embeddings":
      assert conditioned == {"dense/kernel"}
      assert summary["embed/embedding"] == "not conditioned: excluded by kernel_filter"
    elif probe == "":
      assert conditioned == {"dense/kernel", "embed/embedding"}
  momentum = inspect.signature(scsgd_jax.contrib.scsgd_two_sided).parameters["momentum"].default
  for a, b in zip(jax.tree.leaves(steps["momentum_first"]), jax.tree.leaves(steps[""])):
    np.testing.assert_allclose(a, b / (1 + momentum), rtol=1e-5, atol=1e-8)
  for path in (("dense", "kernel"), ("dense", "bias")):  # only the embedding's step changes
    np.testing.assert_allclose(steps["condition_embeddings"][path[0]][path[1]], steps[""][path[0]][path[1]], rtol=1e-6)
  assert not np.allclose(steps["condition_embeddings"]["embed"]["embedding"], steps[""]["embed"]["embedding"])


def test_scsgd_eigen_muon_sends_raw_gradients_to_muons_adamw_part_and_scaled_ones_to_its_kernels():
  """The tables, head and biases get exactly Muon's AdamW step (raw gradients); a hidden kernel gets Muon's
  orthogonalization of the eigenbasis-Adam direction: not Muon's own step, and near-orthogonal columns."""
  config = helpers.smoke_config()
  rng = np.random.default_rng(0)
  params = {"embed": {"embedding": jnp.ones((5, 4))}, "dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)},
            "head": {"kernel": jnp.ones((8, 5))}}
  grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
  inputs = {"embed": {"embedding": jnp.arange(5)}, "dense": {"kernel": jnp.asarray(rng.standard_normal((16, 4)),
                                                                                    jnp.float32)},
            "head": {"kernel": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}}
  out = {}
  for name in ("scsgd_eigen_muon", "muon"):
    config.optimizer.name = name
    config.optimizer[name] = optimizers.sub_config(name, **{("muon_" if name != "muon" else "") + "output_layer": "head"})
    tx = optimizers.create(config).tx
    extra = {"layer_inputs": inputs} if name != "muon" else {}
    out[name], _ = tx.update(grads, tx.init(params), params, **extra)
  for path in (("embed", "embedding"), ("dense", "bias"), ("head", "kernel")):
    np.testing.assert_allclose(out["scsgd_eigen_muon"][path[0]][path[1]], out["muon"][path[0]][path[1]], rtol=1e-5)
  assert not np.allclose(out["scsgd_eigen_muon"]["dense"]["kernel"], out["muon"]["dense"]["kernel"], rtol=1e-2)
  s = np.linalg.svd(np.asarray(out["scsgd_eigen_muon"]["dense"]["kernel"]), compute_uv=False)
  assert s.min() > 0.5 * s.max(), s


def test_lenet_trains_bit_for_bit_at_the_paper_scale_under_the_default_normalize():
  """normalize's default ('embeddings') conditions a model without an embedding exactly as the paper's scale
  ('none'): LeNet's training step lowers to the same program (the figures of LeNet/MNIST stand), while 'all'
  lowers to another (the comparison can tell)."""
  from flax import nnx
  from experiments.run import build as build_lib
  from experiments.run import data as data_lib
  from experiments.run import step as step_lib

  def program(normalize):
    cfg = helpers.smoke_config()
    cfg.optimizer.name = "scsgd"
    if normalize is not None:
      cfg.optimizer.scsgd.normalize = normalize
    built = build_lib.build(cfg)
    step = step_lib.make_train_step(built.graphdef, built.optimizer.tx, built.optimizer.capture, cfg.max_rows or None)
    state = build_lib.abstract_state(built)
    x, y = data_lib.example_batch(cfg.dataset, cfg.batch_size)
    return step.lower(state["params"], nnx.as_pure(nnx.State({})), state["opt_state"], x, y,
                      jax.random.key(0)).as_text()

  default = program(None)
  assert default == program("none")
  assert default != program("all")


@pytest.mark.parametrize("name,base", [("muon_polar3", "muon"), ("scsgd_eigen_muon_polar3", "scsgd_eigen_muon")])
def test_polar3_rows_are_their_rows_with_three_polar_express_steps(name, base):
  """The three-step rows equal their five-step rows given ``ns_steps=3`` and Polar Express's first three
  coefficient rows by hand (not the five-step rows' step), and their records write the two settings out."""
  rng = np.random.default_rng(0)
  params = {"dense": {"kernel": jnp.ones((6, 8)), "bias": jnp.zeros(8)}, "head": {"kernel": jnp.ones((8, 5))}}
  grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params)
  extra = {} if base == "muon" else {"layer_inputs": {
      "dense": {"kernel": jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)},
      "head": {"kernel": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}}}
  prefix = "" if base == "muon" else "muon_"
  by_hand = {f"{prefix}ns_steps": 3, f"{prefix}ns_coeffs": peers.POLAR_EXPRESS[:3]}
  out, resolved = {}, {}
  for row, given in ((name, {}), (base, by_hand), (base, {})):
    config = helpers.smoke_config()
    config.optimizer.name = row
    config.optimizer[row] = optimizers.sub_config(row, **{f"{prefix}output_layer": "head"})
    tx = optimizers.create(config).tx if not given else registry.entry(base).build(
        optimizers.learning_rate(config), {f"{prefix}output_layer": "head", **given}, config, None)
    out[row, bool(given)], _ = tx.update(grads, tx.init(params), params, **extra)
    resolved[row] = optimizers.resolved_settings(config)
  for a, b in zip(jax.tree.leaves(out[name, False]), jax.tree.leaves(out[base, True])):
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(out[name, False]["dense"]["kernel"], out[base, False]["dense"]["kernel"], rtol=1e-3)
  assert resolved[name][f"{prefix}ns_steps"] == 3 and resolved[base].get(f"{prefix}ns_steps") != 3
  assert resolved[name][f"{prefix}ns_coeffs"] == peers.POLAR_EXPRESS[:3]
  # its record as committed (JSON: the coefficient rows as lists) holds today's settings: the run is not redone
  config = optimizers.complete(helpers.smoke_config())
  config.optimizer.name = name
  assert workdir.config_differences(json.loads(json.dumps(train.record(config))), train.record(config)) == []
  with pytest.raises(ValueError, match="steps=6 is outside 1..5"):
    peers.polar_express(6)


def test_soap_anchor_row_is_the_library_alias_with_both_gradient_bases_at_full_rank():
  """scsgd_eigen_muon_soap equals scsgd_jax.scsgd_eigen_muon given SOAP's layout by hand (the gradients' bases on
  both sides, full rank, refreshed every 10 steps), differs from the one-sided row, and writes the layout out."""
  rng = np.random.default_rng(0)
  params = {"dense": {"kernel": jnp.ones((6, 8)), "bias": jnp.zeros(8)}, "head": {"kernel": jnp.ones((8, 5))}}
  extra = {"layer_inputs": {"dense": {"kernel": jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)},
                            "head": {"kernel": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}}}
  grads = [jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), params) for _ in range(3)]

  def run(tx):
    state, out = tx.init(params), []
    for g in grads:
      u, state = tx.update(g, state, params, **extra)
      out.append(u)
    return out, state

  config = helpers.smoke_config()
  config.optimizer.name = "scsgd_eigen_muon_soap"
  config.optimizer.scsgd_eigen_muon_soap = optimizers.sub_config("scsgd_eigen_muon_soap", muon_output_layer="head")
  got, state = run(optimizers.create(config).tx)
  lr = optimizers.learning_rate(config)
  by_hand = scsgd_jax.scsgd_eigen_muon(lr,
                                       scsgd_jax.Conditioning(seed=config.seed,
                                                              conditioner=scsgd_jax.Conditioner("full"),
                                                              statistics=scsgd_jax.Statistics("dense"),
                                                              refresh=scsgd_jax.Refresh(every=10)),
                                       output_layer="head",
                                       basis="gradients",
                                       sides="both")
  want, _ = run(by_hand)
  one_sided, _ = run(
      scsgd_jax.scsgd_eigen_muon(lr,
                                 scsgd_jax.Conditioning(seed=config.seed,
                                                        conditioner=scsgd_jax.Conditioner("full"),
                                                        statistics=scsgd_jax.Statistics("dense")),
                                 output_layer="head"))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(got[-1]["dense"]["kernel"], one_sided[-1]["dense"]["kernel"], rtol=1e-3)
  assert set(state[0].output_rotations) == {"dense/kernel"}
  resolved = optimizers.resolved_settings(config)
  assert {k: resolved[k] for k in registry.SOAP_IN_FRONT} == registry.SOAP_IN_FRONT
