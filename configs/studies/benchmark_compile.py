"""Compile time and program size by depth: experiments/studies/benchmark_compile.py."""

import ml_collections

from configs import mnist


def get_config():
  config = ml_collections.ConfigDict()
  config.run = mnist.get_config()  # the optimizers' sub-configs every optimizer is built from (and max_rows)
  # the step benchmark's TransformerLM (the Flax examples' layout, unscanned) at 2 and 6 blocks, its batch
  config.models = ("transformer_lm", "transformer_lm_6")
  config.model = {"shape": (64,), "classes": 65, "batch": 16, "kind": "transformer"}
  # scsgd+apart: scsgd with its refreshes apart from the step (its rows add the refresh program's compile)
  config.optimizers = ("sgd", "adamw", "muon", "scsgd", "scsgd+apart", "scsgd_adamw", "scsgd_eigen",
                       "scsgd_eigen_muon", "scsgd_two_sided")
  # the optimizer each one's added kernels are counted over (scsgd_eigen's base: Adam's update, as AdamW's)
  config.bases = {"scsgd": "sgd", "scsgd_adamw": "adamw", "scsgd_eigen": "adamw", "scsgd_eigen_muon": "muon",
                  "scsgd_two_sided": "sgd"}
  config.repeats = 3  # fresh processes per optimizer and model; medians reported
  config.child = ""  # set by the study itself: 'model:optimizer' measured in this process
  config.results_file = "benchmark_compile_depth.json"
  return config
