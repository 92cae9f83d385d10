"""Runs several optimizers on one config and writes the paper's figures and a table beside its numbers.

  python -m experiments.compare --config configs/mnist.py --workdir workdir/mnist \
      --results_dir experiments/results/mnist --optimizers sgd,scsgd,adam

Every optimizer gets the same seed, hence the same initialisation and the same batches.
Runs resume from their checkpoints in ``--workdir``.
"""

from __future__ import annotations

import os
import shlex
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import machine
from experiments import optimizers
from experiments import report
from experiments import data as data_lib
from experiments import train

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags, defined only when run as a script (so modules can be imported together)."""
  flags.DEFINE_string("workdir", None, "Each optimizer trains in <workdir>/<name>.", required=True)
  flags.DEFINE_string("results_dir", None, "Where metrics, figures and the table go (default: <workdir>/report).")
  flags.DEFINE_list("optimizers", ["sgd", "scsgd", "adam"], "Optimizers to compare.")
  flags.DEFINE_string("data_dir", None, "TFDS data dir (default: $TFDS_DATA_DIR, else tfds' own).")
  config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)


def compare(config, workdir: str, names, results_dir: str, command: str) -> str:
  for name in names:
    if name not in optimizers.OPTIMIZERS:
      raise train.ConfigError(f"--optimizers: unknown optimizer {name!r}; choose from {optimizers.OPTIMIZERS}.")
  runs = {}
  for name in names:
    cfg = config.copy_and_resolve_references()
    cfg.optimizer.name = name
    train.validate_config(cfg)
  for name in names:
    cfg = config.copy_and_resolve_references()
    cfg.optimizer.name = name
    run_dir = os.path.join(workdir, name)
    train.train_and_evaluate(cfg, run_dir)
    runs[name] = report.read_metrics(os.path.join(run_dir, train.METRICS_FILE))
  return report.write_report(runs, config.dataset, results_dir, command, machine.describe())


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = FLAGS.config
  if FLAGS.data_dir:
    config.data_dir = FLAGS.data_dir
  results_dir = FLAGS.results_dir or os.path.join(FLAGS.workdir, "report")
  command = "python -m experiments.compare " + " ".join(shlex.quote(a) for a in sys.argv[1:])
  try:
    path = compare(config, FLAGS.workdir, FLAGS.optimizers, results_dir, command)
  except (data_lib.DataError, train.ConfigError) as e:  # bad data dir or config: a message, not a traceback
    sys.exit(f"error: {e}")
  print(open(path).read())


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config"])
  app.run(main)
