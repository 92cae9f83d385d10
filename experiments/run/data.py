"""Data from ``tfds.data_source`` (ArrayRecord; no TensorFlow needed to read).

The whole split is decoded once into memory (MNIST: 60k images, ~3 s with Pillow) and
batches are drawn from a per-epoch permutation that depends only on the seed, so every
optimizer run with the same seed sees the same batches in the same order. A text dataset
(``tiny_shakespeare``: one example per split holding the whole text) becomes characters, cut
into non-overlapping windows of ``context + 1``: inputs are a window's first ``context``
characters, labels the next character at each position (a character LM).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple, Optional

import numpy as np

from experiments.run import errors

# name -> (input shape of one example, number of classes); text: (context,), vocabulary size
DATASETS = {"mnist": ((28, 28, 1), 10), "svhn_cropped": ((32, 32, 3), 10), "tiny_shakespeare": ((64,), 65)}
TEXT = ("tiny_shakespeare",)


DataError = errors.DataError


class Split(NamedTuple):
  inputs: np.ndarray  # images: float32 in [0, 1], NHWC; text: int32 character ids (N, context)
  labels: np.ndarray  # int32: (N,) classes, or (N, context) next characters


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
    splits = _prepared_splits(tfds, name, data_dir)
    if splits and split.split("[", 1)[0] not in splits:
      raise DataError(f"dataset '{name}' has no split '{split}'; its splits: {', '.join(splits)}.") from None
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


def _prepared_splits(tfds, name: str, data_dir: Optional[str]) -> list[str]:
  """The splits of a prepared copy of ``name`` in ``data_dir`` (empty if there is none)."""
  try:
    builder = tfds.builder(name, data_dir=data_dir)
    return sorted(builder.info.splits.keys()) if builder.is_prepared() else []
  except Exception:  # no builder, no copy, or unreadable metadata: let the caller say "not prepared"
    return []


def _files(source, split: str) -> str:
  try:
    return ", ".join(str(p) for p in source.dataset_info.splits[split].filepaths)
  except Exception:  # mock sources have no files
    return f"the files of split '{split}'"


_decoded: Optional[dict] = None


@contextlib.contextmanager
def reuse_decoded_splits():
  """Within it, a split decoded once is reused (the benchmark trains many runs on one dataset)."""
  global _decoded
  _decoded = {}
  try:
    yield
  finally:
    _decoded = None


def decode(source, name: str, split: str, max_examples: int = -1) -> Split:
  """Decodes the first ``max_examples`` (all if negative) of ``source`` into memory, pixels in [0, 1].

  A file that cannot be read or decoded (corrupt, truncated) is a :class:`DataError` naming it.
  """
  if _decoded is not None:
    key = (name, split, max_examples, str(getattr(getattr(source, "dataset_info", None), "data_dir", "")))
    if key not in _decoded:
      _decoded[key] = _decode(source, name, split, max_examples)
    return _decoded[key]
  return _decode(source, name, split, max_examples)


def _decode(source, name: str, split: str, max_examples: int) -> Split:
  n = len(source) if max_examples is None or max_examples < 0 else min(max_examples, len(source))
  try:
    try:
      examples = source.__getitems__(list(range(n)))  # one batched read of the ArrayRecord file
    except (TypeError, AttributeError):  # sources without batched reads (tfds.testing.mock_data's, a list)
      examples = [source[i] for i in range(n)]
    if name in TEXT:
      return _windows(name, "".join(_text(ex["text"]) for ex in examples))
    images = np.stack([np.asarray(ex["image"]) for ex in examples]).astype(np.float32) / 255.0
    labels = np.asarray([ex["label"] for ex in examples], np.int32)
  except DataError:
    raise
  except Exception as e:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    raise DataError(f"dataset '{name}' (split '{split}') cannot be read from {_files(source, split)}: "
                    f"{type(e).__name__}: {first}. The file is damaged: prepare the dataset again.") from None
  expected, _ = DATASETS[name]
  if images.shape[1:] != expected:
    raise DataError(f"dataset '{name}' has images of shape {images.shape[1:]}, expected {expected}.")
  return Split(images, labels)


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# tiny_shakespeare's 65 characters, in code-point order (the vocabulary of tfds' copy of char-rnn's input.txt)
SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _windows(name: str, text: str) -> Split:
  (context,), vocab = DATASETS[name]
  table = {c: i for i, c in enumerate(SHAKESPEARE_CHARS)}
  unknown = sorted(set(text) - set(table))
  if unknown:
    raise DataError(f"dataset '{name}' has characters outside its {vocab}-character vocabulary: {unknown[:10]}")
  ids = np.asarray([table[c] for c in text], np.int32)
  n = (len(ids) - 1) // context
  if n == 0:
    raise DataError(f"dataset '{name}' has {len(ids)} characters, fewer than one window of {context + 1}.")
  inputs = ids[: n * context].reshape(n, context)
  labels = ids[1: n * context + 1].reshape(n, context)
  return Split(inputs, labels)


def example_batch(name: str, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Zeros shaped and typed as a training batch of ``name`` (inputs, labels), for tracing a model."""
  shape, _ = DATASETS[name]
  if name in TEXT:  # token windows, and the next token at every position
    return np.zeros((batch_size,) + shape, np.int32), np.zeros((batch_size,) + shape, np.int32)
  return np.zeros((batch_size,) + shape, np.float32), np.zeros((batch_size,), np.int32)


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
