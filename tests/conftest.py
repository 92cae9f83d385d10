import atexit
import gc
import os
import shutil
import tempfile

from tests import helpers

os.environ.setdefault("XLA_FLAGS", helpers.xla_flags(1))

# Many tests build the same programs anew (a new optimizer, a new train step), here, in the other xdist worker and in
# the processes tests start (a CLI run, a multi-process run): one compilation cache for the test run, made by the
# process pytest was started as (xdist's workers and the processes tests start inherit it through the environment),
# compiles each once. Removed when that process ends; never shared between runs. Without a size limit JAX's cache
# takes no lock (an entry read while another process writes it is a miss: JAX compiles it again).
# (The same folder holds the reference runs tests share across workers: helpers.shared_run.)
if helpers.RUN_DIR not in os.environ:
  os.environ[helpers.RUN_DIR] = tempfile.mkdtemp(prefix="scsgd-jax-tests-")
  atexit.register(shutil.rmtree, os.environ[helpers.RUN_DIR], ignore_errors=True)
_CACHE = {"jax_compilation_cache_dir": os.path.join(os.environ[helpers.RUN_DIR], "compilation_cache"),
          "jax_persistent_cache_min_compile_time_secs": 0, "jax_compilation_cache_max_size": -1}
os.environ.update({name.upper(): str(value) for name, value in _CACHE.items()})

import jax  # noqa: E402
import pytest  # noqa: E402

for _name, _value in _CACHE.items():  # in case JAX started before this file (a doctest collected first)
  jax.config.update(_name, _value)

# Exact-oracle comparisons are made in float64 numpy; the library itself runs in float32.
jax.config.update("jax_numpy_rank_promotion", "raise")
# Oracles compare float32 results with float64 numpy at 1e-4..1e-6: on GPUs/TPUs the default float32
# matmul precision is TF32/bf16-pass (relative error ~1e-3), so the tests ask for full precision.
jax.config.update("jax_default_matmul_precision", "highest")


# Every program XLA:CPU loads maps its code (at the tests' lowest optimization level, unfused: a thousand mappings or
# more for an optimizer's step), and the jit caches keep them loaded: a test process that compiles a few dozen such
# programs would pass Linux's limit on a process's mappings (vm.max_map_count, 65530), and the next compile crashes.
# After any test that leaves the process past half the limit, the caches are dropped (recompiles come from the
# persistent cache above).
_MAPS = "/proc/self/maps"


@pytest.fixture(autouse=True)
def _bounded_code_mappings():
  yield
  if os.path.exists(_MAPS):
    with open(_MAPS) as f:
      if sum(1 for _ in f) > 30000:
        jax.clear_caches()
        gc.collect()
