"""Step cost on an accelerator: configs/studies/benchmark_step.py on its two transformers, with the variants a user
chooses among (SGD and its A/A control, AdamW, Muon, SCSGD, Adam in the sketched eigenbasis, that scaling in
front of Muon's orthogonalization), small enough for a short loan of one GPU."""

import ml_collections

from configs.studies import benchmark_step

VARIANTS = ("sgd", "sgd_again", "adamw", "muon", "scsgd", "scsgd_eigen", "scsgd_eigen_muon")


def get_config():
  config = benchmark_step.get_config()
  config.variants = ml_collections.ConfigDict({k: config.variants[k].to_dict() for k in VARIANTS})
  config.only = "char_transformer,transformer_lm"
  return config
