"""Every committed head-to-head record holds the settings today's code would run it with, and every row of a table's
config finds its runs at the point its table reports: the harness finds no row to re-run (a refactor of the
optimizers, their recipes or the configs that changed a row's recorded settings or point fails here, naming the
row and the setting)."""

import glob
import importlib
import json
import os

import pytest

from experiments.head_to_head import benchmark
from experiments.optim import optimizers

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results")


def _tasks():
  return sorted(os.path.basename(d) for d in glob.glob(os.path.join(RESULTS, "head_to_head", "*")) if os.path.isdir(d))


def _table(results_dir: str) -> dict:
  """A task's rendered table (the report's results.json)."""
  with open(os.path.join(results_dir, "results.json")) as f:
    return json.load(f)


FINAL_TASKS = _tasks()  # the final protocol (configs/head_to_head/), committed run by run


def test_every_task_has_committed_rows():
  assert FINAL_TASKS == ["convex", "mnist", "shakespeare", "shakespeare_large"]


@pytest.mark.parametrize("task", FINAL_TASKS)
def test_the_harness_finds_no_committed_row_to_rerun(task, tmp_path, capsys):
  config = importlib.import_module(f"configs.head_to_head.{task}").get_config()
  results_dir = os.path.join(RESULTS, "head_to_head", task)
  harness = benchmark.Harness(config, str(tmp_path), results_dir, "")

  def never_train(*args, **kwargs):
    raise AssertionError(f"{task}: the harness would train a run again: {args}")

  harness.run = lambda name, point, seed: harness.committed(name, point, seed) or never_train(name, point, seed)
  paths = sorted(glob.glob(os.path.join(results_dir, benchmark.RUNS, "*", "*.json")))
  rendered = os.path.exists(os.path.join(results_dir, "results.json"))  # not yet, while a table's first row runs
  assert len(paths) > 10 or not rendered or _table(results_dir).get("missing")
  stale = []
  for path in paths:
    with open(path) as f:
      rec = json.load(f)
    assert rec["optimizer"] in optimizers.OPTIMIZERS, path
    assert rec["code_hash"] == config.benchmark.frozen_code, f"{path}: another code version than its table's"
    point = benchmark.record_point(rec)
    if harness.committed(rec["optimizer"], point, rec["seed"]) is None:
      stale.append(rec["key"])
  assert not stale, f"{task}: rows the harness would run again: {stale}\n{capsys.readouterr().out}"
  if not rendered:
    return
  table = _table(results_dir)
  # the config's points find every reported row's runs at the point its table reports; a table still running (over
  # several sessions) names the rows it lacks, and its every record is already of its code version
  assert set(table["optimizers"]) | set(table.get("missing", ())) == set(config.benchmark.all_optimizers)
  assert not set(table["optimizers"]) & set(table.get("missing", ()))
  for name in table["optimizers"]:
    found = benchmark.committed_results(harness, name)
    assert found is not None, f"{task}: {name}: the config's point finds no committed runs"
    s = table["optimizers"][name]
    assert found["point"] == benchmark.Point(s["learning_rate"], tuple(sorted(s["joint"].items()))), (task, name)
    assert sorted(found["seeds"]) == s["seeds"], (task, name)


def test_an_unfinished_final_table_can_be_finished_from_this_checkout(tmp_path):
  """A final table with rows still to run (named missing in its results, or none run yet) is frozen at one version
  of the library and training code: the harness's own check must accept this checkout, or it refuses to train the
  table's rows (an edit to a file of ``report.TRAINING_CODE``, a docstring's too, moves the version)."""
  for task in benchmark.task_names(os.path.join(RESULTS, "..", "..", "configs", "head_to_head", "common.py")):
    results_dir = os.path.join(RESULTS, "head_to_head", task)
    if not os.path.exists(os.path.join(results_dir, "results.json")) or _table(results_dir).get("missing"):
      config = importlib.import_module(f"configs.head_to_head.{task}").get_config()
      assert config.benchmark.frozen_code
      benchmark.Harness(config, str(tmp_path), results_dir, "").check_code_version(task)


def test_the_provenance_file_is_what_the_records_say(tmp_path):
  """experiments/results/provenance.json is machine-written from the records: regenerated, it lists every
  row of every table at the commits the rows record (a hand edit or a forgotten regeneration fails here)."""
  from experiments.head_to_head import provenance

  fresh = provenance.collect(RESULTS)
  with open(os.path.join(RESULTS, provenance.OUT)) as f:
    committed = json.load(f)
  assert committed["tables"] == fresh["tables"] and committed["files"] == fresh["files"]
  for task in FINAL_TASKS:
    rows = glob.glob(os.path.join(RESULTS, "head_to_head", task, benchmark.RUNS, "*", "*.json"))
    t = fresh["tables"].get(f"head_to_head/{task}", {"rows": 0, "commits": {}})  # none yet, as a table moves
    assert t["rows"] == len(rows) == sum(t["commits"].values())
