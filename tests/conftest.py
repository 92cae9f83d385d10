import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

# Exact-oracle comparisons are made in float64 numpy; the library itself runs in float32.
jax.config.update("jax_numpy_rank_promotion", "raise")
