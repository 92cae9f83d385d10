"""The head-to-head harness: grids, tuning, target and ranking (hand-computed), the sanity anchors (brute
force), and on mock data: each run committed once, skipped when its settings match, re-run when they do not,
and a recorded run reproduced from its key."""

import importlib
import json
import os

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs.head_to_head import common
from configs.head_to_head import convex
from experiments.head_to_head import baselines
from experiments.head_to_head import benchmark
from experiments.head_to_head import benchmark_report
from experiments.run import data
from experiments.run import errors
from experiments.run import models
from experiments.optim import optimizers
from experiments.optim import registry
from experiments.run import train

# the head to head's checks: CI runs them in a step of their own when its files change (.ci/run)
pytestmark = pytest.mark.head_to_head



def _config():
  config = convex.task()
  config.benchmark.optimizers = ("sgd", "adamw", "scsgd")
  config.benchmark.seeds = (0, 1)
  return config


def test_grid_is_half_a_decade_apart_around_each_authors_rate():
  config = _config()
  assert benchmark.learning_rates(config, "sgd") == [0.00316, 0.01, 0.0316, 0.1]
  assert benchmark.learning_rates(config, "adamw") == [0.000316, 0.001, 0.00316, 0.01]
  assert benchmark.learning_rates(config, "muon") == [0.00632, 0.02, 0.0632, 0.2]
  assert benchmark.joint_points(config, "sgd") == [()]
  assert benchmark.joint_points(config, "kfac") == [(("damping", 0.001),), (("damping", 0.01),), (("damping", 0.1),)]
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


def test_each_run_carries_its_authors_settings_and_the_schedule():
  config = importlib.import_module("configs.head_to_head.shakespeare").task()
  cfg = benchmark.run_config(config, "adamw", benchmark.Point(0.003), 2)
  assert (cfg.optimizer.name, cfg.schedule.base, cfg.seed, cfg.schedule.name) == ("adamw", 0.003, 2, "warmup_cosine")
  assert (cfg.optimizer.adamw.b2, cfg.optimizer.adamw.weight_decay, cfg.optimizer.adamw.decay_matrices_only) == (
      0.99, 0.1, True)  # nanoGPT's shakespeare_char
  assert "benchmark" not in cfg
  muon = benchmark.run_config(config, "muon", benchmark.Point(0.02), 0, {"adam_learning_rate": 0.003})
  assert (muon.optimizer.muon.output_layer, muon.optimizer.muon.adam_learning_rate) == ("head", 0.003)
  kfac = benchmark.run_config(config, "kfac", benchmark.Point(0.01, (("damping", 0.1),)), 0)
  assert (kfac.optimizer.kfac.damping, kfac.optimizer.kfac.norm_constraint) == (0.1, 1e-3)
  assert benchmark.key("kfac", benchmark.Point(0.01, (("damping", 0.1),)), 1) == "kfac/lr0.01_damping0.1_seed1"


def _record(losses, ms_per_step, report_loss=None, commit="abc", diverged=False, code_hash=None, cpu=None,
            platform=None):
  rows = [{"step": 100 * (i + 1), "train_time": ms_per_step * 0.1 * (i + 1), "test_loss": v, "test_error": v / 10}
          for i, v in enumerate(losses)]
  rec = {"rows": rows, "diverged": diverged, "state_bytes": 100, "commit": commit, "load_average_1min": [0.5, 1.0],
         "config": {"resolved": {"optimizer.x": {}}}}
  if report_loss is not None:
    rec["report"] = {"loss": report_loss, "error": report_loss / 10}
  if code_hash is not None:
    rec["code_hash"] = code_hash
  if cpu is not None:
    rec["machine"] = {"cpu": cpu, **({"platform": platform} if platform else {})}
  return rec


