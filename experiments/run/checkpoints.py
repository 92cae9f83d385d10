"""The checkpoint format: its one writer and one reader (orbax), with a checksum of the saved state.

A checkpoint ``<dir>/<step>`` holds the state (``params``, ``opt_state``) and a JSON ``meta`` with
the SHA-256 of the state's bytes and the loop's progress (:class:`Progress`: the training time so far and
the running sums of the train-metrics window, so a run resumed between two log steps logs the same rows). :meth:`Checkpoints.restore` takes
the newest checkpoint that restores and matches its checksum; a damaged one (truncated, missing
files, flipped bits) is reported in one line naming it, moved aside to ``<workdir>/damaged_checkpoints``
and the previous kept one is used. If none is usable the run stops with a :class:`WorkdirError`.
A sound checkpoint of another state layout (a changed setting or library default) is never called
damaged: it is refused with a :class:`LayoutError` naming the arrays that differ.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from experiments.run import errors

KEEP = 2  # checkpoints kept: the newest and one to fall back to


class Progress(NamedTuple):
  """The training loop's own state beside the arrays: seconds spent in training steps, and the window of
  train metrics not yet logged (sum of losses, sum of errors, steps), each float32 sum stored exactly."""

  train_time: float
  window: tuple[float, float, int] = (0.0, 0.0, 0)


def checksum(tree: Any) -> str:
  """SHA-256 over every leaf's path, dtype, shape and bytes (PRNG keys by their key data)."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    a = np.ascontiguousarray(np.asarray(leaf))
    h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _storable(tree: Any) -> Any:
  """``tree`` with zero-size arrays dropped (orbax refuses them; e.g. Shampoo's empty statistics)."""
  return jax.tree.map(lambda x: x if x.size else None, tree)


