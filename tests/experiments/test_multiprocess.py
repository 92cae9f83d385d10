"""Past one process: ``experiments.run.main`` run as 2 processes x 2 CPU devices (JAX's multi-controller runtime on
localhost, gloo collectives) trains the smoke config to the state of 1 process on 4 devices; checkpoints are
written once and restore on another process count (2 -> 1, 1 -> 2); metrics are written by one process; a
process that dies takes the run down in bounded time. Real MNIST from ../shared/tfds, as a user runs it."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from experiments.run import devices
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_TFDS = os.path.join(ROOT, "..", "shared", "tfds")
pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_TFDS, "mnist")), reason="needs ../shared/tfds")


def _args(workdir, *extra):
  return [sys.executable, "-m", "experiments.run.main", "--config", "configs/smoke.py", "--workdir", str(workdir),
          "--data_dir", SHARED_TFDS, "--config.download=False", *extra]


def _env(devices):
  return {**os.environ, "XLA_FLAGS": helpers.xla_flags(devices)}


def _one_process(workdir, *extra):
  out = subprocess.run(_args(workdir, *extra), cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _start_two(workdir, *extra):
  port = devices.free_port()
  return [subprocess.Popen(_args(workdir, "--num_processes", "2", "--process_id", str(i), "--coordinator_address",
                                 f"127.0.0.1:{port}", *extra), cwd=ROOT, env=_env(2), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True) for i in range(2)]


def _two_processes(workdir, *extra):
  procs = _start_two(workdir, *extra)
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [o for o, _ in outs]


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _shared(name, run):
  """A 40-step run made once per test run (:func:`helpers.shared_run`): its workdir, and each process's first line."""
  def make(workdir):
    with open(os.path.join(workdir, "first_lines.json"), "w") as f:
      json.dump([o.splitlines()[0] for o in run(workdir)], f)

  workdir = pathlib.Path(helpers.shared_run(name, make))
  with open(workdir / "first_lines.json") as f:
    return workdir, json.load(f)


@pytest.fixture(scope="module")
def one():
  """1 process on 4 devices: the reference."""
  workdir, lines = _shared("multiprocess_one", lambda workdir: [_one_process(workdir)])
  assert lines == ["devices: 4 device(s) (cpu, cpu), data parallel"]
  return workdir


@pytest.fixture(scope="module")
def two():
  """2 processes x 2 devices: the workdir, and each process's first line."""
  return _shared("multiprocess_two", _two_processes)


def test_two_processes_train_as_one_process_on_four_devices(one, two):
  workdir, lines = two
  assert lines == ["devices: 4 device(s) (cpu, cpu) in 2 processes, data parallel"] * 2
  helpers.assert_same_training(one, workdir)
  rows = _rows(workdir)  # written by process 0 alone: each row once
  assert [r["step"] for r in rows] == [r["step"] for r in _rows(one)] == [10, 20, 30, 40]
  for a, b in zip(rows, _rows(one)):
    assert a.keys() == b.keys()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["20", "40"]  # each step's checkpoint once


@pytest.mark.parametrize("first,then", [("two", "one"), ("one", "two")])
def test_a_checkpoint_restores_on_another_process_count(one, two, tmp_path, first, then):
  """The ``first`` run's workdir with its checkpoint of step 40 removed (as a run stopped after step 20 leaves it),
  resumed on ``then``'s process count: the uninterrupted run."""
  shutil.copytree(one if first == "one" else two[0], tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / "40")
  assert helpers.final_state(str(tmp_path))[1] == 20
  {"one": _one_process, "two": _two_processes}[then](tmp_path)
  helpers.assert_same_training(one, tmp_path)
  assert [r["step"] for r in _rows(tmp_path)] == [10, 20, 30, 40]


CUT = r"a peer stopped in the middle of a step across processes \(gloo: the data it sent was cut short\)"


@pytest.mark.parametrize("dies,whys", [
    (1, [r"process 1 of 2 stopped \(no heartbeat for 10 s\)", CUT]),
    # the runtime's abort (the supervisor's line), or the peer watch finding the coordinator gone first
    (0, [r"the coordinator \(process 0\) stopped", r"the coordinator \(process 0\) stopped answering \(\w+\)", CUT]),
])
def test_a_process_that_dies_takes_the_run_down_in_one_line(tmp_path, dies, whys):
  """The survivor's last line names the dead peer, or (when the peer died in the middle of a transfer, so that
  gloo aborted the survivor at once) says a transfer was cut short: whichever of the runtime, gloo and the peer
  watch sees it first."""
  procs = _start_two(tmp_path, "--config.num_steps=1000000", "--config.checkpoint_every=100000",
                     "--config.eval_every=100000", "--config.train_log_every=10")
  deadline = time.time() + 300
  while not os.path.exists(tmp_path / "metrics.jsonl") or not _rows(tmp_path):  # training under way
    assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
    time.sleep(0.5)
  victim, survivor = procs[dies], procs[1 - dies]
  os.killpg(victim.pid, signal.SIGKILL)  # the process and its supervised child
  t0 = time.time()
  _, err = survivor.communicate(timeout=120)  # bounded: never a hang
  assert time.time() - t0 < 60 and survivor.returncode == 1, err[-3000:]
  victim.communicate()
  lines = [l for l in err.splitlines() if l.strip() and not l.startswith(("W1", "I1", "WARNING", "[Gloo]"))]
  line = (rf"error: ({'|'.join(whys)}); process {1 - dies} stops too\. The run's workdir keeps its last checkpoint: "
          "rerun the same commands to resume")
  assert re.fullmatch(line, lines[-1]) and sum(l.startswith("error:") for l in lines) == 1, err[-3000:]
  assert "Traceback" not in err and "Fatal Python error" not in err and "Check failure" not in err
