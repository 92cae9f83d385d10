"""Trains one config: ``python -m experiments.main --config configs/mnist.py --workdir /tmp/mnist``.

Config fields can be overridden on the command line, e.g. ``--config.optimizer.name=sgd``.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import data as data_lib
from experiments import train

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and the config.", required=True)
flags.DEFINE_string("data_dir", None, "TFDS data dir (default: $TFDS_DATA_DIR, else tfds' own).")
config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)


def main(argv):
  del argv
  config = FLAGS.config
  if FLAGS.data_dir:
    config.data_dir = FLAGS.data_dir
  logging.set_verbosity(logging.WARNING)
  try:
    last = train.train_and_evaluate(config, FLAGS.workdir)
    print(last)
  except (data_lib.DataError, train.ConfigError) as e:  # bad data dir or config: a message, not a traceback
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
