"""Issue 20's development task (experiments/develop.py): the head to head's char transformer on a
synthetic order-2 Markov source, so that no variant is tuned on a benchmark task's data. Short runs at
the protocol's schedule (warmup + cosine) and each optimizer's authors' settings (transformer kind)."""

import ml_collections

from configs.benchmark import common


def get_config():
  config = common.get_config()  # the protocol's schedule; config.benchmark.kind selects the recipes
  config.model = "char_transformer"
  config.benchmark.kind = "transformer"
  config.batch_size = 16
  config.num_steps = 300
  config.develop = ml_collections.ConfigDict(dict(
      optimizers=("sgd", "scsgd", "scsgd_adamw", "scsgd_graft", "adamw", "muon"),
      grid=(0.316, 1.0, 3.16),  # x each optimizer's authors' rate (peers.recipe)
      vocab=16, context=64,  # 256 contexts: learnable in a short run (65 symbols: 4,225 were not, at 300 steps)
      concentration=0.1,  # Dirichlet concentration of each context's next-symbol distribution
      source_seed=1234, heldout_windows=256))
  return config
