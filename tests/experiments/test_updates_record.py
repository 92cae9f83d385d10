"""Every registry entry's updates on the tests' small models equal the record bit for bit
(``updates_record.RECORD``, written before the face's refactor, every entry written again after the step bound on
the CPU it notes): a change meant to leave the arithmetic alone is proved to. The check runs in a process of its
own under XLA's default flags, as the record was made (and as users' runs compile). The default suite checks one
entry of each family, each on a model of another kind; the whole record (half an hour on two cores) runs on its
own: ``pytest -m record``. XLA compiles for the CPU's vector instruction
sets, and the same program rounds otherwise on another: each entry is checked on the CPUs it was recorded on
(``updates_machines.json``; an entry recorded before the CPUs were noted is checked nowhere until recorded again)."""

import json
import os
import subprocess
import sys

import pytest

from tests.experiments import updates_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDED = json.loads(updates_record.RECORD.read_text())
# one entry of each family (the SGD side, the eigenbasis, Muon's, the two sides), each on a model of another kind
SAMPLE = ["scsgd:cnn", "scsgd_eigen:transformer", "scsgd_eigen_muon:scanned", "scsgd_two_sided:mlp"]


def _check(pairs) -> dict[str, list[str]]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the default flags, as the record was made
  done = subprocess.run([sys.executable, "-m", "tests.experiments.updates_record", "--check", *pairs], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=1800)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_record_holds_every_entry_on_every_model():
  assert sorted(RECORDED) == sorted(updates_record.entries())
  assert all(sorted(RECORDED[n]) == sorted(updates_record.MODELS) for n in RECORDED)


def _here(pairs) -> list[str]:
  """The pairs whose entry was recorded on this CPU (a record holds bit for bit on the CPU it was made on); none:
  the test says so and skips."""
  here = [p for p in pairs if updates_record.recorded_on(p.split(":")[0]) == updates_record.machine()]
  if not here:
    pytest.skip("the record was made on another CPU (its vector instruction sets differ): rerun "
                "python -m tests.experiments.updates_record on this one")
  return here


def test_an_entry_of_each_family_updates_as_recorded():
  changed = {pair: leaves for pair, leaves in _check(_here(SAMPLE)).items() if leaves}
  assert not changed, changed


@pytest.mark.record
def test_every_entry_updates_as_recorded():
  pairs = [f"{name}:{kind}" for name in updates_record.entries() for kind in updates_record.MODELS]
  changed = {pair: leaves for pair, leaves in _check(_here(pairs)).items() if leaves}
  assert not changed, changed
