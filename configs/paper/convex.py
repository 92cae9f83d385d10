"""The convex case: multiclass logistic regression on MNIST pixels with every conditioner of the paper."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = "mnist"
  config.data_dir = ""  # "" -> $TFDS_DATA_DIR or tfds' default
  config.download = True
  config.max_train_examples = -1  # all 60k
  config.bias_coordinate = True  # fold the bias in as a constant-1 input coordinate (n = 785)
  config.seed = 0
  config.ranks = (5, 10, 20, 50, 100)
  config.oversample = 10  # r = k + oversample in Algorithm 1
  # Lemma 1's setting: constant step, averaged iterate; each method's best step from this grid.
  config.step_sizes = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
  # (batch size, steps) settings: single-example steps and mini-batches of 64.
  config.settings = ((1, 30_000), (64, 3_000))
  config.num_evals = 60  # evaluation points of L(W_bar) per run (log-spaced)
  config.epsilons = (0.2, 0.1, 0.05)  # sub-optimality levels whose first iteration is reported
  config.lbfgs_steps = 1500  # full-batch solve for L(W*)
  config.lemma_seeds = 20  # seeds per k for the Lemma 3 / Lemma 4 ratios
  config.timing_dims = (128, 256, 512, 1024, 2048)  # n of random ReLU features for Algorithm 1 vs eigh
  config.timing_examples = 10_000
  config.timing_rank = 20
  return config
