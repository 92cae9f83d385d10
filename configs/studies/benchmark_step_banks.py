"""The step on the banked state (the conditioning's and the eigenbasis' a bank at a time): LeNet and the character
transformer, SCSGD and the eigenbasis in front of Muon (5 default and 3 Polar Express Newton-Schulz steps) against
Nesterov SGD's step, interleaved: experiments/studies/benchmark_step.py with these variants.

  OPENBLAS_NUM_THREADS=1 python -m experiments.studies.benchmark_step --config configs/studies/benchmark_step_banks.py --results_dir experiments/results/step_banks
"""

from configs.studies import benchmark_step


def get_config():
  config = benchmark_step.get_config()
  config.only = "lenet,char_transformer"
  keep = ("sgd", "sgd_again", "scsgd", "muon", "scsgd_eigen_muon")
  variants = {name: dict(config.variants[name]) for name in keep}
  variants["muon_polar3"] = {"name": "muon_polar3"}  # three Newton-Schulz steps, Polar Express's coefficients
  variants["scsgd_eigen_muon_polar3"] = {"name": "scsgd_eigen_muon_polar3"}
  config.variants = variants
  return config
