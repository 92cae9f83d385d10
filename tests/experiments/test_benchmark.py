"""The head-to-head harness: grid, choice of rate, target and ratios (hand-computed), a tiny run on mock data."""

import jax
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs.benchmark import convex
from experiments import benchmark
from experiments import errors


def _config():
  config = convex.get_config()
  config.benchmark.optimizers = ("sgd", "adamw", "scsgd")
  config.benchmark.seeds = (0, 1)
  return config


def test_grid_is_log_spaced_around_each_default():
  config = _config()
  assert benchmark.learning_rates(config, "sgd") == [0.001, 0.00316, 0.01, 0.0316, 0.1]
  assert benchmark.learning_rates(config, "adamw") == [0.0001, 0.000316, 0.001, 0.00316, 0.01]
  config.benchmark.optimizers = ("sgd,lion",)
  with pytest.raises(errors.ConfigError, match="unknown optimizer 'lion'"):
    benchmark.names(config)


def test_tuning_grows_the_grid_past_an_edge_that_wins_and_stops_at_a_bracket():
  calls = []

  def loss(lr):  # a bowl in log lr with its bottom at 0.1; diverges above 0.5
    calls.append(lr)
    return float("inf") if lr > 0.5 else (np.log10(lr) + 1.0) ** 2

  tried = benchmark.tune(loss, [0.001, 0.00316, 0.01], extend_edge=3)
  assert list(tried) == [0.001, 0.00316, 0.01, 0.0316, 0.1, 0.316]  # 0.1 wins, 0.316 brackets it
  assert min(tried, key=tried.get) == 0.1 and len(calls) == len(set(calls)) == 6
  assert list(benchmark.tune(loss, [0.001, 0.00316, 0.01], extend_edge=1)) == [0.001, 0.00316, 0.01, 0.0316]
  assert list(benchmark.tune(loss, [0.0316, 0.1, 0.316], extend_edge=2)) == [0.0316, 0.1, 0.316]  # bracketed
  assert list(benchmark.tune(loss, [10.0, 31.6], extend_edge=2)) == [1.0, 3.16, 10.0, 31.6]  # all diverge: down


def _rows(losses, ms_per_step):
  return [{"step": 100 * (i + 1), "train_time": ms_per_step * 0.1 * (i + 1), "test_loss": v, "test_error": v / 10,
           "compile_time": 1.0} for i, v in enumerate(losses)]


def test_target_iterations_and_ratios_by_hand():
  config = _config()
  seeds = lambda a, b: {0: {"rows": a, "diverged": False}, 1: {"rows": b, "diverged": False}}  # noqa: E731
  out = {"tune_steps": 100, "optimizers": {
      # final losses: sgd median 0.45, adamw median 0.40 -> target 0.40
      "sgd": {"seeds": seeds(_rows([0.9, 0.6, 0.5], 10), _rows([0.9, 0.5, 0.4], 10)), "state_bytes": 100},
      "adamw": {"seeds": seeds(_rows([0.8, 0.5, 0.4], 10), _rows([0.7, 0.45, 0.4], 10)), "state_bytes": 200},
      "scsgd": {"seeds": seeds(_rows([0.5, 0.4, 0.3], 20), _rows([0.4, 0.35, 0.3], 20)), "state_bytes": 120},
  }}
  s = benchmark.summarize(config, out)
  assert s["target"] == pytest.approx(0.40)
  sgd, adamw, scsgd = (s["optimizers"][n]["summary"] for n in ("sgd", "adamw", "scsgd"))
  assert sgd["reached"] == "1/2" and sgd["iterations_median"] is None and sgd["iterations_range"] == [300, 300]
  assert adamw["iterations_median"] == 300 and adamw["seconds_median"] == pytest.approx(3.0)
  assert scsgd["iterations_range"] == [100, 200] and scsgd["iterations_median"] == 150
  assert scsgd["seconds_median"] == pytest.approx(3.0)  # 20 ms/step: (2 + 4) / 2 seconds
  assert scsgd["iterations_vs_best"] == 1.0 and adamw["iterations_vs_best"] == 2.0
  assert adamw["time_to_target_vs_best"] == pytest.approx(1.0) and scsgd["time_to_target_vs_best"] == pytest.approx(1.0)
  assert scsgd["state_vs_smallest"] == pytest.approx(1.2)
  assert scsgd["step_ms_median"] == pytest.approx(20.0)


