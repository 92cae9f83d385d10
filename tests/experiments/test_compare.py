"""The comparison on tfds mock data: end to end, validated before training, divergence reported."""

import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

from experiments.paper import compare
from experiments.run import errors
from experiments.run import train
from tests import helpers


@pytest.mark.parametrize("dataset", ["mnist", "svhn_cropped"])
def test_tiny_config_trains_end_to_end_on_mock_data(dataset, tmp_path):
  config = helpers.smoke_config(dataset)
  with tfds.testing.mock_data(num_examples=600):
    readme = compare.compare(config, str(tmp_path / "runs"), ["sgd", "scsgd"], str(tmp_path / "report"), "cmd")
  for name in ("sgd", "scsgd"):
    rows = [json.loads(l) for l in open(tmp_path / "runs" / name / train.METRICS_FILE)]
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert all("test_loss" in r for r in rows if r["step"] % 20 == 0)
    assert all(np.isfinite(v) for r in rows for v in r.values())
    assert (tmp_path / "report" / f"metrics_{name}.jsonl").exists()
  for fig in ("train_loss", "test_loss", "train_error", "test_error"):
    assert (tmp_path / "report" / f"{fig}.png").stat().st_size > 1000
  assert "| iteration |" in open(readme).read()


def test_unknown_optimizer_is_rejected_before_training(tmp_path):
  with pytest.raises(errors.ConfigError, match="unknown optimizer 'lion'"):
    compare.compare(helpers.smoke_config(), str(tmp_path), ["sgd", "lion"], str(tmp_path / "r"), "cmd")
  assert not (tmp_path / "sgd").exists()


def test_a_diverged_optimizer_is_named_and_the_report_still_written(tmp_path, capfd):
  config = helpers.smoke_config()
  config.optimizer.sgd.learning_rate = 1e6  # only SGD blows up
  with tfds.testing.mock_data(num_examples=600):
    readme = compare.compare(config, str(tmp_path / "runs"), ["sgd", "scsgd"], str(tmp_path / "report"), "cmd")
  assert "error: sgd diverged at step 10" in capfd.readouterr().err
  text = open(readme).read()
  assert "**sgd** at step 10" in text
  assert (tmp_path / "report" / "metrics_scsgd.jsonl").exists()
  assert (tmp_path / "report" / "test_loss.png").exists()
