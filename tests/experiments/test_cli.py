"""Every entry point's face: absl flags with --config.* overrides, and one line (no traceback) for
what stops a run. Subprocesses run the real commands."""

import errno
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from experiments.run import cli
from experiments.run import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_TFDS = os.path.join(ROOT, "..", "shared", "tfds")


def _run(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _one_error_line(out):
  lines = [l for l in out.stderr.splitlines() if l.strip() and not l.startswith(("WARNING", "W", "I"))]
  assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
  return lines


def test_unknown_config_key_is_refused_by_the_flags(tmp_path):
  out = _run("experiments.run.main", "--config", "configs/smoke.py", "--workdir", str(tmp_path),
             "--config.optimizer.learning_rte=0.1")
  assert out.returncode != 0 and "learning_rte" in out.stderr


def test_bad_config_value_is_one_line_from_main_and_ablation(tmp_path):
  out = _run("experiments.run.main", "--config", "configs/smoke.py", "--workdir", str(tmp_path / "m"),
             "--config.optimizer.scsgd.ema_rate=0.0")
  assert _one_error_line(
      out)[-1] == "error: config.optimizer.scsgd.ema_rate: Statistics.ema_rate must lie in (0, 1], got 0.0."
  # the ablation takes --config.* overrides too (it used argparse, and printed tracebacks)
  out = _run("experiments.paper.ablation", "--config", "configs/smoke.py", "--workdir", str(tmp_path / "a"),
             "--results_dir", str(tmp_path / "r"), "--config.max_rows=-1", "--variants=default")
  assert _one_error_line(out)[-1] == "error: config.max_rows must be >= 0 (0: every row), got -1."
  assert not (tmp_path / "a" / "default").exists()


def test_missing_dataset_and_unknown_optimizer_are_one_line(tmp_path):
  out = _run("experiments.run.main", "--config", "configs/smoke.py", "--workdir", str(tmp_path / "w"),
             "--data_dir", str(tmp_path / "nothing_here"), "--config.download=False")
  assert _one_error_line(out)[-1].startswith("error: dataset 'mnist' (split 'train') is not prepared")
  out = _run("experiments.paper.compare", "--config", "configs/smoke.py", "--workdir", str(tmp_path / "c"),
             "--optimizers", "sgd,lion")
  assert "unknown optimizer 'lion'" in _one_error_line(out)[-1]


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_TFDS, "mnist")), reason="needs ../shared/tfds")
@pytest.mark.parametrize("sig,code,said", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_live_run_holds_its_workdir_and_a_stop_signal_exits_cleanly(tmp_path, sig, code, said):
  """Ctrl-C, and SIGTERM as Slurm, Kubernetes and TPU preemption send it."""
  workdir = str(tmp_path / "run")
  args = ["experiments.run.main", "--config", "configs/smoke.py", "--workdir", workdir, "--data_dir", SHARED_TFDS,
          "--config.num_steps=1000000"]
  proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
  try:
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and (not os.path.exists(metrics) or open(metrics).read().count("\n") < 2):
      time.sleep(0.5)  # until step 20 is logged and checkpointed
    assert proc.poll() is None
    second = _run(*args)
    assert _one_error_line(second)[-1] == (f"error: {workdir} is in use by another run (pid {proc.pid}): "
                                           "wait for it to finish, or use another --workdir")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == code and "Traceback" not in err, err
  last = err.strip().splitlines()[-1]
  # Ctrl-C stops between steps and checkpoints the step it stopped at: no step is lost, and no save is
  # cut short (a KeyboardInterrupt inside Orbax's save logged a traceback and kept an older step)
  step = int(last.removeprefix(f"error: {said} at step ").split(";")[0])
  assert last == (f"error: {said} at step {step}; {workdir} keeps the checkpoint of step {step} and its "
                  "metrics: rerun the same command to resume"), last
  assert str(step) in os.listdir(os.path.join(workdir, "checkpoints"))


def _exit(main):
  with pytest.raises(SystemExit) as info:
    cli.guarded(main)([])
  return info.value.code


@pytest.mark.parametrize("raised,line,code", [
    (errors.DivergedError("sgd", 40, "sgd diverged at step 40 (train_loss=nan)"),
     "error: sgd diverged at step 40 (train_loss=nan)", 1),
    (OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl"),
     "error: cannot write /w/metrics.jsonl: No space left on device", 1),
    (KeyboardInterrupt(), "interrupted; what finished is kept (records, checkpoints): rerun the same command to resume", 130),
])
def test_guarded_main_turns_what_stops_a_run_into_one_line(capsys, raised, line, code):
  def main(argv):
    raise raised

  assert _exit(main) == code
  assert capsys.readouterr().err.strip() == line


def test_guarded_main_lets_bugs_raise():
  def main(argv):
    raise OSError(errno.EBADF, "bad file descriptor")

  with pytest.raises(OSError):
    cli.guarded(main)([])


@pytest.mark.head_to_head
def test_benchmark_takes_config_overrides_and_writes_its_results_file(tmp_path):
  out = _run("experiments.studies.benchmark_step", "--config", "configs/studies/benchmark_step.py", "--config.windows=1",
             "--config.only=dense_256", "--results_dir", str(tmp_path))
  assert out.returncode == 0, out.stderr[-2000:]
  import json

  record = json.load(open(tmp_path / "benchmark_step.json"))
  assert record["command"].startswith("python -m experiments.studies.benchmark_step --config configs/studies/benchmark_step.py")
  assert record["commit"] and record["versions"]["jax"] == jax.__version__
  result = record["models"]["dense_256"]
  assert list(record["models"]) == ["dense_256"]
  assert result["sgd"]["median_vs_sgd"] == 1.0
  assert set(result) >= {"sgd", "adamw", "muon", "scsgd", "sgd_capture", "scsgd_no_fold", "phases_ms_per_step"}
  conditioned = [p for p, why in result["scsgd"]["kernels"].items() if not why.startswith("not conditioned")]
  assert conditioned == ["kernel"] and "bias" in result["scsgd"]["kernels"]  # the one Dense kernel; the bias said
  assert len(result["sgd_again"]["per_window_vs_sgd"]) == 1 and result["sgd"]["per_window_vs_sgd"] == [1.0]
  # each variant in a pass of its own with SGD: its ratio is against SGD's step of that pass
  assert result["muon"]["sgd_median_ms"] > 0 and "sgd_median_ms" not in result["sgd"]
  # what a user waits for before the first step: each variant's lowering and compilation, against SGD's
  out = _run("experiments.studies.benchmark_step", "--config", "configs/studies/benchmark_step.py", "--config.compile_only=True",
             "--config.only=dense_256", "--results_dir", str(tmp_path))
  assert out.returncode == 0, out.stderr[-2000:]
  compiled = json.load(open(tmp_path / "benchmark_compile.json"))["models"]["dense_256"]
  assert list(compiled) == list(json.load(open(tmp_path / "benchmark_step.json"))["setup"]["variants"])
  assert compiled["sgd"]["total_vs_sgd"] == 1.0
  for v in compiled.values():
    assert v["lower_s"] > 0 and v["compile_s"] > 0 and v["total_s"] == pytest.approx(v["lower_s"] + v["compile_s"])
  # the phases add up to SCSGD's extra time per step
  assert sum(result["phases_ms_per_step"].values()) == pytest.approx(
      (result["scsgd"]["window_mean_vs_sgd"] - 1.0) * result["scsgd"]["sgd_median_ms"])


def test_step_phases_by_hand():
  from experiments.studies import benchmark_step

  out = {"sgd_capture": {"median_vs_sgd": 1.01, "window_mean_vs_sgd": 1.0},
         "scsgd_no_fold": {"median_vs_sgd": 1.05, "window_mean_vs_sgd": 1.07},
         "scsgd": {"median_vs_sgd": 1.2, "window_mean_vs_sgd": 1.10, "sgd_median_ms": 10.0}}
  assert benchmark_step.phases(out) == pytest.approx({"capture": 0.1, "apply": 0.4, "refresh": 0.2, "fold": 0.3})


def test_recorded_command_names_the_package_of_a_package_main(monkeypatch):
  import types

  main = types.ModuleType("__main__")
  main.__spec__ = types.SimpleNamespace(name="experiments.paper.convex.__main__")
  monkeypatch.setitem(sys.modules, "__main__", main)
  assert cli.command_line(["x", "--config", "configs/convex smoke.py"]) == (
      "python -m experiments.paper.convex --config 'configs/convex smoke.py'")