def test_tiny_benchmark_on_mock_data_writes_its_report(tmp_path):
  config = _config()
  config.download = False
  config.max_train_examples, config.max_test_examples = 512, 128
  config.num_steps, config.eval_every, config.train_log_every, config.checkpoint_every = 20, 10, 10, 10
  config.benchmark.optimizers = ("sgd", "scsgd")
  config.benchmark.grid = (0.1, 1.0)
  config.benchmark.target_from = ("sgd",)
  config.benchmark.report_split = "test"  # = eval_split here, so it must equal the last logged test loss
  with tfds.testing.mock_data(num_examples=600):
    out = benchmark.benchmark(config, str(tmp_path / "runs"))
  for name, o in out["optimizers"].items():
    tuning = {float(k): v for k, v in o["tuning"].items()}
    assert o["learning_rate"] == min(tuning, key=tuning.get)  # the lowest final loss of the grid
    assert set(o["seeds"]) == {0, 1} and all(len(s["rows"]) == 2 for s in o["seeds"].values())
    for s in o["seeds"].values():
      assert s["report"]["step"] == 20
      assert s["report"]["loss"] == pytest.approx(s["rows"][-1]["test_loss"], rel=1e-5)
      assert s["report"]["error"] == pytest.approx(s["rows"][-1]["test_error"])
  path = benchmark.write_report(config, out, str(tmp_path / "report"), "cmd")
  text = open(path).read()
  assert "| sgd |" in text and "| scsgd |" in text and "Tuning" in text and "final test loss" in text
  for f in ("loss_vs_step.png", "loss_vs_train_time.png", "results.json", "metrics_scsgd_seed1.jsonl"):
    assert (tmp_path / "report" / f).exists(), f
  summary = open(benchmark.write_summary(str(tmp_path), ["other", "report"])).read()
  assert "| [report](report/README.md) | scsgd |" in summary and "| [report](report/README.md) | sgd |" in summary
  assert "No results yet for: other (" in summary


def test_tasks_are_the_configs_beside_the_one_run():
  assert benchmark.task_names("configs/benchmark/convex.py") == ["convex", "mnist", "shakespeare"]


def _shakespeare_source(*args, **kwargs):
  """tiny_shakespeare's shape (one example holding a whole text) in its 65-character vocabulary."""
  from experiments import data

  chars = np.random.default_rng(0).choice(list(data.SHAKESPEARE_CHARS), 64 * 40 + 1)
  return [{"text": "".join(chars).encode()}]


@pytest.mark.parametrize("task", ["convex", "mnist", "shakespeare"])
def test_every_optimizer_takes_steps_on_every_task(task, tmp_path):
  """Each task's own model and settings, every optimizer of its protocol, two steps on mock data
  (one for Sketchy on LeNet)."""
  import importlib

  from experiments import train

  config = importlib.import_module(f"configs.benchmark.{task}").get_config()
  config.download = False
  config.batch_size, config.max_train_examples, config.max_test_examples, config.eval_batch_size = 8, 64, 16, 16
  config.num_steps, config.train_log_every, config.eval_every, config.checkpoint_every = 2, 1, 2, 2
  source = dict(as_data_source_fn=_shakespeare_source) if config.dataset == "tiny_shakespeare" else {}
  names = benchmark.names(config)
  assert {"sgd", "scsgd", "adamw", "nadamw", "muon", "shampoo", "sketchy", "kfac", "scsgd_adamw"} <= set(names)
  # the peers broadcast implicitly; the library's own tests keep rank promotion an error (conftest)
  with tfds.testing.mock_data(num_examples=64, **source), jax.numpy_rank_promotion("allow"):
    if source:  # one record holds the text: the batch is checked against its 40 windows once read
      too_big = benchmark.run_config(config, "sgd", 0.01, 0, 2)
      too_big.batch_size = 41
      with pytest.raises(errors.ConfigError, match="=41 is larger than the 40 training windows of tiny_shakespeare"):
        train.train_and_evaluate(too_big, str(tmp_path / "too_big"))
    for name in names:
      # precondition-opt 0.3.0 gives an axis shorter than Sketchy's rank + 2 (LeNet's 1, 5, 5, 20) a full
      # inverse root padded to the largest statistic (800) at every step: ~50 s a step on this CPU, so
      # Sketchy takes one step on LeNet (the second step runs the same compiled code)
      steps = 1 if (task, name) == ("mnist", "sketchy") else 2
      lr = config.benchmark.default_lr[name]
      last = train.train_and_evaluate(benchmark.run_config(config, name, lr, 0, steps), str(tmp_path / name))
      assert last["step"] == steps and np.isfinite(last["test_loss"]) and np.isfinite(last["train_loss"]), name
