"""The workload zoo: every workload trains a few steps under the library's row (finite, falling), every row is
linear in its rate (the one-compile grid's premise, against the update at rate 1), and the protocol and the report
do what the table says (a scripted cell as the oracle)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.zoo import probe, report, rows as rows_lib, run, workloads as wl

SHARED_TFDS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "tfds")
needs_data = pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_TFDS, "mnist")), reason="needs ../shared/tfds")


@needs_data
@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_every_workload_trains_a_few_steps_finite_and_falling(name):
  from experiments.zoo import train
  cell = train.Cell(name, "scsgd", SHARED_TFDS)
  # a quarter of the centre, below every edge; 40 steps: the ViT's zero-initialized head spikes its loss first
  out = cell.run(rows_lib.row("scsgd").centre / 4, seed=0, steps=40)
  losses = out["train_losses"]
  assert not out["diverged"] and len(losses) == 40 and all(math.isfinite(l) for l in losses)
  assert np.mean(losses[-5:]) < losses[0], losses
  assert math.isfinite(out["final_loss"])


def _grads_and_inputs(bound, params, extra, x, y):
  (_, (inputs, _)), grads = jax.value_and_grad(bound.loss, has_aux=True)(params, extra, x, y, jax.random.PRNGKey(0),
                                                                          True)
  return grads, inputs


def _small_mlp():
  w = wl.workload("relu_mlp")._replace(make=lambda rngs: __import__("experiments.zoo.models_nnx").zoo.models_nnx
                                       .ReluMLP(inputs=12, hidden=48, rngs=rngs))
  bound = wl.Bound(w, jnp.zeros((4, 12)))
  params, extra = bound.start(0)
  rng = np.random.default_rng(0)
  x, y = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32), jnp.asarray(rng.integers(0, 10, 16))
  return w, bound, params, extra, x, y


@pytest.mark.parametrize("name", sorted(n for n, r in rows_lib.ROWS.items() if r.linear))
def test_every_linear_row_is_linear_in_its_rate(name):
  w, bound, params, extra, x, y = _small_mlp()
  tx = rows_lib.build(name, w, bound.input_axes(x))
  grads, inputs = _grads_and_inputs(bound, params, extra, x, y)
  kwargs = {"layer_inputs": inputs} if name.startswith("scsgd") else {}
  state = tx.init(params)
  for _ in range(25):  # past the warmup: the schedule is not zero
    state = tx.update(grads, state, params, rate=1.0, **kwargs)[1]
  one = tx.update(grads, state, params, rate=1.0, **kwargs)[0]
  three = tx.update(grads, state, params, rate=3.0, **kwargs)[0]
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(three), strict=True):
    np.testing.assert_allclose(np.asarray(b), 3.0 * np.asarray(a), rtol=1e-5, atol=1e-8)
  assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(one))


@pytest.mark.parametrize("name", sorted(n for n, r in rows_lib.ROWS.items() if not r.linear))
def test_a_row_with_a_step_bound_is_built_at_its_rate_and_its_bound_reads_the_step_taken(name):
  w, bound, params, extra, x, y = _small_mlp()
  grads, inputs = _grads_and_inputs(bound, params, extra, x, y)
  steps = {}
  for rate in (1e-4, 2e-4, 1e3):
    tx = rows_lib.build(name, w, bound.input_axes(x), rate)
    state = tx.init(params)
    for _ in range(25):  # past the warmup
      updates, state = tx.update(grads, state, params, layer_inputs=inputs)
    steps[rate] = updates
  for a, b in zip(jax.tree.leaves(steps[1e-4]), jax.tree.leaves(steps[2e-4])):  # the bound inactive: linear
    np.testing.assert_allclose(np.asarray(b), 2.0 * np.asarray(a), rtol=1e-5, atol=1e-12)
  ratio = [float(jnp.linalg.norm(u) / jnp.maximum(jnp.linalg.norm(p), np.sqrt(p.shape[-1])))  # its floor
           for u, p in zip(jax.tree.leaves(steps[1e3]), jax.tree.leaves(params)) if u.ndim == 2]
  np.testing.assert_allclose(ratio, 0.02, rtol=1e-5)  # at a huge rate every kernel's step is the bound's


class ScriptedCell:
  """A cell whose final loss is ``(log2(rate / best))^2`` (+ the seed / 100), diverging from ``edge`` up."""

  def __init__(self, best, edge, row="scsgd"):
    self.best, self.edge, self.row, self.calls = best, edge, row, []

  def run(self, rate, seed):
    self.calls.append((rate, seed))
    diverged = rate >= self.edge
    final = None if diverged else math.log2(rate / self.best) ** 2 + seed / 100
    return {"rate": rate, "seed": seed, "final_loss": final, "diverged": diverged, "first_loss": 4.0,
            "curve": [] if diverged else [[10, 5.0], [20, final]],
            "train_losses": [4.0, math.nan] if diverged else [4.0, 3.0]}


def test_the_grid_widens_while_the_best_rate_sits_on_its_edge_and_twice_the_rate_is_tried():
  centre = rows_lib.row("scsgd").centre
  cell = ScriptedCell(best=centre * 4, edge=centre * 16)
  out = run.protocol(cell)
  assert [g["rate"] for g in out["grid"]] == [centre * 2.0 ** e for e in (-1, 0, 1, 2, 3)]
  assert out["chosen_rate"] == centre * 4
  assert [s["seed"] for s in out["seeds"]] == list(run.SEEDS) and out["double"]["rate"] == centre * 8
  assert (centre * 8, 0) in cell.calls and cell.calls.count((centre * 8, 0)) == 1  # the grid's run, not again


def test_the_grid_stops_at_a_diverged_edge_and_twice_a_fragile_rate_is_recorded_diverged():
  centre = rows_lib.row("scsgd").centre
  out = run.protocol(ScriptedCell(best=centre * 8, edge=centre * 2))
  assert out["chosen_rate"] == centre and out["double"]["diverged"]


def test_the_divergence_rule_reads_a_smoothed_training_loss_and_the_final_held_out_loss():
  from experiments.zoo.train import diverged_by
  calm = [4.0] * 5 + [2.0] * 20
  assert not diverged_by(calm + [9.0] + [2.0] * 3, [])  # one batch's spike: noise
  assert diverged_by(calm + [9.0] * 10, [])  # ten steps a nat above the start
  assert diverged_by(calm + [math.inf], [])
  assert not diverged_by(calm, [[20, 4.5]]) and diverged_by(calm, [[20, 5.5]])  # the final held-out loss


def test_the_report_refuses_a_run_another_rule_decided(tmp_path):
  record = {"workload": "w", "row": "r", "protocol": run.protocol(ScriptedCell(0.1, 0.4))}
  record["protocol"]["grid"][0]["diverged"] = True  # a finished, falling run marked diverged
  with pytest.raises(ValueError, match="decided by another divergence rule"):
    report.check_rule(record)


def test_the_report_has_the_issue_schema_and_says_fragile_rows(tmp_path):
  for row, (best, edge) in {"sgd": (0.1, 0.4), "scsgd": (0.1, 0.2)}.items():
    record = {"workload": "relu_mlp", "row": row, "source": "s", "workload_settings": {}, "commit": "c",
              "dirty": False, "versions": {}, "machine": "m", "protocol": run.protocol(ScriptedCell(best, edge, row))}
    (tmp_path / "w" / "relu_mlp").mkdir(parents=True, exist_ok=True)
    (tmp_path / "w" / "relu_mlp" / f"{row}.json").write_text(json.dumps(record))
  written = report.write(tmp_path / "w", tmp_path / "r")
  rows = json.loads((tmp_path / "r" / "results.json").read_text())["workloads"]["relu_mlp"]["rows"]
  assert set(rows["sgd"]) >= {"learning_rate", "final_loss_median", "final_loss_range", "seeds", "double_rate_stable"}
  assert rows["sgd"]["double_rate_stable"] and not rows["scsgd"]["double_rate_stable"]
  assert rows["sgd"]["final_loss_median"] == pytest.approx(0.02) and rows["sgd"]["seeds"] == len(run.SEEDS)
  assert rows["sgd"]["final_losses"] == pytest.approx([s / 100 for s in run.SEEDS])
  assert "(2x: no)" in (tmp_path / "r" / "README.md").read_text() and written["workloads"]


def test_a_close_pair_is_read_seed_by_seed():
  base = {"final_losses": [0.10, 0.20, 0.30, 0.40, 0.50], "final_loss_median": 0.30, "final_loss_range": [0.1, 0.5]}
  row = {"final_losses": [0.11, 0.19, 0.32, None, 0.45], "final_loss_median": 0.32, "final_loss_range": [0.11, 0.45]}
  assert report.paired(row, base) == (2, 5, pytest.approx(0.01))  # a diverged seed: an infinite loss, a loss
  out = {"workloads": {"w": {"rows": {"scsgd": row, "sgd": base}}}}
  assert "| w | scsgd vs sgd | 2 of 5 | +0.010 | 0.400 |" in report._paired(out)
  far = dict(row, final_loss_median=0.9)  # medians further apart than the spread: not a close pair
  assert report._paired({"workloads": {"w": {"rows": {"scsgd": far, "sgd": base}}}}) == []


def test_a_probe_of_the_eigenbasis_row_is_read_seed_by_seed_against_muon(tmp_path):
  """A probe record in the results dir becomes a row of the probes' table: its median, and its seeds paired with
  Muon's (a diverged seed: an infinite loss)."""
  muon = {"final_losses": [0.10, 0.20, 0.30, 0.40, 0.50]}
  runs = [{"seed": s, "diverged": f is None, "final_loss": f} for s, f in enumerate([0.12, 0.18, 0.30, 0.36, None])]
  (tmp_path / "probes_eigen_muon_w.json").write_text(json.dumps(
      {"command": "python -m experiments.zoo.probe --workload w", "workload": "w", "rate": 0.02, "commit": "c",
       "variants": {"exact_basis": runs}}))
  probes = [report._probe(json.loads((tmp_path / "probes_eigen_muon_w.json").read_text()),
                         *report.PROBED["probes_eigen_muon_"])]
  lines = report._probes({"workloads": {"w": {"rows": {"muon": muon}}}, "probes": probes})
  # differences +0.02, -0.02, 0, -0.04, inf: 3 at or below, median 0; the median of the four finite losses 0.24
  assert "| w | 0.02 | exact_basis | 0.240 | +0.000 | 3 of 5 |" in lines
  assert lines[-1] == "Rebuild: `python -m experiments.zoo.probe --workload w`"