def _placed(abstract: Any) -> Any:
  """Every leaf given a sharding (the first device where it has none): a checkpoint saved on another set of
  devices (8 data-parallel replicas, say) is then restored onto this one, not refused for its topology."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda a: a if getattr(a, "sharding", None) is not None else
                      jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)


def _refill(abstract: Any, stored: Any) -> Any:
  """Puts the zero-size arrays that :func:`_storable` dropped back, as zeros of their shape."""
  leaves = iter(jax.tree.leaves(stored))
  return jax.tree.map(lambda a: next(leaves) if a.size else np.zeros(a.shape, a.dtype), abstract)


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def _key_name(k) -> str:
  return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def _layout(tree: Any) -> dict[str, tuple]:
  """``{'opt_state/0/statistics/conv1/kernel/moments': shape}``: named tuples and dicts read alike (Orbax
  stores a named tuple's fields by name)."""
  return {"/".join(_key_name(k) for k in path): tuple(getattr(leaf, "shape", ()))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def layout_differences(stored: dict[str, tuple], expected: dict[str, tuple]) -> list[str]:
  """What differs between a stored state's layout and the one a config builds, one phrase per array."""
  out = []
  for path in sorted(set(stored) | set(expected)):
    a, b = stored.get(path), expected.get(path)
    if a == b:
      continue
    out.append(f"{path} {'absent' if a is None else a} in the checkpoint, {'absent' if b is None else b} now")
  return out


_BANKED = re.compile(r"(^|/)(statistics|factors|clipped_rows)/bank\d+(/|$)")
_STORED = re.compile(r"(^|/)(statistics|factors|clipped_rows)/")


def per_kernel_format(stored: dict[str, tuple], expected: dict[str, tuple]) -> bool:
  """Whether a stored state's layout keeps the conditioning's statistics, factors or clipped-row counts per kernel
  (the formats before banks, and before banked counts) where the state built now keeps them all in banks."""
  banked = lambda layout: [bool(_BANKED.search(p)) for p in layout if _STORED.search(p)]
  old, new = banked(stored), banked(expected)
  return bool(old) and not all(old) and bool(new) and all(new)


class Checkpoints:
  """Saves and restores ``(step, state, train_time)`` in ``directory``."""

  def __init__(self, directory: str, damaged_dir: str):
    # Orbax needs absolute paths; a relative one failed every restore, which read as damage
    self.directory = os.path.abspath(directory)
    self.damaged_dir = os.path.abspath(damaged_dir)
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        # saved in this thread (each save is waited for anyway): a failed write is one exception here, not tracebacks
        # from orbax's background threads
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True,
                                                             enable_async_checkpointing=False),
        # registered up front so that a stored checkpoint's layout can be read before restoring it
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def _restore_one(self, step: int, abstract_state):
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_storable(_placed(abstract_state))), meta=ocp.args.JsonRestore()))
    state, meta = _refill(abstract_state, restored["state"]), restored["meta"]
    if checksum(state) != meta["sha256"]:
      raise ValueError("the restored state does not match its checksum")
    loss, error, steps = meta.get("train_window", (0.0, 0.0, 0))  # older checkpoints: an empty window
    return state, Progress(float(meta["train_time"]), (float(loss), float(error), int(steps)))

  def restore(self, abstract_state) -> Optional[tuple[int, Any, Progress]]:
    """The newest usable ``(step, state, progress)``; ``None`` if there is no checkpoint."""
    damaged = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      self._check_layout(step, abstract_state)
      try:
        state, progress = self._restore_one(step, abstract_state)
      except Exception as e:  # orbax raises many types for truncated or missing files
        damaged.append((step, _first_line(e)))
        continue
      for bad, why in damaged:
        src = os.path.join(self.directory, str(bad))
        dst = os.path.join(self.damaged_dir, str(bad))
        os.makedirs(self.damaged_dir, exist_ok=True)
        os.replace(src, dst)
        print(f"warning: checkpoint {src} is damaged ({why}); moved to {dst}, resuming from step {step}",
              file=sys.stderr, flush=True)
      if damaged:
        self._manager.close()
        self._manager = self._open()
      return step, state, progress
    if damaged:
      what = "; ".join(f"{os.path.join(self.directory, str(s))}: {why}" for s, why in damaged)
      raise errors.WorkdirError(
          f"every checkpoint is damaged ({what}); use a new --workdir, or delete {self.directory} to start over")
    return None

  def _check_layout(self, step: int, abstract_state) -> None:
    """A sound checkpoint of another state layout (another optimizer setting or library default) is not
    damage: it is refused naming what differs. Unreadable metadata is left to the restore (damage)."""
    try:
      stored = _layout(self._manager.item_metadata(step)["state"].tree)
    except Exception:
      return
    expected = _layout(_storable(abstract_state))
    if per_kernel_format(stored, expected):
      raise errors.LayoutError(
          f"checkpoint {os.path.join(self.directory, str(step))} keeps the conditioning's statistics, factors or "
          "clipped-row counts per kernel, a format of an earlier scsgd_jax; this version keeps them in banks and "
          "cannot continue it. Continue it with the version that wrote it, or use a new --workdir to start over")
    diff = layout_differences(stored, expected)
    if diff:
      said = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
      raise errors.LayoutError(
          f"checkpoint {os.path.join(self.directory, str(step))} is sound but holds another state layout than "
          f"this config builds ({said}): a changed optimizer setting or library default changes the state. "
          "Continue it with the settings it was made with (the run's config.json, 'resolved' for library "
          "defaults), or use a new --workdir to start over")

  def save(self, step: int, state: Any, progress: Progress) -> None:
    """Saves and waits for the write (so timing resumes on an idle machine, and failures surface here)."""
    meta = {"sha256": checksum(state), "train_time": float(progress.train_time), "step": step,
            "train_window": [float(progress.window[0]), float(progress.window[1]), int(progress.window[2])]}
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_storable(state)),
                                                      meta=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self._manager.close()