def test_target_iterations_ranking_and_ratios_by_hand():
  config = _config()
  p = benchmark.Point

  def opt(lr, a, b, ms):
    return {"point": p(lr), "tried": {p(lr / 3.16): 9.0, p(lr): 0.1, p(lr * 3.16): 9.0},
            "seeds": {0: _record(a, ms, a[-1] + 0.01), 1: _record(b, ms, b[-1] + 0.01)}}

  results = {  # final losses: sgd median 0.45, adamw median 0.40 -> target 0.40
      "sgd": opt(0.01, [0.9, 0.6, 0.5], [0.9, 0.5, 0.4], 10),
      "adamw": opt(0.001, [0.8, 0.5, 0.4], [0.7, 0.45, 0.4], 10),
      "scsgd": opt(0.01, [0.5, 0.4, 0.3], [0.4, 0.35, 0.3], 20),
  }
  s = benchmark_report.summarize(config, results, {})
  assert s["target"] == pytest.approx(0.40)
  sgd, adamw, scsgd = (s["optimizers"][n] for n in ("sgd", "adamw", "scsgd"))
  assert sgd["reached"] == "1/2" and sgd["iterations_median"] is None and sgd["iterations_range"] == [300, 300]
  assert adamw["iterations_median"] == 300 and adamw["seconds_median"] == pytest.approx(3.0)
  assert scsgd["iterations_range"] == [100, 200] and scsgd["iterations_median"] == 150
  assert scsgd["step_ms_median"] == pytest.approx(20.0) and scsgd["step_time_vs_sgd"] == pytest.approx(2.0)
  assert scsgd["report_loss_median"] == pytest.approx(0.31) and not scsgd["at_grid_edge"]
  # final losses: sgd's seeds end at 0.5 and 0.4, scsgd's both at 0.3 (report: the final + 0.01)
  assert sgd["final_loss_range"] == pytest.approx([0.4, 0.5]) and sgd["report_loss_range"] == pytest.approx([0.41, 0.51])
  assert scsgd["final_loss_range"] == pytest.approx([0.3, 0.3])
  assert benchmark_report.with_range(0.45, sgd["final_loss_range"]) == "0.4500 [0.4000, 0.5000]"
  assert benchmark_report.with_range(0.3, scsgd["final_loss_range"]) == "0.3000"  # one value: no range
  assert benchmark_report.rank(s) == ["scsgd", "adamw", "sgd"]  # 150 < 300 < not reached by every seed


def test_rows_of_other_library_or_training_code_are_marked():
  """A table compares like with like only if every row ran the same code: rows whose code hash is not the
  most common one (or was never recorded) are marked, in the summary and the report."""
  config = _config()
  p = benchmark.Point

  def opt(code_hashes):
    return {"point": p(0.01), "tried": {p(0.01): 0.1},
            "seeds": {i: _record([0.5, 0.4], 10, 0.41, code_hash=h) for i, h in enumerate(code_hashes)}}

  same = benchmark_report.summarize(config, {"sgd": opt(["aa", "aa"]), "adamw": opt(["aa"])}, {})
  assert same["code_hashes"] == {"aa": 2} and not any(o["other_code"] for o in same["optimizers"].values())
  mixed = benchmark_report.summarize(config, {"sgd": opt(["aa", "aa"]), "adamw": opt(["aa"]),
                                              "scsgd": opt(["bb"]), "muon": opt([None])}, {})
  assert mixed["code_hashes"] == {"aa": 2, "bb": 1, benchmark_report.UNRECORDED: 1}
  assert {n for n, o in mixed["optimizers"].items() if o["other_code"]} == {"scsgd", "muon"}
  assert (mixed["optimizers"]["scsgd"]["code_hashes"], mixed["optimizers"]["sgd"]["code_hashes"]) == (["bb"], ["aa"])


def test_step_time_ratios_only_between_rows_of_one_machine(tmp_path):
  """Rows that ran on different processors have no step-time ratio: each row lists its machines, the ratio to
  SGD stays only for a row whose every seed ran on the one processor all of SGD's seeds ran on."""
  config = _config()
  p = benchmark.Point

  def opt(ms, cpus):
    return {"point": p(0.01), "tried": {p(0.01): 0.1},
            "seeds": {i: _record([0.5, 0.4], ms, 0.41, cpu=c) for i, c in enumerate(cpus)}}

  results = {"sgd": opt(10, ["intel", "intel"]), "adamw": opt(15, ["intel"]), "muon": opt(30, ["amd"]),
             "scsgd": opt(20, ["amd", "intel"])}
  s = benchmark_report.summarize(config, results, {})
  assert s["machines"] == ["amd", "intel"]
  ratios = {n: o["step_time_vs_sgd"] for n, o in s["optimizers"].items()}
  assert ratios == {"sgd": pytest.approx(1.0), "adamw": pytest.approx(1.5), "muon": None, "scsgd": None}
  assert s["optimizers"]["scsgd"]["machines"] == ["amd", "intel"]
  text = open(benchmark_report.write_report(config, results, {}, str(tmp_path), "cmd")).read()
  assert "**The rows ran on 2 machines**" in text and "amd: " in text and "one after another on the machines" in text
  one = benchmark_report.summarize(config, {"sgd": opt(10, ["intel"]), "adamw": opt(15, ["intel"])}, {})
  assert one["machines"] == ["intel"] and one["optimizers"]["adamw"]["step_time_vs_sgd"] == pytest.approx(1.5)
  # one processor name on two hosts' kernel builds (VMs of one name, of different speeds) is two machines
  on = lambda ms, platform: {"point": p(0.01), "tried": {p(0.01): 0.1},
                             "seeds": {0: _record([0.5, 0.4], ms, 0.41, cpu="amd", platform=platform)}}
  two = benchmark_report.summarize(config, {"sgd": on(10, "linux-v1"), "adamw": on(15, "linux-v2"),
                                            "muon": on(20, "linux-v1")}, {})
  assert two["machines"] == ["amd (linux-v1)", "amd (linux-v2)"]
  assert two["optimizers"]["adamw"]["step_time_vs_sgd"] is None
  assert two["optimizers"]["muon"]["step_time_vs_sgd"] == pytest.approx(2.0)


