"""Where the step rule's row spends its step on the step benchmark's TransformerLM, by source line, beside
Muon's with the same three Newton-Schulz steps and SGD's: experiments/studies/profile_step.py.

  OPENBLAS_NUM_THREADS=1 python -m experiments.studies.profile_step --config configs/studies/profile_step.py --results_dir experiments/results/step_profile
"""

import ml_collections

from configs.studies import benchmark_step


def get_config():
  config = benchmark_step.get_config()
  config.models = ml_collections.ConfigDict({"transformer_lm": dict(config.models.transformer_lm)})
  config.variants = ml_collections.ConfigDict({
      "sgd": {"name": "sgd"},
      "muon_polar3": {"name": "muon_polar3"},
      "scsgd_eigen_muon_polar3": {"name": "scsgd_eigen_muon_polar3"},
  })
  config.warmup = 60  # steps before the timed ones: compilation and the first refreshes
  config.steps = 100  # steps timed untraced, then traced (two refresh windows)
  config.extra_over = ml_collections.ConfigDict({"muon_polar3": "sgd", "scsgd_eigen_muon_polar3": "muon_polar3"})
  return config
