"""Patches that peer packages of the head to head need on today's JAX, apart from how the peers are run.

Each patch is applied only where the upstream package still needs it, and ``tests/experiments/test_peers.py``
has a test that fails once it no longer does, so a patch is removed as soon as its package is fixed.

- ``precondition-opt`` 0.3.0 (Shampoo, Sketchy) calls ``jax.tree_map`` / ``jax.tree_flatten`` /
  ``jax.tree_unflatten``, which JAX removed: :func:`patch_precondition` restores them as aliases of
  ``jax.tree.*``.
- ``kfac-jax`` 0.0.8's graph evaluator unpacks ``primitive.get_bind_params(params)`` as a pair
  ``(subfuns, params)``; JAX >= 0.9.2 returns the params dict alone, so the first step fails with
  "too many values to unpack": :func:`patch_kfac` accepts both forms.
- kfac-jax's conv input factor: :func:`use_explicit_conv_patches` picks its explicit-patches implementation.
- ``psgd-jax`` 0.2.9 (PSGD Kron) imports ``optax._src.clipping``, which optax moved to
  ``optax.transforms._clipping`` (it uses nothing from it): :func:`patch_psgd` makes the old name importable.
"""

from __future__ import annotations

import jax


PRECONDITION_ALIASES = {"tree_map": jax.tree.map, "tree_flatten": jax.tree.flatten,
                        "tree_unflatten": jax.tree.unflatten}


def patch_precondition() -> list[str]:
  """Restores the JAX aliases precondition-opt 0.3.0 uses; returns the names it had to add."""
  added = [name for name in PRECONDITION_ALIASES if not hasattr(jax, name)]
  for name in added:
    setattr(jax, name, PRECONDITION_ALIASES[name])
  return added


def patch_psgd() -> bool:
  """Makes ``optax._src.clipping`` importable for psgd-jax 0.2.9; True if it had to."""
  import importlib
  import sys

  try:
    importlib.import_module("optax._src.clipping")
    return False
  except ImportError:
    from optax.transforms import _clipping

    sys.modules["optax._src.clipping"] = _clipping
    return True


def patch_kfac() -> bool:
  """Lets kfac-jax 0.0.8 evaluate equations whose ``get_bind_params`` returns a dict; True if patched."""
  from kfac_jax._src import tag_graph_matcher as tgm

  if getattr(tgm.eval_jaxpr_eqn, "_scsgd_patched", False):
    return True

  def eval_jaxpr_eqn(eqn, in_values):
    bind = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = ([], bind) if isinstance(bind, dict) else bind
    with tgm.jex.source_info_util.user_context(eqn.source_info.traceback):
      output = eqn.primitive.bind(*subfuns, *in_values, **params)
    return output if isinstance(output, list) else [output]

  eval_jaxpr_eqn._scsgd_patched = True
  tgm.eval_jaxpr_eqn = eval_jaxpr_eqn
  return True


def use_explicit_conv_patches(explicit: bool) -> None:
  """Which of kfac-jax's two implementations of a conv layer's input factor (the second moment of its
  im2col patches) its Kronecker-factored conv blocks use: ``patches_moments_explicit`` ("the exact same
  functionality", upstream's docstring, from the extracted patches and one matmul) or upstream's default
  ``patches_moments`` (a loop of 4-D convolutions, which XLA's CPU backend runs slowly). Read when a
  training step is traced."""
  import types

  from kfac_jax._src import patches_second_moment as psm
  from kfac_jax._src.curvature_blocks import kronecker_factored as kf

  def explicit_moments(*args, precision=None, **kwargs):
    # the layer's (lhs, rhs) precision pair; conv_general_dilated_patches takes one
    if isinstance(precision, tuple):
      precision = max(precision, key=lambda p: jax.lax.Precision(p).value)
    return psm.patches_moments_explicit(*args, precision=precision, **kwargs)

  kf.psm = types.SimpleNamespace(num_conv_locations=psm.num_conv_locations,
                                 patches_moments=explicit_moments) if explicit else psm
