"""Runs several optimizers on one config and writes the paper's figures and a table beside its numbers.

  python -m experiments.paper.compare --config configs/mnist.py --workdir workdir/mnist \
      --results_dir experiments/results/mnist --optimizers sgd,scsgd,adam --data_dir ../shared/tfds

Every optimizer gets the same seed, hence the same initialisation and the same batches. Runs
resume from their checkpoints in ``<workdir>/<optimizer>``. An optimizer that diverges is reported
in one line and marked in the report, which is still written for all.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from experiments.run import cli
from experiments.paper import compare_report
from experiments.run import errors
from experiments.run import machine
from experiments.run import metrics
from experiments.optim import optimizers
from experiments.run import train
from experiments.run import validate

FLAGS = flags.FLAGS


def run_configs(config, names) -> dict:
  """``{name: config with optimizer.name = name}``, every one validated before any runs."""
  unknown = [n for n in names if n not in optimizers.OPTIMIZERS]
  if unknown:
    raise errors.ConfigError(f"--optimizers: unknown optimizer {unknown[0]!r}; choose from {list(optimizers.OPTIMIZERS)}.")
  configs = {}
  for name in names:
    cfg = config.copy_and_resolve_references()
    cfg.optimizer.name = name
    validate.validate_config(cfg)
    configs[name] = cfg
  return configs


def compare(config, workdir: str, names, results_dir: str, command: str, *,
            allow_config_change: bool = False) -> str:
  runs, diverged = {}, {}
  for name, cfg in run_configs(config, names).items():
    run_dir = os.path.join(workdir, name)
    try:
      train.train_and_evaluate(cfg, run_dir, allow_config_change=allow_config_change)
    except errors.DivergedError as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      diverged[name] = e.step
    runs[name] = metrics.read(os.path.join(run_dir, train.METRICS_FILE))
  return compare_report.write_report(runs, config.dataset, results_dir, command, machine.describe(), diverged)


def main(argv):
  del argv
  results_dir = FLAGS.results_dir or os.path.join(FLAGS.workdir, "report")
  path = compare(cli.config(), FLAGS.workdir, FLAGS.optimizers, results_dir, cli.command_line(),
                 allow_config_change=FLAGS.allow_config_change)
  print(open(path).read())


if __name__ == "__main__":
  cli.define_flags(workdir=True, results_dir="")
  flags.DEFINE_list("optimizers", ["sgd", "scsgd", "adam"], "Optimizers to compare.")
  cli.run(main)
