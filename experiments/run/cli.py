"""Start-up shared by every entry point: flags, the recorded command line, errors as one line.

Every entry point has the same face (the Flax examples' shape)::

  python -m experiments.<name> --config configs/<file>.py [--config.<key>=<value> ...]
      [--workdir DIR] [--data_dir DIR] [--results_dir DIR]

``run(main)`` runs ``main`` under absl and turns what can stop an experiment into one line on
stderr and a non-zero exit, never a traceback: an :class:`errors.ExperimentError` (bad config,
missing or corrupt data, an unusable workdir, divergence), an unwritable disk, and Ctrl-C (exit 130).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shlex
import sys
from typing import Callable, Optional

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from experiments.run import errors
from experiments.optim import optimizers
from experiments.run import workdir as workdir_lib

FLAGS = flags.FLAGS


def define_flags(*, workdir: bool, results: bool = True, results_dir: Optional[str] = None, data: bool = True) -> None:
  """The flags of an entry point; called only when run as a script (so modules import together).

  ``results_dir=None`` makes ``--results_dir`` required; a string is its default.
  """
  flags.DEFINE_string("config_file", None, "Set from --config PATH (read by parse_flags, which completes the "
                      "config before --config.<key> overrides apply).")
  if data:
    flags.DEFINE_string("data_dir", None, "TFDS data dir (default: $TFDS_DATA_DIR, else tfds' own).")
  if workdir:
    flags.DEFINE_string("workdir", None, "Directory of the run(s): metrics, checkpoints, config.", required=True)
    flags.DEFINE_bool("allow_config_change", False,
                      "Continue a workdir whose recorded config differs from --config (on purpose).")
  if results:
    flags.DEFINE_string("results_dir", results_dir, "Where the results (report, figures, JSON) are written.",
                        required=results_dir is None)


def config():
  """``--config`` with ``--data_dir`` applied (the one place a flag reaches into the config)."""
  cfg = FLAGS.config
  if "data_dir" in FLAGS and FLAGS.data_dir:
    cfg.data_dir = FLAGS.data_dir
  return cfg


def command_line(argv: Optional[list[str]] = None) -> str:
  """The command as the user typed it, ``python -m experiments.<name> ...``, for result headers."""
  argv = sys.argv if argv is None else argv
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  module = spec.name.removesuffix(".__main__") if spec else argv[0]  # a package's __main__: its package
  return f"python -m {module} " + " ".join(shlex.quote(a) for a in argv[1:])


def message(e: BaseException) -> tuple[str, int]:
  """The one line and exit status for what stopped a run."""
  if isinstance(e, errors.ExperimentError):
    return f"error: {e}", e.exit_code
  if isinstance(e, KeyboardInterrupt):
    return "interrupted; what finished is kept (records, checkpoints): rerun the same command to resume", 130
  os_error = errors.disk_error(e)
  if os_error is not None:
    return f"error: cannot write {os_error.filename or 'to disk'}: {os_error.strerror}", 1
  raise e


def guarded(main: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
  """``main`` with what can stop an experiment turned into one line on stderr and an exit status."""

  def wrapped(argv):
    logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except (errors.ExperimentError, KeyboardInterrupt, OSError) as e:
      line, code = message(e)
      print(line.splitlines()[0] if line else line, file=sys.stderr, flush=True)
      sys.exit(code)

  return wrapped


def _config_path(argv: list[str]) -> tuple[Optional[str], list[str]]:
  """``--config PATH`` (or ``--config=PATH``) and the other arguments."""
  for i, a in enumerate(argv):
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1], argv[:i] + argv[i + 2:]
    if a.startswith("--config="):
      return a[len("--config="):], argv[:i] + argv[i + 1:]
  return None, argv


def load_config(path: str) -> ml_collections.ConfigDict:
  """``get_config()`` of the config file ``path``, completed with every optimizer argument as a placeholder
  (configs are data that state only what differs from the defaults; overrides reach every argument)."""
  spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return optimizers.complete(module.get_config())


def _unknown_override(argv: list[str], cfg) -> Optional[str]:
  """The first ``--config.<key>=...`` naming a key the config does not have, said with the closest keys."""
  for a in argv:
    if not a.startswith("--config."):
      continue
    key = a[len("--config."):].split("=", 1)[0]
    node, seen = cfg, "config"
    for part in key.split("."):
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if part not in keys:
        close = difflib.get_close_matches(part, keys, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"its keys: {', '.join(sorted(keys)) or 'none'}"
        return f"--config.{key}: {seen} has no key '{part}' ({hint})"
      node, seen = node[part], f"{seen}.{part}"
  return None


def _one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0] if text else type(e).__name__


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every failure said in one line naming the culprit (exit status 2):
  a config file that is missing or does not load, an unknown ``--config.<key>`` (with the closest
  keys), a value that does not parse, an unknown flag, an unusable ``--workdir``."""

  def fail(line: str):
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(2)

  path, argv = _config_path(argv)
  if path is None:
    fail("--config is required: the path of a config file (configs/*.py)")
  if not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    there = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(folder) else []
    close = difflib.get_close_matches(os.path.basename(path), there, n=3, cutoff=0.5)
    fail(f"--config {path}: no such file" +
         (f" (did you mean {', '.join(os.path.join(folder, c) for c in close)}?)" if close else ""))
  try:
    cfg = load_config(path)
  except Exception as e:  # the config file itself is broken
    fail(f"--config {path} does not load: {type(e).__name__}: {_one_line(e)}")
  try:
    # the overrides are read from sys_argv: the arguments without --config PATH (else the flag waits for one)
    config_flags.DEFINE_config_dict("config", cfg, "The config (--config PATH), with --config.<key> overrides.",
                                    lock_config=True, sys_argv=list(argv))
    rest = FLAGS(argv + [f"--config_file={path}"])
  except Exception as e:  # config_flags raises KeyError/AttributeError/ValueError; absl flags.Error
    line = _unknown_override(argv, cfg) if isinstance(e, (KeyError, AttributeError)) else None
    fail(line or _one_line(e))
  if "workdir" in FLAGS:
    try:
      workdir_lib.check_path(FLAGS.workdir)
    except errors.WorkdirError as e:
      fail(str(e))
  return rest


def config_path() -> str:
  """The path given as ``--config``."""
  return FLAGS.config_file


def run(main: Callable[[list[str]], object]) -> None:
  app.run(guarded(main), flags_parser=parse_flags)
