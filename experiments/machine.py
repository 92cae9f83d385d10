"""A description of the machine a result was measured on."""

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
  }
