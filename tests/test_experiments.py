"""The experiments: models, init, schedule, end-to-end runs on tfds mock data, resumption, errors."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from configs import smoke
from experiments import compare
from experiments import data as data_lib
from experiments import models
from experiments import optimizers
from experiments import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,shape", [("lenet", (3, 28, 28, 1)), ("svhn_net", (3, 32, 32, 3))])
def test_forward_shapes_and_xavier_init(name, shape):
  model = models.create_model(name, seed=0, num_classes=10, channels=shape[-1])
  assert model(jnp.zeros(shape)).shape == (3, 10)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for layer, p in params.items():
    kernel = np.asarray(p["kernel"])
    fan_in = int(np.prod(kernel.shape[:-1]))
    bound = np.sqrt(3.0 / fan_in)
    assert np.abs(kernel).max() <= bound, layer
    if kernel.size >= 500:  # uniform on the whole interval, not a narrower one
      assert np.abs(kernel).max() > 0.95 * bound, layer
      np.testing.assert_allclose(kernel.std(), bound / np.sqrt(3), rtol=0.15)
    np.testing.assert_array_equal(p["bias"], 0.0)


def test_lenet_layer_dims_match_the_paper():
  model = models.LeNet(rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert params["conv1"]["kernel"].shape == (5, 5, 1, 20)
  assert params["conv2"]["kernel"].shape == (5, 5, 20, 50)
  assert params["dense1"]["kernel"].shape == (800, 500)
  assert params["dense2"]["kernel"].shape == (500, 10)


def test_schedule_values():
  lr = optimizers.learning_rate(smoke.get_config())
  np.testing.assert_allclose(lr(0), 0.01)
  np.testing.assert_allclose(lr(1000), 0.01 * 1.1 ** -0.75, rtol=1e-6)
  np.testing.assert_allclose(lr(10000), 0.01 * 2.0 ** -0.75, rtol=1e-6)


def _smoke(dataset="mnist", **overrides):
  config = smoke.get_config()
  config.dataset = dataset
  config.model = "lenet" if dataset == "mnist" else "svhn_net"
  config.download = False
  for k, v in overrides.items():
    config[k] = v
  return config


@pytest.mark.parametrize("dataset", ["mnist", "svhn_cropped"])
def test_tiny_config_trains_end_to_end_on_mock_data(dataset, tmp_path):
  config = _smoke(dataset)
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


def _final_params(workdir):
  mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  return mngr.restore(mngr.latest_step())["params"], mngr.latest_step()


def test_resumed_run_equals_uninterrupted_run(tmp_path):
  with tfds.testing.mock_data(num_examples=600):
    train.train_and_evaluate(_smoke(), str(tmp_path / "straight"))
    first = train.train_and_evaluate(_smoke(stop_after_steps=20), str(tmp_path / "resumed"))
    assert first["step"] == 20
    train.train_and_evaluate(_smoke(), str(tmp_path / "resumed"))
  a, sa = _final_params(str(tmp_path / "straight"))
  b, sb = _final_params(str(tmp_path / "resumed"))
  assert sa == sb == 40
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  rows = [json.loads(l) for l in open(tmp_path / "resumed" / train.METRICS_FILE)]
  assert [r["step"] for r in rows] == [10, 20, 30, 40]


def test_wrong_dataset_name_is_a_clear_error(tmp_path):
  config = _smoke()
  config.dataset = "cifar10"
  with pytest.raises(ValueError, match="unknown dataset 'cifar10'.*mnist"):
    train.train_and_evaluate(config, str(tmp_path))


def test_data_dir_without_dataset_is_a_clear_error(tmp_path):
  with pytest.raises(data_lib.DataError, match="not prepared in .*empty"):
    data_lib.load_split("mnist", "train", str(tmp_path / "empty"), download=False)


def test_unknown_config_key_is_a_clear_error(tmp_path):
  config = smoke.get_config()
  config.lock()
  with pytest.raises(AttributeError, match="learning_rte"):
    config.optimizer.learning_rte = 0.1
  out = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--config", "configs/smoke.py", "--workdir", str(tmp_path),
       "--config.optimizer.learning_rte=0.1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "learning_rte" in out.stderr


def test_unknown_optimizer_is_rejected_before_training(tmp_path):
  config = _smoke()
  with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
    compare.compare(config, str(tmp_path), ["sgd", "lion"], str(tmp_path / "r"), "cmd")
  assert not (tmp_path / "sgd").exists()


def test_weight_decay_is_added_to_the_gradient_first():
  config = smoke.get_config()
  config.optimizer.name = "sgd"
  config.optimizer.momentum = 0.0
  config.optimizer.weight_decay = 0.1
  tx = optimizers.create_optimizer(config)
  params = {"w": jnp.ones(3)}
  updates, _ = tx.update({"w": jnp.zeros(3)}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.01 * 0.1 * np.ones(3), rtol=1e-6)


def test_cli_reports_a_missing_dataset_without_a_traceback(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--config", "configs/smoke.py", "--workdir", str(tmp_path / "w"),
       "--data_dir", str(tmp_path / "nothing_here"), "--config.download=False"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "error: dataset 'mnist'" in out.stderr and "not prepared" in out.stderr
  assert "Traceback" not in out.stderr
  out = subprocess.run(
      [sys.executable, "-m", "experiments.compare", "--config", "configs/smoke.py", "--workdir", str(tmp_path / "c"),
       "--optimizers", "sgd,lion"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "unknown optimizer 'lion'" in out.stderr and "Traceback" not in out.stderr


def test_ablation_runs_on_mock_data(tmp_path):
  from experiments import ablation

  with tfds.testing.mock_data(num_examples=600):
    results = ablation.run(_smoke(), 20, str(tmp_path / "runs"), ["sgd", "default", "rows_64"])
  path = ablation.write(results, str(tmp_path / "out"), "cmd", 20)
  assert results["sgd"]["time_per_step_vs_sgd"] == 1.0
  assert all(np.isfinite(r["final_test_loss"]) for r in results.values())
  assert "| rows_64 |" in open(path).read()
