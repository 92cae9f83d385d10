"""The head to head's sanity anchors: the loss of trivial models (class frequencies, unigram and bigram
counts), the floor any optimizer's curve should sit far below."""

from __future__ import annotations

import numpy as np

from experiments.run import data as data_lib


def anchors(config) -> dict[str, dict[str, float]]:
  """A trivial model's loss on the eval and report splits, fit on the training split: images, the class
  frequencies (and the majority class's error); text, unigram and bigram counts with add-one smoothing."""
  load = lambda split: data_lib.load_split(config.dataset, split, config.data_dir, -1, config.download)  # noqa: E731
  fit = load(config.train_split)
  return {split: trivial_losses(config.dataset, fit, load(split))
          for split in dict.fromkeys([config.eval_split, config.benchmark.report_split]) if split}


def trivial_losses(dataset: str, fit: data_lib.Split, test: data_lib.Split) -> dict[str, float]:
  """Mean cross-entropy (nats) of trivial models fit on ``fit`` and scored on ``test``."""
  _, classes = data_lib.DATASETS[dataset]
  counts = np.bincount(fit.labels.ravel(), minlength=classes) + 1.0
  unigram = np.log(counts / counts.sum())
  out = {"class frequencies" if dataset not in data_lib.TEXT else "unigram": float(-unigram[test.labels.ravel()].mean())}
  if dataset in data_lib.TEXT:  # each label follows its input character
    pairs = np.zeros((classes, classes)) + 1.0
    np.add.at(pairs, (fit.inputs.ravel(), fit.labels.ravel()), 1.0)
    bigram = np.log(pairs / pairs.sum(axis=1, keepdims=True))
    out["bigram"] = float(-bigram[test.inputs.ravel(), test.labels.ravel()].mean())
  else:
    out["majority class error"] = float(np.mean(test.labels != np.argmax(counts)))
  return out
