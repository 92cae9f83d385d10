"""Optimizers from other packages for the head-to-head benchmark, and the patches they need today.

Installed by the optional ``bench`` extra (``pip install -e '.[bench]'``), never by the core
install; ``scsgd_jax`` never imports this module. Each patch is applied only where the upstream
package still needs it, and ``tests/experiments/test_peers.py`` has a test that fails once it no longer does,
so a patch is removed as soon as its package is fixed.

- ``precondition-opt`` 0.3.0 (Shampoo, Sketchy) calls ``jax.tree_map`` / ``jax.tree_flatten`` /
  ``jax.tree_unflatten``, which JAX removed: :func:`patch_precondition` restores them as aliases of
  ``jax.tree.*``.
- ``kfac-jax`` 0.0.8's graph evaluator unpacks ``primitive.get_bind_params(params)`` as a pair
  ``(subfuns, params)``; JAX >= 0.9.2 returns the params dict alone, so the first step fails with
  "too many values to unpack": :func:`patch_kfac` accepts both forms.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# optimizer name -> the peer packages its runs depend on (recorded with each run)
PACKAGES = {"shampoo": ("precondition-opt",), "sketchy": ("precondition-opt",), "kfac": ("kfac-jax",)}

PRECONDITION_ALIASES = {"tree_map": jax.tree.map, "tree_flatten": jax.tree.flatten,
                        "tree_unflatten": jax.tree.unflatten}


def patch_precondition() -> list[str]:
  """Restores the JAX aliases precondition-opt 0.3.0 uses; returns the names it had to add."""
  added = [name for name in PRECONDITION_ALIASES if not hasattr(jax, name)]
  for name in added:
    setattr(jax, name, PRECONDITION_ALIASES[name])
  return added


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


def shampoo(learning_rate, block_size: int = 1024, preconditioning_compute_steps: int = 50, **kwargs):
  """Input-side Shampoo (``precondtioner_type`` sic), as the benchmark's protocol sets it.

  ``block_size`` (required upstream, no default there): 1024 keeps every kernel of the benchmark's
  models in one block (LeNet's largest input side is 800). ``preconditioning_compute_steps``: 50,
  SCSGD's refresh period, instead of upstream's 1 (an inverse p-th root of every statistic at every
  step: 1.44 s per step for one 785 x 785 block on the 2-core benchmark CPU, 70 minutes per run).
  """
  patch_precondition()
  from precondition import distributed_shampoo as ds

  settings = dict(precondtioner_type=ds.PreconditionerType.INPUT, best_effort_shape_interpretation=False,
                  skip_preconditioning_rank_lt=2)
  return ds.distributed_shampoo(learning_rate, block_size, **{**settings, "preconditioning_compute_steps": preconditioning_compute_steps, **kwargs})


def sketchy(learning_rate, compression_rank: int = 32, **kwargs):
  """One-sided Sketchy: input-side Shampoo with frequent directions at ``compression_rank``.

  Upstream requires the sketch and the preconditioner to be computed on the same steps; both every
  step (its default), since a rank-``r`` frequent-directions step is cheap (O(n r^2)).
  """
  return shampoo(learning_rate, frequent_directions=True, compression_rank=compression_rank,
                 reuse_preconditioner=True, **{"preconditioning_compute_steps": 1, **kwargs})


def muon_dimension_numbers(params):
  """Muon for every kernel (conv kernels flattened as (kh, kw, cin) x cout), AdamW for the rest.

  optax's default gives Muon only to 2-D kernels and silently sends 4-D conv kernels to AdamW.
  Embedding tables stay with AdamW, as Muon's authors do.
  """
  import optax.contrib

  def numbers(path, leaf):
    name = jax.tree_util.keystr(path).lower()
    if leaf.ndim < 2 or "embed" in name:
      return None
    return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(range(leaf.ndim - 1)), output_axis=(leaf.ndim - 1,))

  return jax.tree_util.tree_map_with_path(numbers, params)


def muon(learning_rate, **kwargs):
  import optax.contrib

  return optax.contrib.muon(learning_rate, muon_weight_dimension_numbers=muon_dimension_numbers, **kwargs)


class KfacState(NamedTuple):
  preconditioner: Any  # kfac_jax's OptaxPreconditionState: curvature factors, cached inverses, count
  sgd: optax.OptState


def kfac_loss(apply_fn: Callable, params, batch):
  """Mean softmax cross-entropy of ``apply_fn(params, inputs)`` over every prediction (per image, or per
  position of a text window), registered with K-FAC. K-FAC takes a loss as ``weight * sum / B`` with
  ``B`` the batch's first dimension (a sequence's positions are its layers' repeats), so the mean over
  ``labels.size`` predictions has ``weight = B / labels.size``."""
  import kfac_jax

  inputs, labels = batch
  logits = apply_fn(params, inputs)
  kfac_jax.register_softmax_cross_entropy_loss(logits, labels, weight=labels.shape[0] / labels.size)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def kfac(learning_rate, *, apply_fn: Callable, example_batch, damping: float = 1e-3, momentum: float = 0.9,
         nesterov: bool = True, inverse_update_period: int = 5, curvature_ema: float = 0.95,
         **kwargs) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning chained with Nesterov SGD, as one transformation.

  kfac-jax's ``OptaxPreconditioner`` (its optax interface) estimates the Fisher's Kronecker factors
  from the model itself, so ``update`` needs the batch and a key: ``update(grads, state, params,
  batch=(inputs, labels), key=key)``. ``apply_fn(params, inputs) -> logits`` is the model;
  ``example_batch`` (any values, the right shapes) lets ``init`` trace it to find the layers.
  ``damping`` (no default upstream) 1e-3; ``inverse_update_period`` 5 and ``curvature_ema`` 0.95 are
  upstream's defaults; the inverses are computed on this device (``distributed_*=False``, outside pmap).
  """
  patch_kfac()
  import kfac_jax

  pre = kfac_jax.OptaxPreconditioner(
      lambda params, batch: kfac_loss(apply_fn, params, batch), damping=damping,
      inverse_update_period=inverse_update_period, curvature_ema=curvature_ema,
      distributed_inverses=False, distributed_precon_apply=False, **kwargs)
  sgd = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)

  def init(params):
    return KfacState(pre.init((params, example_batch), jax.random.PRNGKey(0)), sgd.init(params))

  def update(grads, state, params=None, *, batch, key, **extra):
    del extra
    ps = pre.maybe_update(state.preconditioner, (params, batch), key)
    updates, sgd_state = sgd.update(pre.apply(grads, ps), state.sgd, params)
    return updates, KfacState(pre.increment_count(ps), sgd_state)

  return optax.GradientTransformationExtraArgs(init, update)
