"""The supervisor of a multi-process run's processes (``experiments.run.supervise``): a child the runtime or
gloo aborts for a lost peer ends in one line and exit status 1; anything else passes through unchanged. The
children here are stand-ins that print what the runtime and gloo print, then abort as they do."""

import sys

import pytest

from experiments.run import supervise

GLOO = ("terminate called after throwing an instance of 'std::runtime_error'\n"
        "  what():  [enforce fail at pair.cc:1] Received data size doesn't match expected size. Is there a "
        "distributed collective mismatch?\n")
RUNTIME = ("E1128 coordination_service_agent.cc:1] Polled an error from coordination service\n"
           "F1128 client.h:77] JAX distributed service detected fatal errors. Terminating process.\n")


def _child(stderr: str, then: str) -> list[str]:
  code = f"import os, sys; sys.stderr.write({stderr!r}); sys.stderr.flush(); {then}"
  return [sys.executable, "-c", code]


@pytest.mark.parametrize("process_id,said,why", [
    (0, GLOO, "a peer stopped in the middle of a step across processes (gloo: the data it sent was cut short)"),
    (1, GLOO, "a peer stopped in the middle of a step across processes (gloo: the data it sent was cut short)"),
    (1, RUNTIME, "the coordinator (process 0) stopped"),
    (0, RUNTIME, "a peer stopped (the runtime lost its heartbeat)"),
])
def test_an_abort_for_a_lost_peer_is_one_line(capfd, process_id, said, why):
  code = supervise.run_child(process_id, _child("step 10\n" + said + "Fatal Python error: Aborted\n\nThread 0x1:\n",
                                                "os.abort()"))
  err = capfd.readouterr().err
  assert code == 1
  assert err.splitlines() == ["step 10", f"error: {why}; process {process_id} stops too. The run's workdir keeps "
                                         "its last checkpoint: rerun the same commands to resume"]


@pytest.mark.parametrize("then,code", [("os.abort()", 128 + 6), ("sys.exit(3)", 3), ("pass", 0)])
def test_any_other_ending_passes_through_whole(capfd, then, code):
  said = "Check failed: something else\nFatal Python error: Aborted\n" if "abort" in then else "a line\n"
  assert supervise.run_child(0, _child(said, then)) == code
  assert capfd.readouterr().err == said


def test_gloos_line_alone_without_an_abort_keeps_the_childs_status(capfd):
  """A child that printed gloo's line but ended by itself (the peer watch's own one line) keeps its status and
  its lines."""
  assert supervise.run_child(0, _child(GLOO + "error: process 1 of 2 stopped\n", "sys.exit(1)")) == 1
  assert capfd.readouterr().err == GLOO + "error: process 1 of 2 stopped\n"
