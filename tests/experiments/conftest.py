import pytest
import tensorflow_datasets as tfds

from experiments.run import train
from tests import helpers


@pytest.fixture(scope="session")
def straight_dir():
  """The workdir of an uninterrupted 40-step smoke run on mock data, made once per test run: the reference every
  resumed run must equal (tests copy it, never change it)."""

  def make(workdir):
    with tfds.testing.mock_data(num_examples=600):
      train.train_and_evaluate(helpers.smoke_config(), workdir)

  return helpers.shared_run("straight", make)
