"""``python -m experiments.paper.convex --config configs/paper/convex.py --results_dir DIR [--data_dir DIR]``."""

from absl import flags

from experiments.run import cli
from experiments.paper.convex import experiment
from experiments.paper.convex import report

FLAGS = flags.FLAGS


def main(argv):
  del argv
  result = experiment.run_experiment(cli.config())
  print(open(report.write_report(result, FLAGS.results_dir, cli.command_line())).read())


if __name__ == "__main__":
  cli.define_flags(workdir=False)
  cli.run(main)
