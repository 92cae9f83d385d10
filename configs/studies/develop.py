"""The development task (experiments/studies/develop.py): the head to head's char transformer on a
synthetic order-2 Markov source, so that no variant is tuned on a benchmark task's data. Short runs at
the protocol's schedule (warmup + cosine), tuning (rate grid grown past a winning end, 3 seeds at the
chosen rate: configs/head_to_head/common.py) and each optimizer's authors' settings (transformer kind)."""

import ml_collections

from configs.head_to_head import common


def get_config():
  config = common.task()  # the protocol's schedule; config.benchmark.kind selects the recipes
  config.model = "char_transformer"
  config.benchmark.kind = "transformer"
  config.batch_size = 16
  config.num_steps = 300
  config.develop = ml_collections.ConfigDict(dict(
      optimizers=("scsgd_two_sided", "scsgd_two_sided_lean", "scsgd_graft", "scsgd_muon", "muon", "adamw", "scsgd_adamw", "scsgd", "sgd"),
      vocab=16, context=64,  # 256 contexts: learnable in a short run (65 symbols: 4,225 were not, at 300 steps)
      concentration=0.1,  # Dirichlet concentration of each context's next-symbol distribution
      source_seed=1234, heldout_windows=256,
      # a probe's settings on top of each optimizer's recipe, e.g. "update_every=10,ema_rate=0.2" (run it
      # with --config.develop.optimizers=scsgd_two_sided and a results_dir of its own)
      settings=""))
  return config
