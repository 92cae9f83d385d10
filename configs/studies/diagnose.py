"""Plain SCSGD against Nesterov SGD, kernel by kernel, on the development source: experiments/studies/diagnose.py."""

import ml_collections

from configs.studies import develop


def get_config():
  config = develop.get_config()  # the development source, schedule and recipes
  config.seed = 0
  config.diagnose = ml_collections.ConfigDict(dict(
      # name -> the optimizer and its settings over its recipe
      variants={"sgd": {"name": "sgd"}, "scsgd_paper_scale": {"name": "scsgd", "normalize": "none"},
                "scsgd_normalized_embeddings": {"name": "scsgd", "normalize": "embeddings"},
                "scsgd_normalized": {"name": "scsgd", "normalize": "all"}},
      rates=(0.0316, 0.1, 0.316, 1.0),  # SGD's authors' rate 0.1, the head to head's neighbours, one more up
      # the Flax examples' layout (3-D attention kernels), 2 blocks: the step benchmark's TransformerLM
      model=dict(d=128, heads=4, layers=2, attention="mha"),
      record_every=10,
      plot_rate=0.1))
  return config
