"""The head to head's records survive what breaks a long benchmark: a harness killed mid-task, two harnesses
on one task, a damaged or partial record, a write that fails (full or read-only disk), and a report built
while some optimizer's grid is incomplete. Training is replaced by a stand-in that writes a plausible record
at once, so each fault is injected into the harness itself (tfds mock data for the anchors)."""

import errno
import json
import os

import pytest
import tensorflow_datasets as tfds

from configs.head_to_head import convex
from experiments.head_to_head import benchmark
from experiments.run import cli
from experiments.run import errors
from experiments.run import report
from experiments.run import train
from experiments.run import workdir as workdir_lib

# the head to head's checks: CI runs them in a step of their own when its files change (.ci/run)
pytestmark = pytest.mark.head_to_head



def _config():
  config = convex.task()
  config.download = False
  config.max_train_examples, config.max_test_examples = 64, 32
  config.train_split, config.eval_split = "train", "test"
  config.num_steps, config.eval_every = 20, 10  # the stand-in's records evaluate at steps 10 and 20
  config.benchmark.all_optimizers = ("sgd", "scsgd")
  config.benchmark.optimizers = ("sgd", "scsgd")
  config.benchmark.grid = (1.0, 3.16)
  config.benchmark.extend_edge = 0
  config.benchmark.seeds = (0, 1)
  config.benchmark.target_from = ("sgd",)
  return config


class FakeTraining:
  """``benchmark.train_one`` that trains nothing: a record whose loss depends on the rate; ``die_at``: the
  call (1-based) that is killed instead, as a harness killed in the middle of a run."""

  def __init__(self, die_at=None):
    self.calls, self.die_at = [], die_at

  def __call__(self, cfg, workdir, report_split):
    self.calls.append(os.path.relpath(workdir, os.path.dirname(os.path.dirname(workdir))))
    if self.die_at is not None and len(self.calls) == self.die_at:
      raise KeyboardInterrupt
    loss = 1.0 + abs(cfg.schedule.base - 0.03) + 0.01 * cfg.seed
    rows = [{"step": s, "train_time": 0.1 * s, "test_loss": loss + 1.0 / s, "test_error": 0.1} for s in (10, 20)]
    return {"config": train.record(cfg), "diverged": False, "rows": rows, "state_bytes": 8,
            "load_average_1min": [0.0, 0.0], "report": {"step": 20, "loss": loss, "error": 0.1}}


@pytest.fixture
def task(tmp_path, monkeypatch):
  with tfds.testing.mock_data(num_examples=64):
    yield str(tmp_path / "results" / "convex"), str(tmp_path / "work")


def _records(results):
  root = os.path.join(results, benchmark.RUNS)
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_a_killed_harness_resumes_without_losing_or_repeating_a_run(task, monkeypatch):
  results, work = task
  killed = FakeTraining(die_at=4)  # sgd's 3 runs finish, scsgd's first is killed
  monkeypatch.setattr(benchmark, "train_one", killed)
  with pytest.raises(KeyboardInterrupt):
    benchmark.benchmark(_config(), work, results, "cmd")
  assert len(_records(results)) == 3 and not [f for f in _records(results) if not f.endswith(".json")]
  # the report of what is complete says what is not
  again = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", again)
  config = _config()
  config.benchmark.optimizers = ("sgd",)
  benchmark.benchmark(config, work, results, "cmd")
  assert again.calls == []
  readme = open(os.path.join(results, "README.md")).read()
  assert "Not run yet (or not complete): scsgd." in readme
  assert json.load(open(os.path.join(results, "results.json")))["missing"] == ["scsgd"]
  # the same command as the killed one: only what is missing trains, each run once
  benchmark.benchmark(_config(), work, results, "cmd")
  assert sorted(again.calls) == sorted(set(again.calls)) and len(again.calls) == 3
  assert all(c.startswith("scsgd/") for c in again.calls)
  assert len(_records(results)) == 6
  assert "Not run yet" not in open(os.path.join(results, "README.md")).read()


def test_a_second_harness_on_the_same_task_is_refused_in_one_line(task, monkeypatch):
  results, work = task
  fake = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", fake)
  os.makedirs(results)
  with workdir_lib.lock(results, benchmark.HARNESS_LOCK, "harness"):  # a live harness holds the task
    with pytest.raises(errors.WorkdirError) as info:
      benchmark.benchmark(_config(), work, results, "cmd")
  line, code = cli.message(info.value)
  assert line.startswith(f"error: {results} is in use by another harness (pid {os.getpid()})") and code == 1
  assert fake.calls == [] and _records(results) == []
  benchmark.benchmark(_config(), work, results, "cmd")  # released: it runs
  assert len(fake.calls) == 6