def test_records_carry_the_code_hash_of_library_and_training_code(tmp_path):
  from experiments.run import report
  root = tmp_path / "repo"
  for entry in report.TRAINING_CODE:
    target = root / entry / "m.py" if not entry.endswith(".py") else root / entry
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("x = 1\n")
  (root / "experiments" / "run" / "report.py").write_text("report = 1\n")
  before = report.code_hash(str(root))
  (root / "experiments" / "run" / "report.py").write_text("report = 2\n")  # a report change is not the code's
  assert report.code_hash(str(root)) == before
  (root / "scsgd_jax" / "m.py").write_text("x = 2\n")
  assert report.code_hash(str(root)) != before
  checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert report.provenance()["code_hash"] == report.code_hash(checkout)
  # every entry is in the checkout: a module that moved would silently leave the hash
  assert [e for e in report.TRAINING_CODE if not os.path.exists(os.path.join(checkout, e))] == []


def test_anchors_by_brute_force():
  fit = data.Split(np.zeros((6, 3), np.int32), np.array([[1, 2, 1], [1, 1, 0]] * 3, np.int32))
  fit = fit._replace(inputs=np.array([[0, 1, 2], [0, 1, 1]] * 3, np.int32))
  test = data.Split(np.array([[0, 1]], np.int32), np.array([[1, 2]], np.int32))
  got = baselines.trivial_losses("tiny_shakespeare", fit, test)
  v = 65
  counts = np.bincount(fit.labels.ravel(), minlength=v) + 1.0
  assert got["unigram"] == pytest.approx(-np.mean(np.log(counts[[1, 2]] / counts.sum())))
  pairs = {(a, b): 0 for a in range(v) for b in range(v)}
  for a, b in zip(fit.inputs.ravel(), fit.labels.ravel()):
    pairs[(a, b)] += 1
  prob = lambda a, b: (pairs[(a, b)] + 1) / (sum(pairs[(a, c)] for c in range(v)) + v)  # noqa: E731
  assert got["bigram"] == pytest.approx(-np.mean([np.log(prob(0, 1)), np.log(prob(1, 2))]))
  images = baselines.trivial_losses("mnist", data.Split(None, np.array([3, 3, 3, 1])), data.Split(None, np.array([3, 1])))
  freq = (np.bincount([3, 3, 3, 1], minlength=10) + 1.0) / 14
  assert images["class frequencies"] == pytest.approx(-np.mean(np.log(freq[[3, 1]])))
  assert images["majority class error"] == 0.5


def _tiny(config):
  config.download = False
  config.max_train_examples, config.max_test_examples = 512, 128
  config.train_split, config.eval_split = "train", "test"
  config.num_steps, config.eval_every, config.train_log_every, config.checkpoint_every = 20, 10, 10, 10
  config.benchmark.all_optimizers = ("sgd", "scsgd", "adamw")
  config.benchmark.optimizers = ("sgd", "scsgd")
  config.benchmark.grid = (1.0, 3.16)
  config.benchmark.extend_edge = 0
  config.benchmark.target_from = ("sgd",)
  config.benchmark.report_split = "test"  # = eval_split here, so it must equal the last logged test loss
  return config


