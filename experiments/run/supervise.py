"""One line when the coordinator of a multi-process run dies.

JAX's runtime ends every other process at once when process 0 (the coordinator) is lost, through a fatal log
and an abort (a C++ stack trace and a Python thread dump) that Python cannot intercept. So a process other
than 0 runs its training in a child process; this parent passes the child's output through as it comes and,
if the child is aborted by the runtime for a lost coordinator, replaces that noise by one line and exit
status 1. SIGTERM and SIGINT are passed on to the child, whose own handlers checkpoint the step in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CHILD = "SCSGD_SUPERVISED"  # set in the child's environment: it trains, and is not supervised again
LOST = "JAX distributed service detected fatal errors"  # the runtime's fatal log for a lost peer
NOISE = ("coordination_service_agent.cc", "coordination_service.cc")  # its error lines just before


def supervised() -> bool:
  """Whether this process is the supervised child (or needs no supervision)."""
  return os.environ.get(CHILD) == "1"


def run_child(process_id: int) -> int:
  """Runs this command again as a child and returns its exit status (see the module docstring)."""
  child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env={**os.environ, CHILD: "1"},
                           stderr=subprocess.PIPE, text=True, errors="replace")
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: child.send_signal(signum))
  lost = False
  for line in child.stderr:
    if LOST in line and "Terminating process" in line:
      lost = True
    if not lost and not any(n in line for n in NOISE):
      sys.stderr.write(line)
      sys.stderr.flush()
  code = child.wait()
  if lost:
    print(f"error: the coordinator (process 0) stopped; process {process_id} stops too. The run's workdir keeps "
          "its last checkpoint: rerun the same commands to resume", file=sys.stderr, flush=True)
    return 1
  return code if code >= 0 else 128 - code
