"""The state sharded like the parameters on 8 host CPU devices: experiments/studies/benchmark_sharding.py."""

import ml_collections

from configs import mnist


def get_config():
  config = ml_collections.ConfigDict()
  config.run = mnist.get_config()  # the optimizers' sub-configs every optimizer is built from
  config.d, config.hidden, config.blocks, config.classes = 256, 1024, 4, 16  # a 4-block MLP, n = 256 and 1024
  config.batch = 64
  config.steps = 20
  # each optimizer at its registry rate (its authors') times this, constant: small enough that no run diverges,
  # so the sharded run's difference from one device's is rounding, not chaos
  config.rate_scale = 0.1
  config.optimizers = ("sgd", "adamw", "muon", "scsgd", "scsgd_adamw", "scsgd_eigen", "scsgd_eigen_muon",
                       "scsgd_two_sided")
  # refreshes every 5 steps (the warm start's at 1, 2, 4 besides), so 20 steps refresh several times
  config.settings = ml_collections.ConfigDict({name: {"update_every": 5} for name in config.optimizers
                                               if name.startswith("scsgd")})
  # 2: the same on 2 processes x 4 host devices (into benchmark_sharding_2x4.json); process_id and port are the
  # study's own, set for the processes it starts
  config.processes = 1
  config.process_id = -1
  config.port = 0
  return config
