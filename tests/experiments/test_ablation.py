"""The ablation on tfds mock data."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from experiments.paper import ablation
from experiments.run import errors
from tests import helpers

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies



def test_ablation_runs_on_mock_data(tmp_path):
  config = helpers.smoke_config(num_steps=20, checkpoint_every=20)
  with tfds.testing.mock_data(num_examples=600):
    results = ablation.run(config, str(tmp_path / "runs"), ["sgd", "default", "rows_64"])
  path = ablation.write(results, str(tmp_path / "out"), "cmd", 20)
  assert results["sgd"]["time_per_step_vs_sgd"] == 1.0
  assert all(np.isfinite(r["final_test_loss"]) for r in results.values())
  assert "| rows_64 |" in open(path).read()


def test_every_variant_is_checked_before_any_runs(tmp_path):
  config = helpers.smoke_config()
  config.optimizer.scsgd.conditioner = "sketched"
  with pytest.raises(errors.ConfigError, match=r"config\.optimizer\.scsgd\.rank: rank=64"):
    ablation.run(config, str(tmp_path), ["default", "rank_64"])  # rank 64 >= conv1's n = 25
  assert not (tmp_path / "default").exists()
