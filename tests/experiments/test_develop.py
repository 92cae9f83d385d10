"""Issue 20's development task: the synthetic source against hand computation, and a two-step run."""

import json
import os

import numpy as np
import pytest

from configs.studies import develop as develop_config
from experiments.studies import develop
from experiments.optim import registry

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies



def test_windows_follow_the_chain_and_the_source_loss_is_its_nll():
  table = develop.markov_source(3, 0.5, seed=0)
  np.testing.assert_allclose(table.sum(axis=1), np.ones(9), rtol=1e-12)
  windows = develop.sample_windows(table, 4000, 6, np.random.default_rng(1))
  # every transition a,b -> c in proportion to p[a*3+b, c] (the first pair is uniform)
  counts = np.zeros((9, 3))
  for t in range(2, 6):
    np.add.at(counts, (windows[:, t - 2] * 3 + windows[:, t - 1], windows[:, t]), 1)
  np.testing.assert_allclose(counts / counts.sum(axis=1, keepdims=True), table, atol=0.03)
  small = windows[:3]
  by_hand = np.mean([-np.log(table[w[t - 2] * 3 + w[t - 1], w[t]]) for w in small for t in range(2, 6)])
  np.testing.assert_allclose(develop.source_loss(table, small), by_hand, rtol=1e-12)


def test_two_step_runs_write_every_rate_seed_and_anchor_and_resume(tmp_path, monkeypatch):
  config = develop_config.get_config()
  config.num_steps = 2
  config.develop.optimizers = ("sgd", "scsgd_graft")
  config.benchmark.grid = (1.0,)
  config.benchmark.seeds = (0, 1)
  config.develop.heldout_windows = 4
  develop.develop(config, str(tmp_path), "python -m experiments.studies.develop (test)")
  record = json.load(open(os.path.join(tmp_path, "develop.json")))
  rate = {name: registry.recipe(name, "transformer").learning_rate for name in ("sgd", "scsgd_graft")}
  assert [(r["optimizer"], r["learning_rate"], r["seed"]) for r in record["runs"]] == [
      ("sgd", rate["sgd"], 0), ("sgd", rate["sgd"], 1), ("scsgd_graft", rate["scsgd_graft"], 0),
      ("scsgd_graft", rate["scsgd_graft"], 1)]
  assert all(np.isfinite(r["heldout_loss"]) for r in record["runs"])
  by_seed = [r["heldout_loss"] for r in record["runs"][:2]]
  assert by_seed[0] != by_seed[1]  # the seed reaches initialisation and batches
  assert record["best"]["sgd"]["heldout_losses"] == by_seed
  np.testing.assert_allclose(record["best"]["sgd"]["median"], np.median(by_seed))
  # two steps from a random start: about the uniform model's log(vocab), far above the source's loss
  uniform = np.log(config.develop.vocab)
  assert record["anchors"]["source"] < record["anchors"]["unigram"] < uniform + 0.05
  assert all(abs(r["heldout_loss"] - uniform) < 1.0 for r in record["runs"])
  assert all(r["heldout_loss"] > record["anchors"]["source"] + 0.5 for r in record["runs"])
  # a second invocation finds every run written (no training); other settings train again
  monkeypatch.setattr(develop, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained again")))
  again = develop.develop(config, str(tmp_path), "python -m experiments.studies.develop (test)")
  assert again["runs"] == record["runs"]
  config.num_steps = 3
  with pytest.raises(AssertionError, match="trained again"):
    develop.develop(config, str(tmp_path), "python -m experiments.studies.develop (test)")


def test_probe_settings_reach_the_optimizer_and_are_recorded():
  assert develop.probe_settings("") == {}
  assert develop.probe_settings("update_every=10, ema_rate=0.2") == {"update_every": 10, "ema_rate": 0.2}
  assert develop.probe_settings("muon_ns_steps=2, muon_ns_coeffs=((3.5, -4.5, 2.0), (2.5, -3.0, 1.0))") == {
      "muon_ns_steps": 2, "muon_ns_coeffs": ((3.5, -4.5, 2.0), (2.5, -3.0, 1.0))}
  with pytest.raises(ValueError, match="'update_every' is not 'name=value'"):
    develop.probe_settings("update_every")
  with pytest.raises(ValueError, match="tail=scalar is not a Python literal"):
    develop.probe_settings("update_every=10, tail=scalar")
  config = develop_config.get_config()
  config.num_steps = 1
  config.develop.heldout_windows = 4
  config.develop.settings = "update_every=7"
  table = develop.markov_source(config.develop.vocab, 0.1, 0)
  heldout = develop.sample_windows(table, 4, config.develop.context + 1, np.random.default_rng(0))
  rec = develop.run(config, "scsgd_two_sided", 1e-3, 0, table, heldout)
  assert rec["settings"]["update_every"] == 7 and rec["settings"]["graft_decay"] == 0.999
  # an empty probe leaves the recorded settings as records made before probes existed
  config.develop.settings = ""
  assert "settings" not in develop._settings(config)["develop"]
