"""The kernel-by-kernel diagnosis: what it records, on a tiny run."""

import numpy as np
import pytest

from configs.studies import diagnose as diagnose_config
from experiments.studies import develop
from experiments.studies import diagnose

# a study's slow checks: CI runs them in a step of their own when the studies' files change (.ci/run, .ci/apart)
pytestmark = pytest.mark.studies



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
