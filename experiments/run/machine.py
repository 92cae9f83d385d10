"""A description of the machine a result was measured on, and of the packages installed on it."""

import importlib.metadata
import os
import platform

import jax


def describe() -> dict:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  return {
      "cpu": cpu,
      "cores": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
      "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS", "unset"),  # experiments/__init__.py
  }


def package_versions(packages) -> dict[str, str]:
  """``{package: version}`` of the installed distributions (``'not installed'`` for a missing one)."""
  out = {}
  for package in packages:
    try:
      out[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      out[package] = "not installed"
  return out
