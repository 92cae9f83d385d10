"""The training loop on tfds mock data: resumption, and runs that never lose or mix work.

Each fault below is injected for real (a held lock, a changed config, truncated or bit-flipped
checkpoint files, a torn metrics line, a failing write, non-finite metrics, Ctrl-C) and the test
checks the one-line error, that nothing saved was lost, and that the same call then resumes.
"""

import errno
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from experiments.run import data as data_lib
from experiments.run import errors
from experiments.run import metrics as metrics_lib
from experiments.run import train
from experiments.run import workdir as workdir_lib
from tests import helpers


@pytest.fixture(autouse=True)
def mock_data():
  with tfds.testing.mock_data(num_examples=600):
    yield


@pytest.fixture(scope="module")
def straight(straight_dir):
  """The uninterrupted run's final parameters and step, the reference every resumed run must equal."""
  return helpers.final_params(straight_dir)


def _finished_run(straight_dir, workdir):
  """``workdir`` holding the finished 40-step run (a copy of the uninterrupted one)."""
  shutil.copytree(straight_dir, workdir, dirs_exist_ok=True)


def _steps(workdir):
  return [r["step"] for r in metrics_lib.read(os.path.join(workdir, train.METRICS_FILE))]


def _assert_equal_to(straight, workdir):
  a, sa = straight
  b, sb = helpers.final_params(workdir)
  assert sa == sb == 40
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  assert _steps(workdir) == [10, 20, 30, 40]


def _half_run(workdir):
  first = train.train_and_evaluate(helpers.smoke_config(stop_after_steps=20), workdir)
  assert first["step"] == 20


def test_resumed_run_equals_uninterrupted_run(tmp_path, straight):
  _half_run(str(tmp_path))
  train.train_and_evaluate(helpers.smoke_config(), str(tmp_path))
  _assert_equal_to(straight, str(tmp_path))


def test_resume_with_another_config_is_refused_naming_the_keys(tmp_path, straight):
  workdir = str(tmp_path)
  _half_run(workdir)
  before = {f: open(os.path.join(workdir, f)).read() for f in (workdir_lib.CONFIG_FILE, train.METRICS_FILE)}
  changed = helpers.smoke_config()
  changed.schedule.base = 0.02
  changed.optimizer.scsgd.rank = 4
  with pytest.raises(errors.WorkdirError, match=r"another config: optimizer\.scsgd\.rank \(8 -> 4\), "
                                                r"schedule\.base \(0\.01 -> 0\.02\)"):
    train.train_and_evaluate(changed, workdir)
  for f, text in before.items():  # nothing in the workdir was rewritten
    assert open(os.path.join(workdir, f)).read() == text, f
  # run-time keys (progress bar, data dir) are not a different config; continuing on purpose is possible
  same = helpers.smoke_config(progress_bar=True)
  train.train_and_evaluate(same, workdir)
  _assert_equal_to(straight, workdir)
  changed.num_steps = 50
  with pytest.raises(errors.WorkdirError, match="is sound but holds another state layout"):  # rank 4 != 8
    train.train_and_evaluate(changed, workdir, allow_config_change=True)
  changed.optimizer.scsgd.rank = 8
  train.train_and_evaluate(changed, workdir, allow_config_change=True)
  assert json.load(open(os.path.join(workdir, workdir_lib.CONFIG_FILE)))["schedule"]["base"] == 0.02
  assert _steps(workdir)[-1] == 50


def test_a_workdir_held_by_a_live_run_is_refused(tmp_path):
  workdir = str(tmp_path)
  with workdir_lib.lock(workdir):
    with pytest.raises(errors.WorkdirError, match=f"{workdir} is in use by another run \\(pid {os.getpid()}\\)"):
      train.train_and_evaluate(helpers.smoke_config(), workdir)
  assert not os.path.exists(os.path.join(workdir, train.METRICS_FILE))
  train.train_and_evaluate(helpers.smoke_config(num_steps=10, checkpoint_every=10), workdir)  # released


def _newest_checkpoint(workdir):
  root = os.path.join(workdir, "checkpoints")
  step = max(int(d) for d in os.listdir(root) if d.isdigit())
  return step, os.path.join(root, str(step))


