"""A run's directory kept safe: its path checked, one live run at a time, the config it continues,
atomic writes, fixable write failures as one line, and stop signals honoured between steps.

What a workdir guarantees:

- ``--workdir`` must name a directory: empty (an unset shell variable), a file, or a path under a
  file is refused before anything is read or written.
- One live run holds it (``<workdir>/lock``, ``flock``: released by the OS even on ``kill -9``).
- It continues only the config it recorded (``config.json``). The record holds the config and the
  optimizer's *resolved* settings (library defaults written out) with the package versions: a
  changed key or resolved value is refused by name unless continued on purpose; a changed
  package version is reported.
- Ctrl-C (SIGINT) and preemption (SIGTERM, what Slurm, Kubernetes and TPU maintenance send) stop
  the run at the next step boundary after checkpointing that step; a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import threading
from typing import Any

from experiments.run import errors

CONFIG_FILE = "config.json"
LOCK_FILE = "lock"
# Keys that do not change what a run computes: a resumed run may differ in them.
RUNTIME_KEYS = ("data_dir", "download", "progress_bar", "stop_after_steps")
RESOLVED_KEY = "resolved"  # in config.json: the optimizer's settings with the library's defaults written out
VERSIONS_KEY = "versions"  # in config.json: the packages the run was made with
#: optimizer arguments added after runs were recorded, each with the value that reproduces the behaviour from
#: before it: a record without the key ran with that value (adding an argument leaves old rows valid; a later
#: change of its default does not)
ADDED_ARGUMENTS = {"normalize": "none", "basis": "inputs", "sides": "input"}
LIBRARY_DEFAULT = " (library default)"  # the suffix of a difference in a resolved library default alone


def check_path(workdir: str, flag: str = "--workdir") -> str:
  """The absolute path of ``workdir``, or a :class:`WorkdirError` saying why it cannot hold a run."""
  if not isinstance(workdir, str) or not workdir.strip():
    raise errors.WorkdirError(f"{flag} is empty (an unset shell variable?): name the directory of the run")
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise errors.WorkdirError(f"{flag} {path} is a file, not a directory: name another path")
  parent = os.path.dirname(path)
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if parent and not os.path.isdir(parent):
    raise errors.WorkdirError(f"{flag} {path} lies under the file {parent}: name another path")
  return path


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_differences(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
  """``(dotted key, old, new)`` for every key whose value differs, run-time-only keys excepted, and the
  sub-configs of optimizers the run does not use (editing AdamW's settings does not change an SGD run).

  Resolved settings are compared only when both records have them (records made before they
  were kept have none); package versions are not compared here (:func:`version_differences`).
  """

  def used(d):
    d = {k: v for k, v in d.items() if k != VERSIONS_KEY}
    if RESOLVED_KEY not in old or RESOLVED_KEY not in new:
      d.pop(RESOLVED_KEY, None)
    o = d.get("optimizer", {})
    names = {old.get("optimizer", {}).get("name"), new.get("optimizer", {}).get("name")}
    kept = {k: v for k, v in o.items() if not isinstance(v, dict) or k in names}
    return {**d, "optimizer": kept} if "optimizer" in d else d

  a, b = _flat(used(old)), _flat(used(new))
  keys = sorted(set(a) | set(b), key=lambda k: (k not in a, k))

  def value(d, k):
    added = k.startswith(("optimizer.", f"{RESOLVED_KEY}.")) and k.rsplit(".", 1)[-1] in ADDED_ARGUMENTS
    return d.get(k, ADDED_ARGUMENTS[k.rsplit(".", 1)[-1]] if added else "<absent>")

  diff = [(k, value(a, k), value(b, k)) for k in keys if k not in RUNTIME_KEYS and value(a, k) != value(b, k)]
  # resolved settings follow the config's keys (full_max_dim from rank): said only when no key differs,
  # i.e. when a library default changed
  prefix = f"{RESOLVED_KEY}."
  keys_differ = any(not k.startswith(prefix) for k, _, _ in diff)
  return [(k[len(prefix):] + LIBRARY_DEFAULT, x, y) if k.startswith(prefix) else (k, x, y) for k, x, y in diff
          if not (keys_differ and k.startswith(prefix))]


def version_differences(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
  """``(package, old, new)`` for every package whose recorded version differs."""
  a, b = old.get(VERSIONS_KEY, {}), new.get(VERSIONS_KEY, {})
  return [(k, a[k], b.get(k)) for k in sorted(a) if k in b and a[k] != b[k]]


def check_config(workdir: str, record: dict, allow_change: bool = False) -> None:
  """Refuses to continue a workdir whose recorded config differs (naming the keys), unless ``allow_change``."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return
  try:
    with open(path) as f:
      old = json.load(f)
  except ValueError:
    raise errors.WorkdirError(f"{path} is not valid JSON: move it away to start over in {workdir}") from None
  versions = version_differences(old, record)
  if versions:
    said = ", ".join(f"{k} {a} -> {b}" for k, a, b in versions)
    print(f"warning: {workdir} was run with other package versions: {said}", file=sys.stderr, flush=True)
  diff = config_differences(old, record)
  if not diff:
    return
  said = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in diff[:8]) + (", ..." if len(diff) > 8 else "")
  if not allow_change:
    raise errors.WorkdirError(
        f"{workdir} holds a run of another config: {said}. Use another --workdir, or pass "
        "--allow_config_change to continue that run with the new config on purpose")
  print(f"warning: continuing {workdir} with a changed config: {said}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def lock(workdir: str, name: str = LOCK_FILE, holder: str = "run", advice: str = "use another --workdir"):
  """Holds ``<workdir>/<name>`` (``flock``, released by the OS even on ``kill -9``) for one live ``holder``."""
  f = open(os.path.join(workdir, name), "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    pid = f.read().strip() or "?"
    f.close()
    raise errors.WorkdirError(
        f"{workdir} is in use by another {holder} (pid {pid}): wait for it to finish, or {advice}") from None
  try:
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    yield
  finally:
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


@contextlib.contextmanager
def writing(path: str, kept: str):
  """A fixable write failure (full disk, read-only) as one line naming ``path`` and what is kept."""
  try:
    yield
  except Exception as e:
    os_error = errors.disk_error(e)
    if os_error is None:
      raise
    raise errors.WorkdirError(
        f"cannot write {path}: {os_error.strerror}. {kept}: free space (or make it writable) and rerun "
        "the same command to resume") from None


def write_json_atomic(path: str, text: str) -> None:
  """``text`` as the file ``path``, all or nothing: written to a temporary file, on disk (fsync), then renamed;
  a failure leaves the old file whole and no temporary file behind. The one atomic writer of the experiments."""
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


class StopRequest:
  """Ctrl-C (SIGINT) or preemption (SIGTERM) asks the loop to stop at the next step boundary, after
  saving a checkpoint of that step.

  An exception raised anywhere in the loop could land inside a checkpoint write (Orbax logs the
  interrupted save with a traceback) and loses the steps since the last checkpoint; a request is
  honoured between steps instead, also when it lands during an evaluation or a save (the next
  step's boundary then saves). A second signal of either kind acts at once (the handlers are
  restored: SIGINT raises ``KeyboardInterrupt``, SIGTERM terminates).
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signal: int | None = None
    self._previous: dict[int, Any] = {}

  @property
  def requested(self) -> bool:
    return self.signal is not None

  def _handle(self, signum, frame):
    self.signal = signum
    self._restore()

  def _restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    self._restore()


def stopped(signum: int | None, step: int, kept: str) -> errors.Interrupted:
  """The one line of a run stopped by ``signum`` (``None``: a second Ctrl-C) at ``step``."""
  if signum == signal.SIGTERM:
    return errors.Interrupted(f"terminated (SIGTERM) at step {step}; {kept}: rerun the same command to resume",
                              exit_code=128 + signal.SIGTERM)
  return errors.Interrupted(f"interrupted at step {step}; {kept}: rerun the same command to resume")
