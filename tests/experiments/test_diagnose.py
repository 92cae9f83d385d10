"""The kernel-by-kernel diagnosis and the compile profile: what they record, on tiny runs."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import scsgd_jax
from configs import diagnose as diagnose_config
from experiments import compile_profile
from experiments import develop
from experiments import diagnose
from experiments import models
from scsgd_jax._src import fold as fold_lib
from scsgd_jax._src import transform


def test_a_diagnosis_run_records_every_kernel_and_the_scales_differ():
  config = diagnose_config.get_config()
  config.num_steps = 3
  config.diagnose.record_every = 1
  config.diagnose.model = dict(d=16, heads=2, layers=1, attention="mha")
  config.develop.heldout_windows = 4
  d = config.develop
  table = develop.markov_source(d.vocab, d.concentration, d.source_seed)
  heldout = develop.sample_windows(table, 4, d.context + 1, np.random.default_rng(0))
  runs = {label: diagnose.run(config, label, 0.1, table, heldout) for label in config.diagnose.variants}
  for r in runs.values():
    assert [row["step"] for row in r["records"]] == [0, 1, 2] and np.isfinite(r["heldout_loss"])
    assert {"embed/embedding", "head/kernel", "blocks/0/attn/query/kernel"} <= set(r["records"][0]["kernels"])
  kernel = runs["scsgd_normalized"]["records"][2]["kernels"]["head/kernel"]
  assert {"grad", "rel_step", "inverse_max", "spread", "tail_inverse"} <= set(kernel)
  assert "inverse_max" not in runs["sgd"]["records"][2]["kernels"]["head/kernel"]
  # the same run but for the scale: the conditioned steps differ once a factor is refreshed
  step = lambda label: runs[label]["records"][2]["kernels"]["head/kernel"]["rel_step"]
  assert not np.isclose(step("scsgd_normalized"), step("scsgd_paper_scale"), rtol=1e-3)


def test_compile_profile_counts_kernels_by_part_and_its_stubs_fit_the_parts():
  def f(x):
    with jax.named_scope("PART_fold"):
      y = jnp.sort(x) * 2.0
    return jnp.tanh(y) + x

  counts = compile_profile.kernels(jax.jit(f).lower(jnp.ones(8)).compile().as_text())
  assert counts["fold"] >= 1 and counts["other"] >= 1 and not counts["refresh"]
  for part, (module, name, stub) in compile_profile.PARTS.items():  # a stub takes what the part takes
    real = inspect.signature(getattr(module, name)).parameters
    stub_params = inspect.signature(stub).parameters.values()
    takes_more = any(p.kind == p.VAR_POSITIONAL for p in stub_params)
    assert takes_more or len(stub_params) >= len(real), part


@pytest.mark.parametrize("scan", [False, True])
def test_the_compile_profiles_banked_folds_compute_the_librarys_fold(scan):
  """The banked folds whose compile time the profile measures fold what the library folds (every kernel, a
  stack's slices, the embedding's ids), so the timings compare like with like."""
  model = models.CharTransformer(rngs=nnx.Rngs(0), vocab=11, d=16, heads=2, layers=2, context=8, scan=scan)
  ids = jax.random.randint(jax.random.PRNGKey(1), (4, 8), 0, 11)
  _, captured = scsgd_jax.capture_nnx(model, ids, rng=jax.random.PRNGKey(2), max_rows=16)
  params = nnx.state(model, nnx.Param)
  args = transform.arguments("test", input_axes=captured.input_axes)
  tx, plans = transform.conditioning_and_plans(args)
  kernel_plans = plans(params, captured.input_axes)
  rows = transform._checked_rows(kernel_plans, captured)
  state = tx.init(params)
  assert any(len(bank) > 1 for bank in compile_profile._banks(kernel_plans, rows))  # something is banked
  expected = fold_lib.fold(kernel_plans, rows, state.statistics, state.clipped_rows, 2.0)
  for name, fold in compile_profile.FOLDS.items():
    got = fold(kernel_plans, rows, state.statistics, state.clipped_rows, 2.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name), got, expected)
  # and on a state stacked per bank beforehand
  for paths, bank_stats, bank_rows in compile_profile.stacked_banks(kernel_plans, rows, state.statistics):
    want = compile_profile.stacked_banks(kernel_plans, rows, expected[0])
    want = next(stats for p, stats, _ in want if p == paths)
    for name, fold_bank in compile_profile.BANK_FOLDS.items():
      got, _ = fold_bank(compile_profile._member_fold(kernel_plans[paths[0]], 2.0), bank_stats, bank_rows)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name), got, want)
