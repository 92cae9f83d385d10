"""Trains one config: ``python -m experiments.main --config configs/mnist.py --workdir /tmp/mnist``.

Config fields can be overridden on the command line, e.g. ``--config.optimizer.name=sgd``.
"""

from absl import flags

from experiments import cli
from experiments import devices
from experiments import train

FLAGS = flags.FLAGS


def main(argv):
  del argv
  print(f"devices: {devices.DataParallel().describe()}", flush=True)
  print(train.train_and_evaluate(cli.config(), FLAGS.workdir, allow_config_change=FLAGS.allow_config_change))


if __name__ == "__main__":
  cli.define_flags(workdir=True, results=False)
  cli.run(main)
