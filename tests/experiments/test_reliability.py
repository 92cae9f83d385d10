"""Runs that survive preemption, and bad input answered in one line naming it before anything is written.

Preemption (SIGTERM) is injected for real, in process, between steps and during a checkpoint save;
the resumed run must equal an uninterrupted one bit for bit (parameters and optimizer state). The
command-line cases run the real entry point in a subprocess.
"""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

import scsgd_jax
from experiments.run import checkpoints
from experiments.run import data as data_lib
from experiments.run import errors
from experiments.run import train
from experiments.run import workdir as workdir_lib
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_TFDS = os.path.join(ROOT, "..", "shared", "tfds")


@pytest.fixture(scope="module")
def straight(straight_dir):
  """An uninterrupted 40-step run on mock data: its final parameters and optimizer state, and its metric rows."""
  return helpers.final_state(straight_dir), _rows(straight_dir)


def _rows(workdir):
  """The metric rows without the timings (which a resume cannot repeat)."""
  with open(os.path.join(workdir, train.METRICS_FILE)) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in ("train_time", "compile_time")} for r in rows]


def _assert_bitwise_equal(straight, workdir):
  ((a, sa), rows), (b, sb) = straight, helpers.final_state(workdir)
  assert sa == sb == 40
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _rows(workdir) == rows  # the train-loss window in flight at the signal continues exactly


def _resume_and_compare(straight, workdir):
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is given back
  train.train_and_evaluate(helpers.smoke_config(), workdir)
  _assert_bitwise_equal(straight, workdir)


def test_sigterm_between_steps_checkpoints_the_step_and_the_resume_is_bitwise_equal(tmp_path, straight, monkeypatch):
  workdir = str(tmp_path)
  real = data_lib.batch_indices

  def sigterm_during_step_25(num, batch, step, seed):
    if step == 25:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(num, batch, step, seed)

  monkeypatch.setattr(data_lib, "batch_indices", sigterm_during_step_25)
  with tfds.testing.mock_data(num_examples=600):
    with pytest.raises(errors.Interrupted, match=f"^terminated \\(SIGTERM\\) at step 26; {workdir} keeps the "
                                                 "checkpoint of step 26") as info:
      train.train_and_evaluate(helpers.smoke_config(), workdir)
    assert info.value.exit_code == 143
    monkeypatch.undo()
    assert helpers.final_state(workdir)[1] == 26
    _resume_and_compare(straight, workdir)


def test_sigterm_during_a_save_finishes_it_and_stops_after_the_next_step(tmp_path, straight, monkeypatch):
  workdir = str(tmp_path)
  real = checkpoints.Checkpoints.save

  def sigterm_inside_save(self, step, state, train_time):
    if step == 20:
      os.kill(os.getpid(), signal.SIGTERM)  # lands while the save of step 20 is under way
    return real(self, step, state, train_time)

  monkeypatch.setattr(checkpoints.Checkpoints, "save", sigterm_inside_save)
  with tfds.testing.mock_data(num_examples=600):
    with pytest.raises(errors.Interrupted, match=f"^terminated \\(SIGTERM\\) at step 21; {workdir} keeps the "
                                                 "checkpoint of step 21"):
      train.train_and_evaluate(helpers.smoke_config(), workdir)
    monkeypatch.undo()
    assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit()) == [20, 21]
    _resume_and_compare(straight, workdir)


