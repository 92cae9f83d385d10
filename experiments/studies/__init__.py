"""One-off studies: the development task, diagnostics, the step and compile benchmarks, the step profile, memory scaling."""
