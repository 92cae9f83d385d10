"""The step benchmark's two transformers with fewer Newton-Schulz steps (Polar Express's per-step
coefficients, experiments/optim/peers.py), against the five default steps: experiments/studies/benchmark_step.py with these
variants.

  python -m experiments.studies.benchmark_step --config configs/studies/benchmark_step_ns.py --results_dir experiments/results/step_ns
"""

from configs.studies import benchmark_step


def get_config():
  config = benchmark_step.get_config()
  config.only = "char_transformer,transformer_lm"

  keep = ("sgd", "sgd_again", "muon", "scsgd_eigen_muon")
  variants = {name: dict(config.variants[name]) for name in keep}
  # the registry's rows with three Newton-Schulz steps at Polar Express's coefficients (experiments/optim/peers.py)
  variants["muon_polar3"] = {"name": "muon_polar3"}
  variants["scsgd_eigen_muon_polar3"] = {"name": "scsgd_eigen_muon_polar3"}
  config.variants = variants
  return config
