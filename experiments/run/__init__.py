"""The run path: one training run from a config (main, train, step, data, models, checkpoints, workdir, metrics, devices, supervise, validate, cli, errors, machine, report)."""