def test_the_report_reads_each_probed_row_against_its_own_base(tmp_path, monkeypatch):
  """scsgd's probes (``probes_scsgd_*``) pair with SGD's runs, the eigenbasis row's with Muon's: a table each."""
  monkeypatch.setattr(report, "table", lambda out: "")  # the cells' tables need whole rows; the probes' alone here
  rows = {"muon": {"final_losses": [0.1, 0.2, 0.3]}, "sgd": {"final_losses": [0.5, 0.5, 0.5]}}
  (tmp_path / "results.json").write_text(json.dumps({"workloads": {"w": {"settings": {}, "rows": {}}}}))
  for prefix in report.PROBED:
    runs = [{"seed": s, "diverged": False, "final_loss": 0.4} for s in range(3)]
    (tmp_path / f"{prefix}w.json").write_text(json.dumps(
        {"command": f"{prefix} probe", "workload": "w", "rate": 0.1, "commit": "c", "variants": {"defaults": runs}}))
  out = report.write(tmp_path / "no_cells", tmp_path)
  assert [(p["row"], p["base"]) for p in out["probes"]] == list(report.PROBED.values())
  out["workloads"]["w"]["rows"] = rows
  lines = report._probes(out)
  assert "| w | 0.1 | defaults | 0.400 | +0.200 | 0 of 3 |" in lines  # against Muon's 0.1, 0.2, 0.3
  assert "| w | 0.1 | defaults | 0.400 | -0.100 | 3 of 3 |" in lines  # against SGD's 0.5
  assert [line for line in lines if line.startswith("## ")] == [
      "## Where `scsgd_eigen_muon` loses to `muon`: one part changed at a time (5 seeds, paired with `muon`'s runs)",
      "## Where `scsgd` loses to `sgd`: one part changed at a time (5 seeds, paired with `sgd`'s runs)"]


