import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

# Exact-oracle comparisons are made in float64 numpy; the library itself runs in float32.
jax.config.update("jax_numpy_rank_promotion", "raise")
# Oracles compare float32 results with float64 numpy at 1e-4..1e-6: on GPUs/TPUs the default float32
# matmul precision is TF32/bf16-pass (relative error ~1e-3), so the tests ask for full precision.
jax.config.update("jax_default_matmul_precision", "highest")
