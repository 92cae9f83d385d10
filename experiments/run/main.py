"""Trains one config: ``python -m experiments.run.main --config configs/mnist.py --workdir /tmp/mnist``.

Config fields can be overridden on the command line, e.g. ``--config.optimizer.name=sgd``. Several processes
(hosts, or processes on one machine) run the same command, each with its ``--process_id``::

  python -m experiments.run.main --config configs/mnist.py --workdir /tmp/mnist \\
      --num_processes 2 --process_id 0 --coordinator_address 127.0.0.1:12355   # and --process_id 1
"""

import sys

from absl import flags

from experiments.run import cli
from experiments.run import devices
from experiments.run import errors
from experiments.run import supervise
from experiments.run import train

FLAGS = flags.FLAGS


def main(argv):
  del argv
  if FLAGS.num_processes > 1 and not supervise.supervised():
    sys.exit(supervise.run_child(FLAGS.process_id))  # a lost peer: one line, not the runtime's abort
  if FLAGS.num_processes > 1:
    devices.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  print(f"devices: {devices.DataParallel().describe()}", flush=True)
  try:
    last = train.train_and_evaluate(cli.config(), FLAGS.workdir, allow_config_change=FLAGS.allow_config_change)
  except Exception as e:  # noqa: BLE001 - with several processes, anything but a one-line error: a peer gone
    if FLAGS.num_processes > 1 and not isinstance(e, (errors.ExperimentError, OSError)):
      devices.collective_failed(e)
    raise
  print(last)


if __name__ == "__main__":
  cli.define_flags(workdir=True, results=False)
  flags.DEFINE_integer("num_processes", 1, "Processes of the run (jax.distributed); 1: this process alone.")
  flags.DEFINE_integer("process_id", 0, "This process's index, 0 to num_processes - 1 (0 serves the coordinator).")
  flags.DEFINE_string("coordinator_address", "127.0.0.1:12355", "host:port of process 0's coordinator.")
  cli.run(main)