def _files(path):
  return sorted((os.path.getsize(os.path.join(d, f)), os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("damage", ["truncate", "delete", "bit_rot", "checksum"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, straight_dir, straight, capfd, damage):
  workdir = str(tmp_path)
  _finished_run(straight_dir, workdir)
  step, path = _newest_checkpoint(workdir)
  assert step == 40
  size, biggest = _files(path)[-1]
  if damage == "truncate":
    os.truncate(biggest, size // 2)
  elif damage == "delete":
    for _, f in _files(path):
      if "state" in f:
        os.remove(f)
  elif damage == "bit_rot":  # 4 KiB of 0xFF inside the largest data file
    with open(biggest, "r+b") as f:
      f.seek(size // 2)
      f.write(b"\xff" * 4096)
  else:  # a state that restores but is not what was saved: only the checksum can tell
    meta = [f for _, f in _files(path) if os.path.basename(os.path.dirname(f)) == "meta"
            and "sha256" in open(f, errors="replace").read()][0]
    record = json.load(open(meta))
    record["sha256"] = "0" * 64
    json.dump(record, open(meta, "w"))
  capfd.readouterr()
  train.train_and_evaluate(helpers.smoke_config(), workdir)
  err = capfd.readouterr().err
  assert f"checkpoint {path} is damaged" in err and "resuming from step 20" in err, err
  assert os.path.isdir(os.path.join(workdir, "damaged_checkpoints", "40"))
  _assert_equal_to(straight, workdir)


def test_every_checkpoint_damaged_is_one_error(tmp_path, straight_dir):
  workdir = str(tmp_path)
  _finished_run(straight_dir, workdir)
  for step in (20, 40):
    for size, f in _files(os.path.join(workdir, "checkpoints", str(step))):
      os.truncate(f, size // 3)
  with pytest.raises(errors.WorkdirError, match="every checkpoint is damaged"):
    train.train_and_evaluate(helpers.smoke_config(), workdir)


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path, straight, capfd):
  workdir = str(tmp_path)
  _half_run(workdir)
  with open(os.path.join(workdir, train.METRICS_FILE), "a") as f:
    f.write('{"step": 30, "train_ti')  # what a crash or a full disk leaves
  train.train_and_evaluate(helpers.smoke_config(), workdir)
  assert "dropped the torn last line" in capfd.readouterr().err
  _assert_equal_to(straight, workdir)


def test_a_bad_line_inside_the_metrics_file_names_it():
  path = "/tmp/_scsgd_metrics_test.jsonl"
  with open(path, "w") as f:
    f.write('{"step": 10}\nnot json\n{"step": 30}\n')
  with pytest.raises(errors.WorkdirError, match="line 2, is not a metrics row"):
    metrics_lib.read(path)


def test_full_disk_is_one_line_and_loses_nothing_saved(tmp_path, straight, monkeypatch):
  workdir = str(tmp_path)
  _half_run(workdir)
  metrics_path = os.path.join(workdir, train.METRICS_FILE)
  saved = open(metrics_path).read()

  def no_space(self, row):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(metrics_lib.Appender, "append", no_space)
  with pytest.raises(errors.WorkdirError, match=f"cannot write {metrics_path}: No space left on device. "
                                                f"{workdir} keeps the checkpoint of step 20"):
    train.train_and_evaluate(helpers.smoke_config(), workdir)
  assert open(metrics_path).read() == saved
  monkeypatch.undo()
  train.train_and_evaluate(helpers.smoke_config(), workdir)
  _assert_equal_to(straight, workdir)


def test_read_only_workdir_is_one_line_and_the_old_files_stay_whole(tmp_path, monkeypatch):
  """A rewrite that fails half-way (read-only, or out of space) must not truncate the file it replaces."""
  workdir = str(tmp_path)
  _half_run(workdir)
  metrics_path = os.path.join(workdir, train.METRICS_FILE)
  with open(metrics_path, "a") as f:
    f.write('{"step": 30, "tr')  # forces a rewrite on resume
  saved = open(metrics_path).read()
  real_open = open

  def read_only(path, mode="r", *args, **kwargs):
    if any(m in mode for m in "wa") and str(path).startswith(workdir) and "lock" not in str(path):
      raise OSError(errno.EROFS, "Read-only file system", str(path))
    return real_open(path, mode, *args, **kwargs)

  monkeypatch.setattr("builtins.open", read_only)
  with pytest.raises(errors.WorkdirError, match=f"cannot write {workdir}/config.json: Read-only file system"):
    train.train_and_evaluate(helpers.smoke_config(), workdir)
  monkeypatch.undo()
  assert open(metrics_path).read() == saved


def test_divergence_names_the_optimizer_and_the_step(tmp_path):
  config = helpers.smoke_config()
  config.optimizer.name = "sgd"
  config.optimizer.sgd.learning_rate = 1e6
  with pytest.raises(errors.DivergedError, match=r"sgd diverged at step 10 \(train_loss=nan") as info:
    train.train_and_evaluate(config, str(tmp_path))
  assert (info.value.optimizer, info.value.step) == ("sgd", 10)


def test_ctrl_c_finishes_the_step_checkpoints_it_and_the_same_call_resumes(tmp_path, straight, monkeypatch):
  workdir = str(tmp_path)
  real = data_lib.batch_indices
  before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when pytest runs in the background

  def ctrl_c_during_step_25(num, batch, step, seed):
    if step == 25:
      os.kill(os.getpid(), signal.SIGINT)
    return real(num, batch, step, seed)

  monkeypatch.setattr(data_lib, "batch_indices", ctrl_c_during_step_25)
  with pytest.raises(errors.Interrupted, match=f"interrupted at step 26; {workdir} keeps the checkpoint of step 26"):
    train.train_and_evaluate(helpers.smoke_config(), workdir)
  assert signal.getsignal(signal.SIGINT) is before  # the handler is given back
  monkeypatch.undo()
  assert helpers.final_params(workdir)[1] == 26
  train.train_and_evaluate(helpers.smoke_config(), workdir)
  _assert_equal_to(straight, workdir)


def test_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(tmp_path, straight, monkeypatch):
  workdir = str(tmp_path)
  real = data_lib.batch_indices

  def interrupt_at_25(num, batch, step, seed):
    if step == 25:
      raise KeyboardInterrupt
    return real(num, batch, step, seed)

  monkeypatch.setattr(data_lib, "batch_indices", interrupt_at_25)
  with pytest.raises(errors.Interrupted, match=f"interrupted at step 25; {workdir} keeps the checkpoint of step 20"):
    train.train_and_evaluate(helpers.smoke_config(), workdir)
  monkeypatch.undo()
  train.train_and_evaluate(helpers.smoke_config(), workdir)
  _assert_equal_to(straight, workdir)


def test_a_state_with_zero_size_arrays_is_saved_and_restored(tmp_path):
  """Orbax refuses zero-size arrays (Shampoo's state has some); the checkpoint keeps them by shape."""
  import jax.numpy as jnp

  from experiments.run import checkpoints

  state = {"w": jnp.arange(6.0).reshape(2, 3), "empty": jnp.zeros((0, 4), jnp.int32), "n": jnp.asarray(3)}
  ckpts = checkpoints.Checkpoints(str(tmp_path / "c"), str(tmp_path / "d"))
  ckpts.save(5, state, checkpoints.Progress(1.5, (0.25, 0.5, 3)))
  step, restored, progress = ckpts.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
  ckpts.close()
  assert (step, progress) == (5, (1.5, (0.25, 0.5, 3)))
  assert restored["empty"].shape == (0, 4) and restored["empty"].dtype == jnp.int32
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert int(restored["n"]) == 3


def test_checkpoints_in_a_relative_directory_are_read_back(tmp_path, monkeypatch):
  """Orbax refuses relative paths; every restore from one failed and read as 'every checkpoint is damaged'."""
  import jax.numpy as jnp

  from experiments.run import checkpoints

  monkeypatch.chdir(tmp_path)
  state = {"w": jnp.arange(3.0)}
  ckpts = checkpoints.Checkpoints("run/checkpoints", "run/damaged")
  ckpts.save(7, state, checkpoints.Progress(0.5))
  ckpts.close()
  again = checkpoints.Checkpoints("run/checkpoints", "run/damaged")
  step, restored, _ = again.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
  again.close()
  assert step == 7
  np.testing.assert_array_equal(restored["w"], state["w"])