def test_runs_are_committed_once_skipped_when_unchanged_rerun_when_changed(tmp_path):
  config = _tiny(_config())
  results, work = str(tmp_path / "results" / "convex"), str(tmp_path / "work")
  with tfds.testing.mock_data(num_examples=600):
    found = benchmark.benchmark(config, work, results, "cmd", ["convex", "other"])
    runs = sorted(os.path.relpath(os.path.join(d, f), os.path.join(results, "runs"))
                  for d, _, fs in os.walk(os.path.join(results, "runs")) for f in fs)
    assert len(runs) == 6 and {r.split("/")[0] for r in runs} == {"sgd", "scsgd"}, runs  # 2 rates + 1 more seed
    for name, o in found.items():
      losses = {p.learning_rate: v for p, v in o["tried"].items()}
      assert o["point"].learning_rate == min(losses, key=losses.get)  # the lowest final loss of the grid
      assert set(o["seeds"]) == {0, 1}
      for rec in o["seeds"].values():
        assert rec["commit"] and rec["versions"]["jax"] and rec["machine"]["cores"]
        assert rec["config"]["resolved"][f"optimizer.{name}"]  # the library's defaults written out
        assert rec["report"]["step"] == 20
        assert rec["report"]["loss"] == pytest.approx(rec["rows"][-1]["test_loss"], rel=1e-5)
        assert rec["command"].startswith("cmd --config.benchmark.rerun=")
    text = open(os.path.join(results, "README.md")).read()
    assert "| 1 |" in text and "Not run yet (or not complete): adamw." in text and "Sanity anchors" in text
    for f in ("loss_vs_step.png", "loss_vs_train_time.png", "results.json"):
      assert os.path.exists(os.path.join(results, f)), f
    summary = open(os.path.join(str(tmp_path / "results"), "README.md")).read()
    assert "| [convex](convex/README.md) | 1 |" in summary and "No results yet for: other" in summary

    # again: everything is committed with today's settings, so nothing trains
    harness_runs = []
    original = benchmark.train_one
    benchmark.train_one = lambda *a, **k: harness_runs.append(a) or original(*a, **k)
    try:
      benchmark.benchmark(config, work, results, "cmd")
      assert harness_runs == []
      # a changed setting of one optimizer re-runs that optimizer's runs only
      config.optimizer.scsgd = dict(rank=3)
      benchmark.benchmark(config, work, results, "cmd")
      assert {os.path.basename(os.path.dirname(a[1])) for a in harness_runs} == {"scsgd"} and len(harness_runs) >= 3
    finally:
      benchmark.train_one = original
    for f in os.listdir(os.path.join(results, "runs", "scsgd")):
      rec = json.load(open(os.path.join(results, "runs", "scsgd", f)))
      assert rec["config"]["optimizer"]["scsgd"]["rank"] == 3, f

    # a recorded run, trained again from its key, ends at the same loss
    again = benchmark.rerun(config, work, results, "sgd/lr0.01_seed0")
    assert again["rerun"] == pytest.approx(again["committed"], rel=1e-6)
    with pytest.raises(errors.ConfigError, match="no committed run 'sgd/lr9_seed0'"):
      benchmark.rerun(config, work, results, "sgd/lr9_seed0")


def test_tasks_are_the_configs_beside_the_one_run():
  assert benchmark.task_names("configs/head_to_head/convex.py") == ["convex", "mnist", "shakespeare",
                                                                     "shakespeare_large"]


def _shakespeare_source(*args, **kwargs):
  """tiny_shakespeare's shape (one example holding a whole text) in its 65-character vocabulary."""
  chars = np.random.default_rng(0).choice(list(data.SHAKESPEARE_CHARS), 64 * 40 + 1)
  return [{"text": "".join(chars).encode()}]


@pytest.mark.parametrize("task", ["convex", "mnist", "shakespeare"])
def test_every_optimizer_takes_steps_on_every_task(task, tmp_path, monkeypatch):
  """Each task's own model and settings, every optimizer of the harness (its tables' rows and the peers no
  table runs today) at its authors' settings, two steps on mock data. The character transformer keeps one of its
  three blocks (the same layers, less to compile: with three this was the suite's slowest test)."""
  transformer = models.CharTransformer
  monkeypatch.setattr(models, "CharTransformer", lambda **kwargs: transformer(**{**kwargs, "layers": 1}))
  config = importlib.import_module(f"configs.head_to_head.{task}").task()
  config.download = False
  config.train_split, config.eval_split = "train", "test"
  config.batch_size, config.max_train_examples, config.max_test_examples, config.eval_batch_size = 8, 64, 16, 16
  config.num_steps, config.train_log_every, config.eval_every, config.checkpoint_every = 2, 1, 2, 2
  source = dict(as_data_source_fn=_shakespeare_source) if config.dataset == "tiny_shakespeare" else {}
  assert set(benchmark.names(config)) == set(common.ROWS)
  names = sorted(set(optimizers.OPTIMIZERS) - {"adam"})  # every row of the harness, in a table today or not
  # the peers broadcast implicitly; the library's own tests keep rank promotion an error (conftest)
  with tfds.testing.mock_data(num_examples=64, **source), jax.numpy_rank_promotion("allow"):
    for name in names:
      lr = benchmark.learning_rates(config, name)[1]
      arg = registry.entry(name).adam_rate
      extra = {arg: 1e-3} if arg else {}
      joint = benchmark.joint_points(config, name)[0]
      cfg = benchmark.run_config(config, name, benchmark.Point(lr, joint), 0, extra)
      last = train.train_and_evaluate(cfg, str(tmp_path / name))
      assert last["step"] == 2 and np.isfinite(last["test_loss"]) and np.isfinite(last["train_loss"]), name