@pytest.mark.parametrize("damage", ["torn", "not_json", "partial"])
def test_a_damaged_record_is_named_and_run_again(task, monkeypatch, capsys, damage):
  results, work = task
  fake = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", fake)
  benchmark.benchmark(_config(), work, results, "cmd")
  path = os.path.join(results, benchmark.RUNS, "sgd", "lr0.01_seed0.json")
  text = open(path).read()
  with open(path, "w") as f:
    if damage == "torn":
      f.write(text[: len(text) // 2])
    elif damage == "not_json":
      f.write("\x00" * 64)
    else:  # valid JSON without the metrics
      rec = json.loads(text)
      del rec["rows"]
      json.dump(rec, f)
  fake.calls.clear()
  capsys.readouterr()
  benchmark.benchmark(_config(), work, results, "cmd")
  assert f"{path}: damaged record" in capsys.readouterr().err
  assert fake.calls == ["sgd/lr0.01_seed0"]  # that run alone, once
  assert json.load(open(path))["rows"]  # whole again


def test_a_record_write_that_fails_keeps_the_old_record_whole(task, monkeypatch):
  """A full disk in the middle of writing a record: the old record stays as it was, no temporary file is
  left, and the failure is one line naming the file."""
  results, work = task
  monkeypatch.setattr(benchmark, "train_one", FakeTraining())
  benchmark.benchmark(_config(), work, results, "cmd")
  path = os.path.join(results, benchmark.RUNS, "sgd", "lr0.01_seed0.json")
  before = open(path).read()
  def disk_full_at_fsync(fd):  # the new record is written, but the disk fills before it is on disk
    raise OSError(errno.ENOSPC, "No space left on device", path)

  monkeypatch.setattr(workdir_lib.os, "fsync", disk_full_at_fsync)
  with pytest.raises(OSError) as info:
    report.write_results(os.path.dirname(path), {"key": "x"}, "cmd", filename=os.path.basename(path))
  assert open(path).read() == before
  assert [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")] == []
  line, code = cli.message(info.value)
  assert line.startswith("error: cannot write ") and "No space left on device" in line and code == 1


def test_a_read_only_results_directory_is_one_line_before_anything_trains(task, monkeypatch):
  results, work = task
  fake = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", fake)
  os.makedirs(results)

  def read_only(path, *args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", path)

  monkeypatch.setattr(workdir_lib, "open", read_only, raising=False)
  with pytest.raises(OSError) as info:
    benchmark.benchmark(_config(), work, results, "cmd")
  line, _ = cli.message(info.value)
  assert line == f"error: cannot write {os.path.join(results, benchmark.HARNESS_LOCK)}: Read-only file system"
  assert fake.calls == []


def test_a_record_cut_short_is_named_and_run_again(task, monkeypatch, capsys):
  results, work = task
  fake = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", fake)
  benchmark.benchmark(_config(), work, results, "cmd")
  path = os.path.join(results, benchmark.RUNS, "sgd", "lr0.01_seed0.json")
  rec = json.load(open(path))
  rec["rows"] = rec["rows"][:1]  # parses, every key there: its metrics cut to half the budget
  json.dump(rec, open(path, "w"))
  fake.calls.clear()
  capsys.readouterr()
  benchmark.benchmark(_config(), work, results, "cmd")
  assert f"{path}: incomplete record (no evaluation at steps [20]): run again" in capsys.readouterr().err
  assert fake.calls == ["sgd/lr0.01_seed0"] and len(json.load(open(path))["rows"]) == 2


def test_a_finite_explosion_is_judged_against_the_loss_before_the_first_step():
  """The logistic task at rate 1e30 (Nesterov SGD): its first log is already the exploded loss, and its loss then
  falls, so a rule that starts from the first logged loss reads it as training; the loss before the first step
  does not."""
  rows = [{"step": 50, "train_loss": 7.5e29, "test_loss": 7.2e29}, {"step": 1000, "test_loss": 4.3e29}]
  assert benchmark.exploded(rows, start=2.303) == 4.3e29
  assert benchmark.exploded(rows[:1] + [{"step": 1000, "test_loss": 1.9}], start=2.303) is None
  assert benchmark.exploded([], start=2.303) is None


@pytest.mark.parametrize("field,value,said", [
    ("seeds", (), "config.benchmark.seeds is empty"), ("grid", (), "config.benchmark.grid is empty"),
    ("eval_every", 40, "config.eval_every=40 is beyond the budget num_steps=20")])
def test_a_config_that_cannot_make_a_table_is_refused_before_anything_trains(task, monkeypatch, field, value, said):
  results, work = task
  fake = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", fake)
  config = _config()
  if field == "eval_every":
    config.eval_every = value
  else:
    config.benchmark[field] = value
  with pytest.raises(errors.ConfigError) as info:
    benchmark.benchmark(config, work, results, "cmd")
  line, code = cli.message(info.value)
  assert said in line and code != 0 and fake.calls == []


def test_a_read_only_results_parent_is_one_line_before_anything_trains(task, monkeypatch):
  results, work = task
  fake = FakeTraining()
  monkeypatch.setattr(benchmark, "train_one", fake)
  parent = os.path.dirname(results)
  os.makedirs(os.path.join(results, benchmark.RUNS))
  real_open = open

  def read_only_parent(path, *args, **kwargs):  # the summary's folder cannot be written (a mount, a permission)
    if os.path.dirname(os.path.abspath(path)) == parent and "w" in (args[0] if args else kwargs.get("mode", "r")):
      raise OSError(errno.EACCES, "Permission denied", path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr("builtins.open", read_only_parent)
  with pytest.raises(errors.ConfigError) as info:
    benchmark.benchmark(_config(), work, results, "cmd")
  line, _ = cli.message(info.value)
  assert line.startswith(f"error: cannot write to {parent} (Permission denied)") and fake.calls == []


def test_an_interrupt_between_runs_says_what_is_kept():
  line, code = cli.message(KeyboardInterrupt())
  assert "interrupted before training began" not in line and "what finished is kept" in line and code == 130
