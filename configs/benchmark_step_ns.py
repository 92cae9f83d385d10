"""The step benchmark's two transformers with fewer Newton-Schulz steps (Polar Express's per-step
coefficients), against the five default steps: experiments/benchmark_step.py with these variants.

  python -m experiments.benchmark_step --config configs/benchmark_step_ns.py --results_dir experiments/results/step_ns
"""

from configs import benchmark_step

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): per-step coefficients of Muon's quintic
# iteration, each step's polynomial the minimax one for the interval the previous steps left; the five steps the
# nanoGPT speedrun runs (KellerJordan/modded-nanogpt, with its 2% safety factor). The first ``s`` of them are the
# greedy ``s``-step schedule: ``muon(..., ns_steps=s, ns_coeffs=POLAR_EXPRESS[:s])``.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def get_config():
  config = benchmark_step.get_config()
  config.only = "char_transformer,transformer_lm"

  keep = ("sgd", "sgd_again", "muon", "scsgd_eigen_muon")
  variants = {name: dict(config.variants[name]) for name in keep}
  variants["muon_polar3"] = {"name": "muon", "ns_steps": 3, "ns_coeffs": POLAR_EXPRESS[:3]}
  variants["scsgd_eigen_muon_polar3"] = {"name": "scsgd_eigen_muon", "muon_ns_steps": 3,
                                          "muon_ns_coeffs": POLAR_EXPRESS[:3]}
  config.variants = variants
  return config