def _seed0_grid(folder, name, points, diverged=()):
  """Committed seed-0 records of ``name`` under ``folder``: ``{Point: final loss}``, the points in
  ``diverged`` recorded as diverged runs."""
  for point, loss in points.items():
    rec = _record([0.5, loss], 10.0, diverged=point in diverged)
    rec.update(optimizer=name, learning_rate=point.learning_rate, joint=dict(point.joint), seed=0)
    path = folder / "runs" / name / f"{point.tag()}_seed0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))


def test_points_from_an_earlier_protocol_stand_and_no_grid_runs(tmp_path):
  """With benchmark.points_from, an optimizer with a committed seed-0 grid there takes the rate it chose (a
  diverged point loses), without training; one without such a grid tunes as before (the loss function runs)."""
  earlier = tmp_path / "earlier"
  p = benchmark.Point
  _seed0_grid(earlier, "sgd", {p(0.01): 0.4, p(0.1): 0.3, p(1.0): 0.1}, diverged={p(1.0)})
  grid = benchmark.earlier_grid(str(earlier), "sgd")
  assert grid[benchmark.Point(0.1)] == pytest.approx(0.3) and grid[benchmark.Point(1.0)] == float("inf")
  assert benchmark.earlier_grid(str(earlier), "adamw") == {} and benchmark.earlier_grid("", "sgd") == {}
  config = _config()
  config.benchmark.points_from = str(earlier)
  harness = benchmark.Harness(config, str(tmp_path / "work"), str(tmp_path / "results"), "cmd")
  harness.run = lambda *a: pytest.fail(f"no run expected: {a}")
  best, tried = harness.choose("sgd")
  assert best == benchmark.Point(0.1) and set(tried) == set(grid)
  config.benchmark.retune = ("sgd",)  # a row whose step changed since: its earlier grid does not stand
  ran = []
  harness.run = lambda name, point, seed: ran.append(point.learning_rate) or _record([0.5, 0.2], 10.0)
  best, tried = harness.choose("sgd")
  assert set(benchmark.learning_rates(config, "sgd")) <= set(ran) and set(tried) == {benchmark.Point(lr) for lr in ran}


def test_centre_from_centres_each_rows_grid_on_the_point_it_chose_on_another_task(tmp_path):
  """With benchmark.centre_from, a row's grid is the grid's multiples of the rate it chose on the first listed
  task holding its seed-0 grid, its joint settings fixed to the chosen ones; a row none holds keeps its
  authors' rate and joint grid."""
  p = benchmark.Point
  first, second = tmp_path / "first", tmp_path / "second"
  _seed0_grid(first, "sgd", {p(0.01): 0.5, p(0.1): 0.3, p(1.0): 0.4})
  _seed0_grid(second, "sgd", {p(0.001): 0.1})  # listed later: the first dir's grid counts
  _seed0_grid(second, "kfac", {p(1.0, (("damping", 0.001),)): 0.2, p(0.1, (("damping", 0.01),)): 0.25})
  config = _config()
  config.benchmark.grid = (0.316, 1.0, 3.16)
  config.benchmark.centre_from = (str(first), str(second))
  assert benchmark.learning_rates(config, "sgd") == [0.0316, 0.1, 0.316]
  assert benchmark.joint_points(config, "sgd") == [()]
  assert benchmark.learning_rates(config, "kfac") == [0.316, 1.0, 3.16]
  assert benchmark.joint_points(config, "kfac") == [(("damping", 0.001),)]
  assert benchmark.learning_rates(config, "adamw") == [0.000316, 0.001, 0.00316]  # its authors' 1e-3
  config.benchmark.centre_as = {"adamw": "sgd"}  # a variant of a row: centred on that row's choice
  assert benchmark.learning_rates(config, "adamw") == [0.0316, 0.1, 0.316]
  config.benchmark.centre_from = ()
  assert len(benchmark.joint_points(config, "kfac")) == 3 and benchmark.learning_rates(config, "sgd")[1] == 0.01


