"""Step cost of SCSGD against Nesterov SGD, AdamW and Muon: experiments/studies/benchmark_step.py."""

import ml_collections

from configs import mnist


def get_config():
  config = ml_collections.ConfigDict()
  # The experiments' settings every variant is built from (learning rates, the capture's max_rows, the
  # optimizers' sub-configs); the learning rate does not change a step's cost.
  config.run = mnist.get_config()
  config.windows = 8  # refresh windows timed per pass, after one of warm-up
  config.order_seed = 0  # each round of steps runs SGD and the variant in a random order drawn from this seed
  # name -> the optimizer and its sub-config values; 'capture': 'rows' computes the captured rows unused; 'share':
  # False plans every kernel its own statistics (the layouts read without a batch)
  config.variants = ml_collections.ConfigDict({
      "sgd": {"name": "sgd"},
      "sgd_again": {"name": "sgd"},  # the A/A control: SGD's step again, its ratio to SGD's is the noise
      "adamw": {"name": "adamw"},
      "muon": {"name": "muon"},
      "scsgd": {"name": "scsgd"},
      "scsgd_muon": {"name": "scsgd_muon"},
      "scsgd_two_sided": {"name": "scsgd_two_sided"},  # two-sided conditioning, grafted
      "scsgd_two_sided_lean": {"name": "scsgd_two_sided_lean"},  # at Adam's memory (same rule)
      "scsgd_eigen": {"name": "scsgd_eigen"},  # Adam in the sketched eigenbasis
      "scsgd_eigen_muon": {"name": "scsgd_eigen_muon"},  # that scaling in front of Muon's orthogonalization
      "sgd_capture": {"name": "sgd", "capture": "rows"},  # phases: the capture's cost
      "scsgd_no_fold": {"name": "scsgd", "statistics_every": 10**9},  # phases: all but the fold
      "scsgd_no_stagger": {"name": "scsgd", "stagger": False},  # every kernel refreshing at the same step
      "scsgd_unshared": {"name": "scsgd", "share": False},  # the attention's query, key, value each their own C
  })
  # name -> one example's shape, classes (text: vocabulary) and batch; 'kind': every variant runs its registry
  # recipe for that model kind, as the head to head's tables do (none: the run config's, LeNet's)
  config.models = ml_collections.ConfigDict({
      "lenet": {"shape": (28, 28, 1), "classes": 10, "batch": 64},
      "char_transformer": {"shape": (64,), "classes": 65, "batch": 16, "kind": "transformer"},
      "transformer_lm": {"shape": (64,), "classes": 65, "batch": 16, "kind": "transformer"},
      "small_resnet": {"shape": (16, 16, 3), "classes": 10, "batch": 32},
      "dense_256": {"shape": (256,), "classes": 1024, "batch": 256},
      "dense_1024": {"shape": (1024,), "classes": 1024, "batch": 256},
      "dense_2048": {"shape": (2048,), "classes": 1024, "batch": 256},
  })
  config.only = ""  # comma-separated models to run ("": all)
  config.compile_only = False  # True: each variant's first-step lowering + compilation (benchmark_compile.json)
  # measured for compile time only, besides config.models: the TransformerLM at 6 blocks (the cost per layer),
  # and at 2 and 6 blocks scanned (one nnx.scan over a stack of blocks, as large Flax transformers run them)
  lm = {"shape": (64,), "classes": 65, "batch": 16, "kind": "transformer"}
  config.compile_models = ml_collections.ConfigDict(
      {"transformer_lm_6": lm, "transformer_lm_scan_2": lm, "transformer_lm_scan_6": lm})
  return config
