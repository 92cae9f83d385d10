"""What can stop an experiment, each said in one line to the user (``cli`` prints them; no traceback)."""

import errno
from typing import Optional

# Write failures a user can fix (free space, permissions, a read-only mount) rather than bugs.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def disk_error(e: BaseException) -> Optional[OSError]:
  """The fixable write failure (full disk, read-only, permissions) in ``e`` or its causes, else None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
      return e
    e = e.__cause__ or e.__context__
  return None


class ExperimentError(Exception):
  """A failure with a one-line explanation for the user; the entry point exits with ``exit_code``."""

  exit_code = 1


class ConfigError(ExperimentError, ValueError):
  """A config value that cannot run; the message starts with the key (``config.<key> ...``)."""


class DataError(ExperimentError, RuntimeError):
  """A dataset that cannot be found, prepared or read."""


class WorkdirError(ExperimentError):
  """A workdir that cannot be used: held by a live run, holding another config, unwritable, damaged."""


class LayoutError(WorkdirError):
  """A sound checkpoint whose state has another layout than the config builds (not damage)."""


class DivergedError(ExperimentError, FloatingPointError):
  """Training produced non-finite metrics; names the optimizer and the step."""

  def __init__(self, optimizer: str, step: int, message: str):
    super().__init__(message)
    self.optimizer = optimizer
    self.step = step


class Interrupted(ExperimentError):
  """Ctrl-C or SIGTERM: the run stopped cleanly; its last checkpoint is kept and the same command resumes it.

  Exit status 130 for SIGINT, 143 for SIGTERM (128 + the signal, as a shell reports it).
  """

  exit_code = 130

  def __init__(self, message: str, exit_code: int = 130):
    super().__init__(message)
    self.exit_code = exit_code
