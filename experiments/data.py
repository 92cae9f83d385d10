"""Image classification data from ``tfds.data_source`` (ArrayRecord; no TensorFlow needed to read).

The whole split is decoded once into memory (MNIST: 60k images, ~3 s with Pillow) and
batches are drawn from a per-epoch permutation that depends only on the seed, so every
optimizer run with the same seed sees the same batches in the same order.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import numpy as np

from experiments import errors

# name -> (image shape, number of classes)
DATASETS = {"mnist": ((28, 28, 1), 10), "svhn_cropped": ((32, 32, 3), 10)}


DataError = errors.DataError


class Split(NamedTuple):
  images: np.ndarray  # float32 in [0, 1], NHWC
  labels: np.ndarray  # int32


def resolve_data_dir(data_dir: Optional[str]) -> Optional[str]:
  """``data_dir`` if given, else ``$TFDS_DATA_DIR``, else ``None`` (tfds' own default, ~/tensorflow_datasets)."""
  return data_dir or os.environ.get("TFDS_DATA_DIR") or None


def check_dataset_name(name: str) -> None:
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}.")


def open_split(name: str, split: str, data_dir: Optional[str] = None, download: bool = True):
  """The ``tfds.data_source`` of a split (nothing decoded yet; ``len()`` gives its size).

  Reads a prepared copy (no TensorFlow needed). If there is none and ``download`` is true, lets
  tfds download and prepare it (needs TensorFlow and internet); every failure is a
  :class:`DataError` that says what to do.
  """
  check_dataset_name(name)
  import tensorflow_datasets as tfds  # deferred: heavy import

  data_dir = resolve_data_dir(data_dir)
  where = data_dir or "tfds' default data dir (~/tensorflow_datasets)"
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as missing:  # tfds raises several types for "not prepared"
    if not download:
      raise DataError(
          f"dataset '{name}' (split '{split}') is not prepared in {where} and downloading is off. "
          "Point --data_dir or TFDS_DATA_DIR at a directory holding a prepared copy (e.g. ../shared/tfds)."
      ) from missing
  try:
    import tensorflow  # noqa: F401  (tfds needs it to download and prepare, not to read)
  except ImportError:
    raise DataError(
        f"dataset '{name}' (split '{split}') is not prepared in {where}, and preparing it needs "
        "TensorFlow: install the 'prepare' extra (pip install -e '.[experiments,prepare]') on a machine "
        "with internet, or point --data_dir / TFDS_DATA_DIR at a prepared copy (e.g. ../shared/tfds)."
    ) from None
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=True)
  except Exception as e:
    raise DataError(
        f"dataset '{name}' (split '{split}') is not prepared in {where} and could not be downloaded "
        f"and prepared ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check the "
        "network, or point --data_dir / TFDS_DATA_DIR at a prepared copy (e.g. ../shared/tfds)."
    ) from None


def _files(source, split: str) -> str:
  try:
    return ", ".join(str(p) for p in source.dataset_info.splits[split].filepaths)
  except Exception:  # mock sources have no files
    return f"the files of split '{split}'"


def decode(source, name: str, split: str, max_examples: int = -1) -> Split:
  """Decodes the first ``max_examples`` (all if negative) of ``source`` into memory, pixels in [0, 1].

  A file that cannot be read or decoded (corrupt, truncated) is a :class:`DataError` naming it.
  """
  n = len(source) if max_examples is None or max_examples < 0 else min(max_examples, len(source))
  try:
    try:
      examples = source.__getitems__(list(range(n)))  # one batched read of the ArrayRecord file
    except TypeError:  # sources without batched reads (e.g. tfds.testing.mock_data's)
      examples = [source[i] for i in range(n)]
    images = np.stack([np.asarray(ex["image"]) for ex in examples]).astype(np.float32) / 255.0
    labels = np.asarray([ex["label"] for ex in examples], np.int32)
  except Exception as e:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    raise DataError(f"dataset '{name}' (split '{split}') cannot be read from {_files(source, split)}: "
                    f"{type(e).__name__}: {first}. The file is damaged: prepare the dataset again.") from None
  expected, _ = DATASETS[name]
  if images.shape[1:] != expected:
    raise DataError(f"dataset '{name}' has images of shape {images.shape[1:]}, expected {expected}.")
  return Split(images, labels)


def load_split(name: str, split: str, data_dir: Optional[str] = None, max_examples: int = -1,
               download: bool = True) -> Split:
  """:func:`open_split` then :func:`decode`."""
  return decode(open_split(name, split, data_dir, download), name, split, max_examples)


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Indices of the batch of ``step``: epochs are seeded permutations; depends on (seed, step) only."""
  per_epoch = num_examples // batch_size
  if per_epoch == 0:
    raise ValueError(f"batch_size={batch_size} is larger than the {num_examples} training examples.")
  epoch, i = divmod(step, per_epoch)
  return _permutation(num_examples, seed, epoch)[i * batch_size:(i + 1) * batch_size]


@functools.lru_cache(maxsize=2)
def _permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_examples)
