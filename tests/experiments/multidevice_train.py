"""Run by test_devices.py: the smoke config on tfds mock data into ``argv[1]``, on as many host CPU devices as
``XLA_FLAGS`` gives; prints the device line of ``experiments.run.main`` and the last metrics row."""

import sys

import tensorflow_datasets as tfds

from experiments.run import devices
from experiments.run import train
from tests import helpers

if __name__ == "__main__":
  print(f"devices: {devices.DataParallel().describe()}", flush=True)
  with tfds.testing.mock_data(num_examples=600):
    print(train.train_and_evaluate(helpers.smoke_config(), sys.argv[1]), flush=True)