def test_given_points_keep_their_rate_and_run_only_their_seed_0_as_their_grid(tmp_path):
  """benchmark.points: a kept row runs the point given (a rate, or a rate and its joint settings) with no grid, its
  seed-0 loss its one grid point; benchmark.centres centres a row's grid on the point given, joint settings fixed."""
  p = benchmark.Point
  config = _config()
  config.benchmark.points = {"sgd": 0.1, "kfac": {"learning_rate": 1.0, "damping": 0.01}}
  config.benchmark.centres = {"adamw": 0.01, "kfac": {"learning_rate": 0.5, "damping": 0.1}}
  harness = benchmark.Harness(config, str(tmp_path / "work"), str(tmp_path / "results"), "cmd")
  ran = []
  harness.run = lambda name, point, seed: ran.append((name, point, seed)) or _record([0.5, 0.25], 10.0)
  assert harness.choose("sgd") == (p(0.1), {p(0.1): 0.25}) and ran == [("sgd", p(0.1), 0)]
  assert harness.choose("kfac")[0] == p(1.0, (("damping", 0.01),))
  assert benchmark.learning_rates(config, "adamw") == [0.00316, 0.01, 0.0316, 0.1]  # x the grid (0.316 .. 10)
  assert benchmark.joint_points(config, "kfac") == [(("damping", 0.1),)]
  assert benchmark.learning_rates(config, "kfac")[1] == 0.5


@pytest.mark.parametrize("settings,culprit", [
    ({"points_from": "experiments/results/no_such_table"}, "points_from: .* holds no runs"),
    ({"centre_from": ("experiments/results/no_such_table",)}, "centre_from: .* holds no runs"),
    ({"points": {"lion": 0.1}}, "points: 'lion' is not a row"),
    ({"centres": {"sgd": "fast"}}, "centres.sgd: 'fast' is not a rate"),
    ({"points": {"sgd": True}}, "points.sgd: True is not a rate"),
    ({"points": {"sgd": {"damping": 0.1}}}, "points.sgd: .* is not a rate"),
    ({"points": {"sgd": {"learning_rate": "0.1"}}}, "points.sgd: .* is not a rate"),
    ({"points": {"kfac": 0.1}}, r"points.kfac: its joint settings are \[\], the row tunes \['damping'\]"),
    ({"centres": {"sgd": {"learning_rate": 0.1, "damping": 0.1}}}, "centres.sgd: its joint settings are"),
    ({"points": {"sgd": 0.1}, "centres": {"sgd": 0.1}}, r"both give \['sgd'\]"),
    ({"retune": ("scsgd",)}, "retune .* acts only with config.benchmark.points_from"),
    ({"retune": ("scsgd",), "points_from": "<runs>", "points": {"scsgd": 0.1}}, "retune tunes again"),
])
def test_given_points_or_results_dirs_that_name_nothing_or_a_retuned_row_are_refused_before_any_run(settings, culprit,
                                                                                                   tmp_path):
  config = _config()
  (tmp_path / "runs").mkdir()
  for field, value in settings.items():
    config.benchmark[field] = str(tmp_path) if value == "<runs>" else value
  with pytest.raises(errors.ConfigError, match=culprit):
    benchmark.validate(config)


def test_the_sizing_study_runs_the_larger_transformers_rows_at_the_points_its_committed_runs_record():
  """configs/studies/benchmark_sizing.py rebuilds experiments/results/benchmark_sizing/shakespeare_large: the final
  table's model and data, 60 iterations a row, each at the rate (and K-FAC's damping) its committed run holds."""
  config = importlib.import_module("configs.studies.benchmark_sizing").get_config()
  task = importlib.import_module("configs.head_to_head.shakespeare_large").task()
  assert (config.model, config.dataset, config.num_steps) == (task.model, task.dataset, 60)
  with jax.numpy_rank_promotion("allow"):  # kfac-jax's own code promotes ranks
    benchmark.validate(config)
  runs = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results", "benchmark_sizing",
                      "shakespeare_large", benchmark.RUNS)
  recorded = {}
  for name in os.listdir(runs):
    for file in os.listdir(os.path.join(runs, name)):
      rec = benchmark.read_record(os.path.join(runs, name, file))
      recorded[name] = benchmark.record_point(rec)
      assert rec["config"]["num_steps"] == config.num_steps, file
  assert sorted(recorded) == sorted(config.benchmark.all_optimizers)
  for name, point in recorded.items():
    assert benchmark.learning_rates(config, name) == [point.learning_rate], name
  assert recorded["kfac"].joint == (("damping", 0.001),)


_KEPT = ["adamw", "kfac", "muon", "nadamw", "sgd"]


@pytest.mark.parametrize("task,cadence,seeds,kept", [("mnist", 25, 5, _KEPT), ("convex", 25, 5, _KEPT),
                                                     ("shakespeare", 10, 5, _KEPT),
                                                     ("shakespeare_large", 25, 3, ["adamw", "kfac", "muon", "sgd"])])
