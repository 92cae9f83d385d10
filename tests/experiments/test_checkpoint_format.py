"""A checkpoint of the conditioning state per kernel (the format before banks, or its clipped-row counts alone: the
format before banked counts) is refused in one line that says so, never called damaged nor listed array by array; a
checkpoint of the banked state restores."""

import os

import jax
import jax.numpy as jnp
import pytest

import scsgd_jax as sk
from experiments.run import checkpoints as ckpt
from experiments.run import errors

PARAMS = {"a": {"kernel": jnp.ones((6, 5))}, "b": {"kernel": jnp.ones((6, 3))}}


def _state():
  return {"params": PARAMS, "opt_state": sk.scsgd(0.1).init(PARAMS)}


def _per_kernel(state, fields=("statistics", "factors", "clipped_rows")):
  """``state`` as the formats before banks kept it: ``fields`` a dict by kernel path (the clipped-row counts alone:
  the format before banked counts)."""
  inner = state["opt_state"][0]
  old = inner._replace(**{f: {p: getattr(inner, f)[p] for p in getattr(inner, f)} for f in fields})
  return {**state, "opt_state": (old,) + tuple(state["opt_state"][1:])}


@pytest.mark.parametrize("fields", [("statistics", "factors", "clipped_rows"), ("clipped_rows",)])
def test_a_per_kernel_checkpoint_is_refused_as_an_earlier_format(tmp_path, fields):
  store = ckpt.Checkpoints(str(tmp_path / "checkpoints"), str(tmp_path / "damaged"))
  store.save(20, _per_kernel(_state(), fields), ckpt.Progress(1.0))
  with pytest.raises(errors.LayoutError, match=r"checkpoints/20 keeps the conditioning's statistics, factors or "
                                               r"clipped-row counts per kernel, a format of an earlier scsgd_jax; "
                                               r"this version keeps them in banks and cannot continue it") as info:
    store.restore(jax.eval_shape(_state))
  assert "damaged" not in str(info.value) and "\n" not in str(info.value)
  store.close()


def test_a_banked_checkpoint_restores(tmp_path):
  store = ckpt.Checkpoints(str(tmp_path / "checkpoints"), str(tmp_path / "damaged"))
  state = _state()
  store.save(20, state, ckpt.Progress(1.0))
  step, restored, _ = store.restore(jax.eval_shape(_state))
  assert step == 20
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert jnp.array_equal(a, b)
  store.close()


def test_the_format_check_reads_array_names():
  banked = {"opt_state/0/statistics/bank0/moments": (2, 6, 6), "opt_state/0/factors/bank0/b_inv": (2, 6, 6)}
  per_kernel = {"opt_state/0/statistics/a/kernel/moments": (6, 6), "opt_state/0/factors/a/kernel/b_inv": (6, 6)}
  assert ckpt.per_kernel_format(per_kernel, banked)
  assert not ckpt.per_kernel_format(banked, banked) and not ckpt.per_kernel_format(per_kernel, per_kernel)
  counts_apart = {**banked, "opt_state/0/clipped_rows/a/kernel": ()}  # banked but for its clipped-row counts
  assert ckpt.per_kernel_format(counts_apart, {**banked, "opt_state/0/clipped_rows/bank0": (2,)})
  assert not ckpt.per_kernel_format({"params/a/kernel": (6, 5)}, banked)  # no conditioning stored: another matter


def test_a_full_disk_during_a_save_is_one_exception_and_no_thread_prints_a_traceback(tmp_path):
  """The save runs in the caller's thread: a write that fails (ENOSPC, injected into orbax's metadata writer) is one
  OSError where ``save`` is called, which the entry points print as one line; nothing else is printed, not at the
  failure nor when the interpreter exits (orbax's background threads printed up to six tracebacks)."""
  import subprocess
  import sys
  code = f"""
import errno, os
import jax.numpy as jnp
import orbax.checkpoint as ocp
from experiments.run import checkpoints as ckpt, cli
def full(*a, **k):
  raise OSError(errno.ENOSPC, "No space left on device", "meta")
ocp.JsonCheckpointHandler.save = ocp.JsonCheckpointHandler.async_save = full
c = ckpt.Checkpoints({str(tmp_path / 'ckpt')!r}, {str(tmp_path / 'damaged')!r})
try:
  c.save(1, {{"w": jnp.ones(3)}}, ckpt.Progress(0.0, (0.0, 0.0, 0)))
except OSError as e:
  print(cli.message(e)[0])
"""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
  assert out.stdout.strip() == "error: cannot write meta: No space left on device", out.stdout + out.stderr
  assert "Traceback" not in out.stderr, out.stderr