def test_a_changed_library_default_is_named_and_a_changed_layout_is_not_called_damage(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  with tfds.testing.mock_data(num_examples=600):
    train.train_and_evaluate(helpers.smoke_config(stop_after_steps=20), workdir)
    recorded = json.load(open(os.path.join(workdir, workdir_lib.CONFIG_FILE)))
    assert "oversample" not in recorded["optimizer"]["scsgd"]  # the config leaves it to the library...
    assert recorded[workdir_lib.RESOLVED_KEY]["optimizer.scsgd"]["oversample"] == 10  # ...the record says what ran
    assert recorded[workdir_lib.VERSIONS_KEY]["scsgd-jax"] == scsgd_jax.__version__
    # a later library version changes a default that decides the state's shapes
    monkeypatch.setattr("scsgd_jax._src.defaults.OVERSAMPLE", 6)
    with pytest.raises(errors.WorkdirError, match=r"another config: optimizer\.scsgd\.oversample \(library "
                                                  r"default\) \(10 -> 6\)"):
      train.train_and_evaluate(helpers.smoke_config(), workdir)
    with pytest.raises(errors.LayoutError, match=r"checkpoints/20 is sound but holds another state layout than this "
                                                 r"config builds \(opt_state/0/statistics/bank2/ema/moments/0 "
                                                 r"\(1, 800, 18\) in the checkpoint, \(1, 800, 14\) now") as info:
      train.train_and_evaluate(helpers.smoke_config(), workdir, allow_config_change=True)
    assert "damaged" not in str(info.value)
    assert os.listdir(os.path.join(workdir, "checkpoints")).count("20") == 1  # nothing moved aside
    assert not os.path.exists(os.path.join(workdir, "damaged_checkpoints"))
    monkeypatch.undo()
    assert train.train_and_evaluate(helpers.smoke_config(), workdir)["step"] == 40  # the old default resumes


def _run(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "experiments.run.main", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def _error_line(out):
  """The run's stderr must be exactly one line (absl's warnings aside), and no traceback."""
  lines = [l for l in out.stderr.splitlines() if l.strip() and not l.startswith(("W1", "I1", "WARNING"))]
  assert out.returncode != 0 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize("override,line", [
    ("--config.optimzer.name=sgd", "error: --config.optimzer.name: config has no key 'optimzer' "
     "(did you mean optimizer?)"),
    ("--config.optimizer.scsgd.rnak=8", "error: --config.optimizer.scsgd.rnak: config.optimizer.scsgd has no key "
     "'rnak' (did you mean rank?)"),
    ("--config.schedule.base=inf", "error: config.schedule.base must be a finite number, got inf."),
    ("--config.optimizer.scsgd.eigenvalue_floor=nan",
     "error: config.optimizer.scsgd.eigenvalue_floor must be a finite number, got nan."),
    ("--config.optimizer.scsgd.eigenvalue_floor=-1.0",
     "error: config.optimizer.scsgd.eigenvalue_floor: Conditioner.eigenvalue_floor must lie in [0, 1], got -1.0."),
    ("--config.dataset=tiny_shakespeare", "error: config.model: 'lenet' cannot read dataset 'tiny_shakespeare' "
     "(examples (64,) int32): ValueError: "),
])
def test_bad_override_is_one_line_and_nothing_is_written(tmp_path, override, line):
  workdir = tmp_path / "run"
  out = _run("--config", "configs/smoke.py", "--workdir", str(workdir), "--config.download=False", override)
  assert _error_line(out).startswith(line)
  assert not workdir.exists()


def test_a_config_file_that_does_not_exist_is_one_line(tmp_path):
  out = _run("--config", "configs/smok.py", "--workdir", str(tmp_path / "run"))
  assert _error_line(out).startswith("error: --config configs/smok.py: no such file (did you mean configs/smoke.py")


def test_unusable_workdirs_are_refused_in_one_line(tmp_path):
  (tmp_path / "a_file").write_text("")
  cases = {"": "error: --workdir is empty (an unset shell variable?): name the directory of the run",
           str(tmp_path / "a_file"): f"error: --workdir {tmp_path / 'a_file'} is a file, not a directory",
           str(tmp_path / "a_file" / "run"): f"error: --workdir {tmp_path / 'a_file' / 'run'} lies under the file "
                                             f"{tmp_path / 'a_file'}"}
  for workdir, line in cases.items():
    out = subprocess.run([sys.executable, "-m", "experiments.run.main", "--config",
                          os.path.join(ROOT, "configs/smoke.py"), "--workdir", workdir], cwd=tmp_path if not workdir else ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert _error_line(out).startswith(line), workdir
  assert sorted(os.listdir(tmp_path)) == ["a_file"]  # nothing trained into the current directory


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_TFDS, "mnist")), reason="needs ../shared/tfds")
def test_a_split_the_dataset_does_not_have_is_named_with_the_splits_it_has(tmp_path):
  out = _run("--config", "configs/smoke.py", "--workdir", str(tmp_path / "run"), "--data_dir", SHARED_TFDS,
             "--config.eval_split=validation")
  assert _error_line(out) == "error: dataset 'mnist' has no split 'validation'; its splits: test, train."
  assert not (tmp_path / "run").exists()


def test_workdir_path_checks_in_process(tmp_path):
  assert workdir_lib.check_path(str(tmp_path / "new" / "run")) == str(tmp_path / "new" / "run")
  with pytest.raises(errors.WorkdirError, match="is empty"):
    train.train_and_evaluate(helpers.smoke_config(), "  ")


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_TFDS, "mnist")), reason="needs ../shared/tfds")
def test_a_refused_layout_change_through_the_cli_is_one_line_and_orbax_stays_quiet(tmp_path):
  """--allow_config_change with a state of other shapes once printed hundreds of lines from Orbax's threads
  (event loop closed, ignored coroutine exceptions) after the error."""
  workdir = str(tmp_path / "run")
  first = _run("--config", "configs/smoke.py", "--workdir", workdir, "--data_dir", SHARED_TFDS,
               "--config.stop_after_steps=20")
  assert first.returncode == 0, first.stderr[-2000:]
  for _ in range(2):  # the noise came from threads, so not on every run
    out = _run("--config", "configs/smoke.py", "--workdir", workdir, "--data_dir", SHARED_TFDS,
               "--config.optimizer.scsgd.rank=4", "--allow_config_change")
    lines = [l for l in out.stderr.splitlines() if l.strip() and not l.startswith(("W1", "I1", "WARNING"))]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("warning: continuing") and len(lines) == 2, out.stderr[-3000:]
    assert lines[1].startswith(f"error: checkpoint {workdir}/checkpoints/20 is sound but holds another state layout")
