"""scsgd-jax: Faster SGD Using Sketched Conditioning (Gonen & Shalev-Shwartz, 2015) for JAX, Optax and Flax.

The top level holds the optimizers, their transformations and state types, the capture helpers and diagnostics.
:mod:`scsgd_jax.sketch` holds the pure sketching functions and the statistics; :mod:`scsgd_jax.contrib` the
experimental variants (two-sided conditioning, grafting). The optax core imports without Flax: the capture
helpers (and :mod:`scsgd_jax.contrib`'s output capture) load Flax when first used.
"""

import importlib

from scsgd_jax._src.alias import scsgd as scsgd
from scsgd_jax._src.apart import refresh_conditioners as refresh_conditioners
from scsgd_jax._src.alias import scsgd_eigen as scsgd_eigen
from scsgd_jax._src.alias import scsgd_eigen_muon as scsgd_eigen_muon
from scsgd_jax._src.bound import clip_by_relative_norm as clip_by_relative_norm
from scsgd_jax._src.conditioning import Conditioning as Conditioning
from scsgd_jax._src.diagnostics import kernel_diagnostics as kernel_diagnostics
from scsgd_jax._src.diagnostics import update_diagnostics as update_diagnostics
from scsgd_jax._src.eigenbasis import ScaleByEigenbasisAdamState as ScaleByEigenbasisAdamState
from scsgd_jax._src.eigenbasis import scale_by_eigenbasis_adam as scale_by_eigenbasis_adam
from scsgd_jax._src.inputs import CapturedInputs as CapturedInputs
from scsgd_jax._src.muon import muon_kernel_filter as muon_kernel_filter
from scsgd_jax._src.muon import muon_without_momentum as muon_without_momentum
from scsgd_jax._src.options import Conditioner as Conditioner
from scsgd_jax._src.options import Refresh as Refresh
from scsgd_jax._src.options import Statistics as Statistics
from scsgd_jax._src.layout import Layout as Layout
from scsgd_jax._src.layout import Plain as Plain
from scsgd_jax._src.layout import default_kernel_filter as default_kernel_filter
from scsgd_jax._src.shardings import state_shardings as state_shardings
from scsgd_jax._src.state import ScaleBySketchedConditioningState as ScaleBySketchedConditioningState
from scsgd_jax._src.state import plans as plans
from scsgd_jax._src.transform import scale_by_sketched_conditioning as scale_by_sketched_conditioning

__version__ = "0.2.0.dev0"

# names that need Flax, loaded on first use: {name: module}
_LAZY = {
    "apply_gradients": "scsgd_jax._src.capture_linen",
    "capture_linen": "scsgd_jax._src.capture_linen",
    "capture_nnx": "scsgd_jax._src.capture_nnx",
    "contrib": "scsgd_jax.contrib",
    "input_axes_linen": "scsgd_jax._src.capture_linen",
    "input_axes_nnx": "scsgd_jax._src.capture_nnx",
    "sketch": "scsgd_jax.sketch",
    "sow_rows": "scsgd_jax._src.captured",
}

__all__ = sorted([
    "CapturedInputs",
    "Conditioner",
    "Conditioning",
    "Layout",
    "Plain",
    "Refresh",
    "ScaleByEigenbasisAdamState",
    "ScaleBySketchedConditioningState",
    "Statistics",
    "clip_by_relative_norm",
    "default_kernel_filter",
    "kernel_diagnostics",
    "muon_kernel_filter",
    "muon_without_momentum",
    "plans",
    "refresh_conditioners",
    "scale_by_eigenbasis_adam",
    "scale_by_sketched_conditioning",
    "scsgd",
    "scsgd_eigen",
    "scsgd_eigen_muon",
    "state_shardings",
    "update_diagnostics",
    *_LAZY,
])


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'scsgd_jax' has no attribute {name!r}")
  module = importlib.import_module(_LAZY[name])
  value = module if module.__name__ == f"scsgd_jax.{name}" else getattr(module, name)
  globals()[name] = value
  return value


def __dir__():
  return __all__
