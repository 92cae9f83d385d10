"""Experimental variants, tested against dense oracles but not (yet) the recommended path: two-sided conditioning
(the output side from the back-propagated output rows, K-FAC's second factor sketched) grafted onto a base step's
per-layer norm, and the pieces it is built from."""

import importlib

from scsgd_jax._src.contrib.graft import FactoredRMSState as FactoredRMSState
from scsgd_jax._src.contrib.graft import GraftState as GraftState
from scsgd_jax._src.contrib.graft import scale_by_grafting as scale_by_grafting
from scsgd_jax._src.contrib.graft import scale_by_normalized_factored_rms as scale_by_normalized_factored_rms
from scsgd_jax._src.contrib.graft import scale_by_normalized_rms as scale_by_normalized_rms
from scsgd_jax._src.contrib.output import scale_by_output_conditioning as scale_by_output_conditioning
from scsgd_jax._src.contrib.two_sided import scsgd_two_sided as scsgd_two_sided
from scsgd_jax._src.output_rows import default_output_axes as default_output_axes
from scsgd_jax._src.output_rows import output_kernel_filter as output_kernel_filter

_LAZY = {"output_perturbations_linen": "scsgd_jax._src.capture_linen",
         "output_perturbations_nnx": "scsgd_jax._src.capture_nnx"}

__all__ = sorted([
    "FactoredRMSState", "GraftState", "default_output_axes", "output_kernel_filter", "scale_by_grafting",
    "scale_by_normalized_factored_rms", "scale_by_normalized_rms", "scale_by_output_conditioning", "scsgd_two_sided",
    *_LAZY,
])


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'scsgd_jax.contrib' has no attribute {name!r}")
  value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
  return value


def __dir__():
  return __all__
