"""Every config value is checked before data is read or anything compiles: one line naming the key."""

import json
import os

import pytest
import tensorflow_datasets as tfds

from experiments.run import errors
from experiments.run import train
from experiments.run import validate
from experiments.run import workdir as workdir_lib
from tests import helpers


def _set(config, key, value):
  *parents, leaf = key.split(".")
  for p in parents:
    config = config[p]
  config[leaf] = value


BAD = [
    # (key set, value, key named in the message, words of the message)
    ("batch_size", 200, "batch_size", "larger than config.max_train_examples=100"),
    ("max_rows", -1, "max_rows", "must be >= 0"),
    ("eval_batch_size", 0, "eval_batch_size", "positive"),
    ("max_train_examples", 0, "max_train_examples", "-1 (all) or positive"),
    ("max_test_examples", 0, "max_test_examples", "-1 (all) or positive"),
    ("optimizer.scsgd.rank", 0, "optimizer.scsgd.rank", "rank must be an int >= 1"),
    ("optimizer.scsgd.ema_rate", 0.0, "optimizer.scsgd.ema_rate", "ema_rate must lie in (0, 1]"),
    ("optimizer.scsgd.ema_rate", 1.5, "optimizer.scsgd.ema_rate", "ema_rate must lie in (0, 1]"),
    ("optimizer.scsgd.update_every", 0, "optimizer.scsgd.update_every", "Refresh.every must be an int >= 1"),
    ("schedule.name", "cosine", "schedule.name", "not one of ['constant', 'inv', 'warmup_cosine']"),
    ("schedule.base", -0.1, "schedule.base", "must be positive"),
    ("optimizer.name", "lion", "optimizer.name", "not one of"),
    ("num_steps", 0, "num_steps", "positive"),
]


@pytest.mark.parametrize("key,value,named,words", BAD, ids=[f"{k}={v}" for k, v, _, _ in BAD])
def test_bad_value_is_one_line_naming_the_key_before_data_is_read(tmp_path, key, value, named, words):
  config = helpers.smoke_config(max_train_examples=100)
  config.data_dir = str(tmp_path / "no_data_here")  # reading data would fail with a DataError instead
  _set(config, key, value)
  with pytest.raises(errors.ConfigError) as info:
    train.train_and_evaluate(config, str(tmp_path / "run"))
  text = str(info.value)
  assert text.startswith(f"config.{named}") and words in text and "\n" not in text, text
  assert not (tmp_path / "run").exists()  # nothing written either


def test_rank_at_least_a_sketched_kernels_n_names_the_kernel(tmp_path):
  config = helpers.smoke_config()
  config.data_dir = str(tmp_path / "no_data_here")
  config.optimizer.scsgd.conditioner = "sketched"
  config.optimizer.scsgd.rank = 25  # conv1's n = 5 * 5 * 1
  with pytest.raises(errors.ConfigError, match=r"^config\.optimizer\.scsgd\.rank: rank=25 must be < n=25, "
                                               r"the input dimension of kernel 'conv1/kernel'"):
    train.train_and_evaluate(config, str(tmp_path / "run"))


def test_adam_learning_rate_must_be_positive(tmp_path):
  config = helpers.smoke_config()
  config.optimizer.name = "adam"
  config.optimizer.adam.learning_rate = -1e-3
  with pytest.raises(errors.ConfigError, match=r"^config\.optimizer\.adam\.learning_rate must be positive"):
    validate.validate_config(config)


def test_batch_larger_than_the_dataset_is_caught_before_decoding(tmp_path, monkeypatch):
  from experiments.run import data as data_lib

  def no_decoding(*args, **kwargs):
    raise AssertionError("decoded before checking the batch size")

  monkeypatch.setattr(data_lib, "decode", no_decoding)
  config = helpers.smoke_config(batch_size=1000, max_train_examples=-1)  # mock data has 600 examples
  with tfds.testing.mock_data(num_examples=600):
    with pytest.raises(errors.ConfigError, match=r"^config\.batch_size=1000 is larger than the 600 training examples"):
      train.train_and_evaluate(config, str(tmp_path))


def test_only_the_used_optimizers_sub_config_is_part_of_a_run():
  old = {"seed": 0, "optimizer": {"name": "sgd", "weight_decay": 0.0, "sgd": {"momentum": 0.9}, "adamw": {"b1": None}}}
  new = json.loads(json.dumps(old))
  new["optimizer"]["adamw"]["b1"] = 0.8  # another optimizer's setting
  new["optimizer"]["kfac"] = {"damping": None}  # an optimizer added to the config since
  assert workdir_lib.config_differences(old, new) == []
  new["optimizer"]["sgd"]["momentum"] = 0.5
  new["optimizer"]["weight_decay"] = 1e-4
  assert workdir_lib.config_differences(old, new) == [("optimizer.sgd.momentum", 0.9, 0.5),
                                                ("optimizer.weight_decay", 0.0, 1e-4)]
  new["optimizer"]["name"] = "adamw"  # another optimizer: its name and both sub-configs count
  assert [k for k, _, _ in workdir_lib.config_differences(old, new)] == [
      "optimizer.adamw.b1", "optimizer.name", "optimizer.sgd.momentum", "optimizer.weight_decay"]


def test_an_argument_added_since_a_record_reads_as_the_behaviour_before_it():
  """A record made before `normalize` existed ran at the paper's scale: it equals today's run with
  normalize='none', and differs from one with normalize='all' (a later default included)."""
  old = {"optimizer": {"name": "scsgd", "scsgd": {"rank": None}}, "resolved": {"rank": 32}}
  new = json.loads(json.dumps(old))
  new["resolved"]["normalize"] = "none"
  assert workdir_lib.config_differences(old, new) == []
  new["resolved"]["normalize"] = "all"
  assert workdir_lib.config_differences(old, new) == [("normalize (library default)", "none", "all")]
  new["optimizer"]["scsgd"]["normalize"] = "all"
  assert workdir_lib.config_differences(old, new) == [("optimizer.scsgd.normalize", "none", "all")]


def test_configs_are_data_that_import_nothing_from_experiments():
  """configs/ and experiments/ once imported each other; a config file now imports only configs/."""
  import glob
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  names = [os.path.relpath(p, root)[:-3].replace(os.sep, ".") for p in glob.glob(os.path.join(root, "configs", "**",
                                                                                             "*.py"), recursive=True)]
  code = ("import sys, importlib\n" + "".join(f"importlib.import_module({n!r}).__dict__.get('get_config', "
                                                  f"lambda: None)()\n" for n in names) +
          "bad = sorted(m for m in sys.modules if m == 'experiments' or m.startswith('experiments.'))\n"
          "assert not bad, bad\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert len(names) > 10
