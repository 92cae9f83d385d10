"""The studies' one scaffold: each study is an entry point that reads its config, records the commit it runs,
computes, and writes one results file with its command, machine, commit and package versions."""

from __future__ import annotations

import os
from typing import Callable, Optional

import ml_collections
from absl import flags

from experiments.run import cli
from experiments.run import report

FLAGS = flags.FLAGS
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")

Study = Callable[[ml_collections.ConfigDict, str], Optional[tuple[dict, str]]]


def run(study: Study, results_dir: str = RESULTS) -> None:
  """``python -m experiments.studies.<name> --config ...``: ``study(config, results_dir)`` after the flags are read
  and the commit of the imported code recorded (the checkout may move on while it runs); the ``(results,
  filename)`` it returns is written under ``--results_dir`` (``None``: it wrote its own record)."""

  def main(argv):
    del argv
    config = cli.config()
    report.provenance()
    out = study(config, FLAGS.results_dir)
    if out is not None:
      results, filename = out
      report.write_results(FLAGS.results_dir, results, cli.command_line(), filename)

  cli.define_flags(workdir=False, data=False, results_dir=results_dir)
  cli.run(main)
