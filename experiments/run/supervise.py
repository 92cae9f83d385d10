"""One line when a peer of a multi-process run dies.

JAX's runtime can end a process of a multi-process run through an abort that Python cannot intercept (a C++
stack trace and a Python thread dump): every process other than 0 when process 0, the coordinator, is lost
(the runtime's fatal log), and any process whose collective a dying peer cut mid-transfer (gloo's size
check). So every process of such a run trains in a child process; this parent passes the child's output
through as it comes and, if the child is aborted for a lost peer, replaces that noise by one line and exit
status 1. An abort for any other reason is passed through whole. SIGTERM and SIGINT are passed on to the
child, whose own handlers checkpoint the step in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CHILD = "SCSGD_SUPERVISED"  # set in the child's environment: it trains, and is not supervised again
LOST = "JAX distributed service detected fatal errors"  # the runtime's fatal log for a lost peer
NOISE = ("coordination_service_agent.cc", "coordination_service.cc")  # its error lines just before
CUT = "Received data size doesn't match expected size"  # gloo's check when a peer died mid-transfer
DYING = ("terminate called", "Fatal Python error", CUT, LOST)  # an abort under way: what follows is held


def supervised() -> bool:
  """Whether this process is the supervised child (or needs no supervision)."""
  return os.environ.get(CHILD) == "1"


def stop_line(why: str, process_id: int) -> str:
  """The one line a process of a multi-process run ends with when a peer is gone (``why``)."""
  return (f"error: {why}; process {process_id} stops too. The run's workdir keeps its last checkpoint: "
          "rerun the same commands to resume")


def run_child(process_id: int, argv: list[str] | None = None) -> int:
  """Runs ``argv`` (by default this command again) as a child and returns its exit status (see the module
  docstring)."""
  argv = argv or [sys.executable, *sys.orig_argv[1:]]
  child = subprocess.Popen(argv, env={**os.environ, CHILD: "1"}, stderr=subprocess.PIPE, text=True,
                           errors="replace")
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: child.send_signal(signum))
  held = []  # from the first sign of an abort on, the child's lines wait for its end to say what they were
  for line in child.stderr:
    if held or any(d in line for d in DYING):
      held.append(line)
    elif not any(n in line for n in NOISE):
      sys.stderr.write(line)
      sys.stderr.flush()
  code = child.wait()
  why = _lost_peer(held, process_id) if code < 0 else None  # aborted (a signal)
  if why is None:
    sys.stderr.writelines(held)
    sys.stderr.flush()
    return code if code >= 0 else 128 - code
  print(stop_line(why, process_id), file=sys.stderr, flush=True)
  return 1


def _lost_peer(held: list[str], process_id: int) -> str | None:
  """What a failed child's held lines say of a lost peer (``None``: nothing; they are the child's own)."""
  if any(LOST in line and "Terminating process" in line for line in held):
    # (process 0 itself hears so of a peer lost to the runtime's own heartbeat)
    return "the coordinator (process 0) stopped" if process_id else "a peer stopped (the runtime lost its heartbeat)"
  if any(CUT in line for line in held):
    return "a peer stopped in the middle of a step across processes (gloo: the data it sent was cut short)"
  return None
