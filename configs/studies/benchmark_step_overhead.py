"""Where the three-step eigenbasis row's step goes on the step benchmark's TransformerLM: the row as the tables
run it, beside itself at a quarter of the sketch's rank (the products' flops), without folds or refreshes (the
statistics' and the conditioner's upkeep), and the same blocks scanned (one nnx.scan over a stack of blocks: each
kernel's statistics, factor, moments and conditionals held once per stack instead of once per layer).

  OPENBLAS_NUM_THREADS=1 python -m experiments.studies.benchmark_step --config configs/studies/benchmark_step_overhead.py --results_dir experiments/results/step_overhead
"""

from configs.studies import benchmark_step


def get_config():
  config = benchmark_step.get_config()
  config.only = "transformer_lm,transformer_lm_scan_2"
  config.models.transformer_lm_scan_2 = dict(config.compile_models.transformer_lm_scan_2)
  three = {"name": "scsgd_eigen_muon_polar3"}
  config.variants = {
      "sgd": {"name": "sgd"},
      "sgd_again": {"name": "sgd"},
      "muon_polar3": {"name": "muon_polar3"},
      "scsgd_eigen_muon_polar3": three,
      "eigen3_rank8": {**three, "rank": 8},  # the rotations' products at a quarter of the flops
      # no fold and no refresh after the first: the statistics' and the factor's upkeep left out
      "eigen3_no_upkeep": {**three, "statistics_every": 10**9, "update_every": 10**6},
  }
  return config