def test_final_tables_keep_the_rows_whose_updates_did_not_change_and_retune_the_others_around_their_choice(
    task, cadence, seeds, kept):
  """configs/head_to_head/: every row 5 seeds (the larger transformer 3), read every 25 iterations (the character
  transformer 10), one frozen code version; the kept rows run the point written in the config (no grid), every
  other row three rates half a decade apart around its centre."""
  config = importlib.import_module(f"configs.head_to_head.{task}").get_config()
  b = config.benchmark
  assert config.eval_every == cadence and b.seeds == tuple(range(seeds)) and b.grid == (0.316, 1.0, 3.16)
  assert sorted(b.points) == kept and b.frozen_code == "a876122862c78096"
  assert set(b.centres) | set(b.points) == set(b.all_optimizers) and not set(b.centres) & set(b.points)
  tuned = b.all_optimizers[-1]
  centre = benchmark.grid.given(config, "centres", tuned).learning_rate
  assert benchmark.learning_rates(config, tuned) == [float(f"{centre * m:.3g}") for m in b.grid]
  with jax.numpy_rank_promotion("allow"):  # kfac-jax's own code promotes ranks
    benchmark.validate(config)


def test_a_run_that_explodes_before_its_first_log_is_marked_diverged(tmp_path):
  """The logistic task at rate 1e30 stays finite and its loss falls after the first log; the record compares its
  end with the init's evaluation (recorded as ``start_loss``) and marks it diverged. A sane rate is not."""
  config = _tiny(_config())
  with tfds.testing.mock_data(num_examples=600):
    for rate, diverged in ((1e30, True), (0.01, False)):
      cfg = benchmark.run_config(config, "sgd", benchmark.Point(rate, ()), 0)
      out = benchmark.train_one(cfg, str(tmp_path / f"lr{rate:g}"), "")
      finals = [r["test_loss"] for r in out["rows"] if "test_loss" in r]
      start = train.evaluate_start(cfg, cfg.eval_split)["loss"]
      assert out["start_loss"] == pytest.approx(start) and start == pytest.approx(np.log(10), rel=1e-6)
      assert out["diverged"] == diverged, (rate, start, finals)
      if diverged:  # finite, and falling from its first log: the old reference missed it
        assert np.isfinite(finals).all() and finals[-1] < finals[0]


@pytest.mark.parametrize("holes", [1, 2])
def test_a_run_whose_metrics_miss_an_evaluation_is_trained_again_from_scratch(holes, tmp_path, monkeypatch):
  """A finished run's metrics with a hole (rows lost before a resume) never become a record: the run is trained
  once more from an empty workdir; a hole again stops the harness naming the steps."""
  config = _config()
  config.num_steps, config.eval_every = 30, 10
  cfg = benchmark.run_config(config, "sgd", benchmark.Point(0.1, ()), 0)
  workdir = str(tmp_path / "run")
  calls = []

  def fake_training(cfg, workdir):
    calls.append(sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None)
    os.makedirs(workdir, exist_ok=True)
    steps = [20, 30] if len(calls) <= holes else [10, 20, 30]  # the first evaluation lost
    with open(os.path.join(workdir, train.METRICS_FILE), "w") as f:
      f.writelines(json.dumps({"step": s, "test_loss": 1.0 / s}) + "\n" for s in steps)

  monkeypatch.setattr(train, "train_and_evaluate", fake_training)
  monkeypatch.setattr(train, "evaluate_start", lambda cfg, split: {"step": 0, "loss": 2.3, "error": 0.9})
  monkeypatch.setattr(benchmark, "state_bytes", lambda cfg: 0)
  if holes == 2:
    with pytest.raises(errors.WorkdirError, match=r"miss the evaluations of steps \[10\], again after training it"):
      benchmark.train_one(cfg, workdir, "")
    return
  out = benchmark.train_one(cfg, workdir, "")
  assert [r["step"] for r in out["rows"]] == [10, 20, 30]
  assert calls == [None, None]  # the second training started from no workdir at all
  assert benchmark.missing_evaluations(cfg, [{"step": 30, "test_loss": 1.0}]) == [10, 20]