@pytest.mark.parametrize("row,variant", [("scsgd_eigen_muon", "unbounded"), ("scsgd", "exact_basis")])
def test_the_probe_refuses_a_variant_its_row_has_not_before_any_work(row, variant, tmp_path, capsys):
  with pytest.raises(SystemExit):
    probe.main(["--workload", "relu_mlp", "--rate", "0.02", "--row", row, "--variants", f"defaults,{variant}",
                "--out", str(tmp_path / "p.json")])
  assert f"['{variant}'] are no variants of --row {row}" in capsys.readouterr().err
  assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_without_input_axes_a_zoo_model_is_planned_as_the_recipe_plans_it_or_init_says_so(name):
  import warnings
  import scsgd_jax as sk
  w = wl.workload(name)
  bound = wl.Bound(w, wl.example(w))
  params = bound.start(0)[0]
  recipe = sk.plans(sk.scsgd(0.1, sk.Conditioning(input_axes=bound.input_axes(wl.example(w)))).init(params))
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    plain = sk.plans(sk.scsgd(0.1).init(params))
  ours = [str(s.message) for s in said if str(s.message).startswith("scsgd_jax: no input_axes given")]
  # a tied table the recipe marks plain at init is left plain by the capture at the first update without it
  tied = [p for p, line in recipe.items() if "tied table" in line]
  plain = {p: line for p, line in plain.items() if p not in tied}
  recipe = {p: line for p, line in recipe.items() if p not in tied}
  if plain != recipe:
    assert len(ours) >= 1 and all("input_axes_nnx(model, x)" in m for m in ours)
  else:
    assert ours == []


RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results", "zoo")


def test_the_committed_zoo_holds_every_workload_and_row_and_its_table_is_the_records():
  with open(os.path.join(RESULTS, "results.json")) as f:
    out = json.load(f)
  assert set(out["workloads"]) == set(wl.WORKLOADS)
  for name, entry in out["workloads"].items():
    assert set(entry["rows"]) == set(rows_lib.ROWS), name
    for row in entry["rows"].values():
      assert set(row) >= {"learning_rate", "final_loss_median", "final_loss_range", "seeds", "double_rate_stable",
                          "commit", "versions", "machine"}
      assert row.get("refused") or row["seeds"] in (3, 5)
  # the rows re-run with 5 seeds under scsgd's step bound: scsgd's and scsgd_no_axes' from one commit, sgd's from
  # that one or two before it that differ from it in the bound's code alone (which sgd does not run); the rows kept
  # from before come from the commits the earlier table named, or from the one the close pairs' 5 seeds ran at
  rerun = [e["rows"][r] for e in out["workloads"].values() for r in ("sgd", "scsgd", "scsgd_no_axes")]
  assert all(row["seeds"] == 5 for row in rerun)
  assert len({e["rows"][r]["commit"] for e in out["workloads"].values() for r in ("scsgd", "scsgd_no_axes")}) == 1
  assert len({row["commit"] for row in rerun}) <= 3
  assert len({row["commit"] for e in out["workloads"].values() for row in e["rows"].values()}) <= 9
  with open(os.path.join(RESULTS, "README.md")) as f:
    assert f.read() == report.table(out)
