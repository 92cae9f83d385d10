"""The step benchmark's two transformers with fewer Newton-Schulz steps (Polar Express's per-step
coefficients), against the five default steps: experiments/benchmark_step.py with these variants.

  python -m experiments.benchmark_step --config configs/benchmark_step_ns.py --results_dir experiments/results/step_ns
"""

from configs import benchmark_step
from experiments import peers


def get_config():
  config = benchmark_step.get_config()
  config.only = "char_transformer,transformer_lm"

  keep = ("sgd", "sgd_again", "muon", "scsgd_eigen_muon")
  variants = {name: dict(config.variants[name]) for name in keep}
  variants["muon_polar3"] = {"name": "muon", "ns_steps": 3, "ns_coeffs": peers.POLAR_EXPRESS[:3]}
  variants["scsgd_eigen_muon_polar3"] = {"name": "scsgd_eigen_muon", "muon_ns_steps": 3,
                                          "muon_ns_coeffs": peers.POLAR_EXPRESS[:3]}
  config.variants = variants
  return config
