"""Optimizer-state memory by layer width: experiments/studies/benchmark_scaling.py."""

import ml_collections

from configs import mnist


def get_config():
  config = ml_collections.ConfigDict()
  config.run = mnist.get_config()  # the optimizers' sub-configs every variant is built from
  config.dims = (256, 1024, 4096, 16384, 65536)  # input dimensions n of the Dense layer (n, 1024)
  config.variants = ml_collections.ConfigDict({
      "sgd": {"name": "sgd"},
      "adam": {"name": "adam"},
      "scsgd_dense": {"name": "scsgd", "statistics": "dense", "conditioner": "sketched"},
      "scsgd_streaming": {"name": "scsgd", "statistics": "streaming"},
      "scsgd": {"name": "scsgd"},
  })
  # the benchmark tasks' models, and the rows whose state the memory rule bounds (beside Muon's, for scale)
  config.tasks = ("configs.head_to_head.mnist", "configs.head_to_head.convex", "configs.head_to_head.shakespeare",
                  "configs.head_to_head.shakespeare_large")
  config.task_rows = ("muon", "scsgd", "scsgd_adamw", "scsgd_muon", "scsgd_two_sided_lean", "scsgd_eigen",
                      "scsgd_eigen_muon")
  return config