def test_frozen_code_keeps_its_rows_whose_library_defaults_moved_on_and_no_others(tmp_path):
  """Under benchmark.frozen_code a committed record of that code version whose settings differ from today's in a
  library default alone stands; a record of another version, a changed config key, or no frozen_code: run again."""
  config = _config()
  harness = benchmark.Harness(config, str(tmp_path / "work"), str(tmp_path / "results"), "cmd")
  point = benchmark.Point(0.1)
  now = train.record(benchmark.run_config(config, "scsgd", point, 0))
  key = benchmark.key("scsgd", point, 0)

  def write(code_hash, edit):
    cfg = json.loads(json.dumps(now))
    edit(cfg)
    evaluations = benchmark.missing_evaluations(benchmark.run_config(config, "scsgd", point, 0), [])
    rec = {"config": cfg, "rows": [{"step": s, "test_loss": 1.0} for s in evaluations], "diverged": False,
           "commit": "c", "optimizer": "scsgd", "learning_rate": 0.1, "joint": {}, "seed": 0, "code_hash": code_hash}
    os.makedirs(os.path.dirname(harness.path(key)), exist_ok=True)
    with open(harness.path(key), "w") as f:
      json.dump(rec, f)

  default_moved = lambda cfg: cfg["resolved"]["optimizer.scsgd"].update(rank=7)
  key_changed = lambda cfg: cfg["optimizer"]["scsgd"].update(rank=7)
  for frozen, code_hash, edit, kept in [(None, "h1", default_moved, False), ("h1", "h1", default_moved, True),
                                        ("h1", "h2", default_moved, False), ("h1", "h1", key_changed, False),
                                        (None, "h1", lambda cfg: None, True)]:
    config.benchmark.frozen_code = frozen
    write(code_hash, edit)
    assert (harness.committed("scsgd", point, 0) is not None) == kept, (frozen, code_hash)


def test_frozen_code_refuses_to_train_on_another_code_version(tmp_path, monkeypatch):
  """A table pinned to a code version gets no row trained by another (the error names the run and both versions,
  and comes before any training); the pinned version trains."""
  config = _config()
  harness = benchmark.Harness(config, str(tmp_path / "work"), str(tmp_path / "results"), "cmd")
  monkeypatch.setattr(benchmark.report, "provenance", lambda: {"code_hash": "today"})
  trained = []

  class Trained(Exception):
    pass

  def train_one(*args, **kwargs):
    trained.append(args)
    raise Trained

  monkeypatch.setattr(benchmark, "train_one", train_one)
  config.benchmark.frozen_code = "pinned"
  with pytest.raises(errors.ConfigError, match=r"scsgd/lr0.1_seed0: .*pinned.*today"):
    harness.run("scsgd", benchmark.Point(0.1), 0)
  assert not trained
  config.benchmark.frozen_code = "today"
  with pytest.raises(Trained):
    harness.run("scsgd", benchmark.Point(0.1), 0)
  assert len(trained) == 1


def test_time_to_target_and_the_rankings_each_way_by_hand():
  """Each row's training seconds to the target (the first evaluation at or below it, median of seeds) and its race
  in SGD's steps (iterations to it times its step over SGD's); the report says where the race by time and the
  final loss rank rows otherwise than the race by iterations."""
  config = _config()
  p = benchmark.Point

  def opt(losses, ms):
    return {"point": p(0.01), "tried": {p(0.01): 0.1}, "seeds": {0: _record(losses, ms, losses[-1])}}

  results = {  # target 0.40 (adamw's final); evaluations every 100 steps at ms * 0.1 s each
      "sgd": opt([0.9, 0.6, 0.45], 10),
      "adamw": opt([0.8, 0.5, 0.40], 10),   # reaches at 300 steps, 3 s
      "kfac": opt([0.40, 0.3, 0.1], 50),    # at 100 steps, 5 s: first by iterations, lowest final loss
      "scsgd": opt([0.5, 0.4, 0.35], 10),   # at 200 steps, 2 s: first by time
  }
  s = benchmark_report.summarize(config, results, {})
  o = s["optimizers"]
  assert [o[n]["seconds_median"] for n in ("adamw", "kfac", "scsgd")] == pytest.approx([3.0, 5.0, 2.0])
  assert [o[n]["sgd_steps_to_target"] for n in ("adamw", "kfac", "scsgd")] == pytest.approx([300, 500, 200])
  assert o["sgd"]["seconds_median"] is None and o["sgd"]["sgd_steps_to_target"] is None
  by = benchmark_report.orders(s)
  assert by["iterations"][:3] == ["kfac", "scsgd", "adamw"] and by["seconds"][:3] == ["scsgd", "adamw", "kfac"]
  said = " ".join(benchmark_report.orders_said(s))
  assert "scsgd reaches the target in the fewest training seconds, kfac in the fewest iterations" in said
  assert "race and the final loss rank rows differently" not in said  # kfac is first both ways
  results["scsgd"] = opt([0.5, 0.4, 0.05], 10)  # scsgd now ends lowest, the target unchanged
  said = " ".join(benchmark_report.orders_said(benchmark_report.summarize(config, results, {})))
  assert "kfac reaches the target first, scsgd ends lowest" in said
