"""The step profiler: each executed XLA kernel's time lands on the line of Python that emitted it; the step
benchmark runs each variant with its registry recipe for the model's kind."""

import inspect
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.studies import benchmark_step
from experiments.studies import profile_step

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies



def _two_products(a, b):
  c = a @ b  # the first product
  return jnp.tanh(c) @ b  # the second


def test_kernels_are_attributed_to_the_lines_that_emitted_them():
  fn = jax.jit(_two_products)
  a = b = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)
  frames = profile_step.stack_frames(fn.lower(a, b).compile().as_text())
  fn(a, b).block_until_ready()
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(4):
        fn(a, b).block_until_ready()
    times = profile_step.kernel_times(d, 4)
  out = profile_step.attribute(times, frames)
  here, first = "tests/experiments/test_profile_step.py", inspect.getsourcelines(_two_products)[1] + 1
  lines = {k for k in out["by_line"] if k.startswith(here)}
  assert lines == {f"{here}:{first} (_two_products)", f"{here}:{first + 1} (_two_products)"}  # both, nothing else
  assert out["by_file"][here]["ms"] > 0
  assert np.isclose(out["kernel_ms_per_step"], sum(v["ms"] for v in out["by_file"].values()), rtol=1e-3)


def test_extra_over_is_each_files_difference():
  base = {"by_file": {"a.py": {"ms": 1.0, "kernels": 2.0}}}
  other = {"by_file": {"a.py": {"ms": 1.5, "kernels": 2.0}, "b.py": {"ms": 3.0, "kernels": 4.0}}}
  assert profile_step.extra_over(base, other) == {"b.py": {"ms": 3.0, "kernels": 4.0},
                                                  "a.py": {"ms": 0.5, "kernels": 0.0}}


def _summaries(state):
  return [s.summary() for s in jax.tree.leaves(state[2], is_leaf=lambda x: hasattr(x, "summary"))
          if hasattr(s, "summary")]


def test_step_benchmark_variants_run_their_recipe_for_the_models_kind():
  from configs.studies import benchmark_step as config_module

  config = config_module.get_config()
  config.variants = {"scsgd_eigen_muon_polar3": {"name": "scsgd_eigen_muon_polar3"}}
  as_lenet = benchmark_step._variants(config, "transformer_lm", (16,), 11)["scsgd_eigen_muon_polar3"][1]
  as_transformer = benchmark_step._variants(config, "transformer_lm", (16,), 11, "transformer")
  as_transformer = as_transformer["scsgd_eigen_muon_polar3"][1]
  # Muon's recipe for a transformer leaves the head to its AdamW part (LeNet's names its own head, 'dense2')
  assert "excluded by kernel_filter" in _summaries(as_transformer)[0]["head/kernel"]
  assert "excluded" not in _summaries(as_lenet)[0]["head/kernel"]
  assert _summaries(as_transformer)[0]["blocks/0/fc1/kernel"] == _summaries(as_lenet)[0]["blocks/0/fc1/kernel"]
