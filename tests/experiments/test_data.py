"""Data: a missing dataset and a damaged file are one message naming what to do or the file."""

import os
import shutil

import numpy as np
import pytest

from experiments.run import data as data_lib
from experiments.run import errors

SHARED_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "tfds", "mnist")


def test_data_dir_without_dataset_is_a_clear_error(tmp_path):
  with pytest.raises(errors.DataError, match="not prepared in .*empty"):
    data_lib.load_split("mnist", "train", str(tmp_path / "empty"), download=False)


@pytest.mark.skipif(not os.path.isdir(SHARED_MNIST), reason="needs the prepared MNIST in ../shared/tfds")
@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_a_damaged_dataset_file_is_named(tmp_path, damage):
  shutil.copytree(SHARED_MNIST, tmp_path / "mnist")
  for root, dirs, files in os.walk(tmp_path):
    for name in dirs + files:
      os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
  (path,) = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.startswith("mnist-test.array_record")]
  size = os.path.getsize(path)
  if damage == "overwrite":
    with open(path, "r+b") as f:
      f.seek(size // 3)
      f.write(b"\xff" * 65536)
  else:
    os.truncate(path, size // 2)
  with pytest.raises(errors.DataError, match=f"cannot be read from {path}.*damaged"):
    data_lib.load_split("mnist", "test", str(tmp_path), download=False)


SHARED_TFDS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "tfds")


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_TFDS, "tiny_shakespeare")), reason="needs ../shared/tfds")
def test_text_is_cut_into_windows_whose_labels_are_the_next_characters():
  split = data_lib.load_split("tiny_shakespeare", "validation", SHARED_TFDS, download=False)
  (context,), vocab = data_lib.DATASETS["tiny_shakespeare"]
  assert split.inputs.shape == split.labels.shape == ((55_770 - 1) // context, context)
  np.testing.assert_array_equal(split.labels[:, :-1], split.inputs[:, 1:])
  np.testing.assert_array_equal(split.labels[:-1, -1], split.inputs[1:, 0])
  assert split.inputs.max() < vocab
  text = "".join(data_lib.SHAKESPEARE_CHARS[i] for i in split.inputs[0])
  assert text.startswith("?\n\nGREMIO:")  # the validation split of tfds' copy begins mid-play
