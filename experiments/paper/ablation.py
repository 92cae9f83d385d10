"""SCSGD ablation on one config: rank, EMA rate, refresh period, row sampling, conditioner kind.

  python -m experiments.paper.ablation --config configs/paper/ablation.py --workdir workdir/ablation \
      --results_dir experiments/results/mnist_ablation --data_dir ../shared/tfds

Each variant is the config with one SCSGD setting changed, same seed (same init and batches),
trained for ``config.num_steps`` iterations; reported: test loss and error at the end and the best test
loss seen, and the training time per step against SGD's, measured in the same run.
"""

from __future__ import annotations

import os

from absl import flags
from absl import logging

from experiments.run import cli
from experiments.run import errors
from experiments.run import machine
from experiments.run import metrics
from experiments.run import report
from experiments.run import train
from experiments.run import validate

FLAGS = flags.FLAGS

# name -> (description, overrides of config.optimizer / config)
VARIANTS = {
    "sgd": ("Nesterov SGD baseline", {"optimizer.name": "sgd"}),
    "default": ("scsgd defaults (rank 32, nu 0.05, N 50, 256 rows, memory-chosen statistics, warm start)", {}),
    "rank_8": ("rank 8", {"optimizer.scsgd.rank": 8}),
    "rank_64": ("rank 64", {"optimizer.scsgd.rank": 64}),
    "ema_0.01": ("EMA rate nu = 0.01", {"optimizer.scsgd.ema_rate": 0.01}),
    "ema_0.2": ("EMA rate nu = 0.2", {"optimizer.scsgd.ema_rate": 0.2}),
    "every_10": ("refresh every 10 steps", {"optimizer.scsgd.update_every": 10}),
    "every_200": ("refresh every 200 steps", {"optimizer.scsgd.update_every": 200}),
    "rows_64": ("64 sampled rows per layer", {"max_rows": 64}),
    "rows_all": ("all rows (4,096 conv2 patches)", {"max_rows": 0}),
    "paper": ("the paper's recipe: dense EMA from C = I, no warm start", {"optimizer.scsgd.statistics": "dense", "optimizer.scsgd.warm_start": False}),
    "full": ("full C^(1/2) for every layer", {"optimizer.scsgd.conditioner": "full", "optimizer.scsgd.statistics": "dense"}),
}


def variant_configs(config, names) -> dict:
  """``{name: config with the variant's overrides}``, every one validated before any runs."""
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    raise errors.ConfigError(f"--variants: unknown variant {unknown[0]!r}; choose from {sorted(VARIANTS)}.")
  configs = {}
  for name in names:
    cfg = config.copy_and_resolve_references()
    cfg.optimizer.name = "scsgd"
    cfg.eval_every = min(cfg.eval_every, cfg.num_steps)
    for key, value in VARIANTS[name][1].items():
      target = cfg
      *parents, leaf = key.split(".")
      for p in parents:
        target = target[p]
      target[leaf] = value
    validate.validate_config(cfg)
    configs[name] = cfg
  return configs


def run(config, workdir: str, names, *, allow_config_change: bool = False) -> dict:
  results = {}
  for name, cfg in variant_configs(config, names).items():
    desc = VARIANTS[name][0]
    run_dir = os.path.join(workdir, name)
    train.train_and_evaluate(cfg, run_dir, allow_config_change=allow_config_change)
    rows = metrics.read(os.path.join(run_dir, train.METRICS_FILE))
    tests = [r for r in rows if "test_loss" in r]
    results[name] = {
        "description": desc,
        "final_test_loss": tests[-1]["test_loss"], "final_test_error": tests[-1]["test_error"],
        "best_test_loss": min(r["test_loss"] for r in tests),
        "ms_per_step": 1e3 * rows[-1]["train_time"] / rows[-1]["step"],
    }
    logging.warning("%s: %s", name, results[name])
  base = results.get("sgd", {}).get("ms_per_step")
  for r in results.values():
    r["time_per_step_vs_sgd"] = r["ms_per_step"] / base if base else None
  return results


def write(results: dict, out: str, command: str, steps: int) -> str:
  os.makedirs(out, exist_ok=True)
  m = machine.describe()
  report.write_results(out, {"steps": steps, "results": results}, command, machine=m)
  lines = report.header(f"SCSGD ablation, {steps} iterations", command, m) + [
           "Time per step counts training steps only (compile and evaluation excluded), measured in this run "
           "against SGD.\n",
           f"| variant | what | test loss @ {steps} | test error @ {steps} | best test loss | ms/step | vs SGD |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for name, r in results.items():
    ratio = f"{r['time_per_step_vs_sgd']:.2f}x" if r["time_per_step_vs_sgd"] else "-"
    lines.append(f"| {name} | {r['description']} | {r['final_test_loss']:.4f} | {100 * r['final_test_error']:.2f}% | "
                 f"{r['best_test_loss']:.4f} | {r['ms_per_step']:.1f} | {ratio} |")
  return report.write_markdown(out, lines)


def main(argv):
  del argv
  config = cli.config()
  results = run(config, FLAGS.workdir, FLAGS.variants, allow_config_change=FLAGS.allow_config_change)
  print(open(write(results, FLAGS.results_dir, cli.command_line(), config.num_steps)).read())


if __name__ == "__main__":
  cli.define_flags(workdir=True)
  flags.DEFINE_list("variants", list(VARIANTS), "Variants to run.")
  cli.run(main)
