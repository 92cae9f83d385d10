"""Optimizers from other packages for the head-to-head benchmark, as optax transformations whose keyword
arguments the experiments' sub-configs reach (:func:`signature`).

Installed by the optional ``bench`` extra (``pip install -e '.[bench]'``), never by the core
install; ``scsgd_jax`` never imports this module. The patches the packages need on today's JAX are in
``upstream.py``; how each optimizer's authors run it (its recipe and citation) is its entry in
``registry.py``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
import optax

from experiments.optim import options
from experiments.optim import upstream

def _extends(base: Callable[[], Callable], replaced: tuple[str, ...] = ()):
  """Marks the decorated wrapper as taking, besides its own arguments, every keyword argument of
  ``base()`` (a loader: the package may be an optional one, imported only when asked) but the
  ``replaced`` ones, which the wrapper sets from its own."""

  def decorate(fn):
    fn.extends, fn.replaced = base, replaced
    return fn

  return decorate


def signature(fn: Callable) -> inspect.Signature:
  """``fn``'s signature (the library's option objects read as their fields, :mod:`experiments.optim.options`); for a wrapper marked by :func:`_extends`, its own arguments then the wrapped
  function's, so the experiments' sub-configs reach every argument with upstream's own defaults."""
  sig = inspect.signature(fn)
  if options.takes_options(sig.parameters):  # the library's options, by their flat names
    sig = sig.replace(parameters=options.flat_parameters(fn, sig.parameters))
  if not hasattr(fn, "extends"):
    return sig
  own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
  names = {p.name for p in own} | set(fn.replaced)
  more = [p.replace(kind=p.KEYWORD_ONLY) for p in signature(fn.extends()).parameters.values()
          if p.name not in names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
  return inspect.Signature(own + more)


def _distributed_shampoo():
  upstream.patch_precondition()
  from precondition import distributed_shampoo as ds

  return ds.distributed_shampoo


def _muon():
  import optax.contrib

  return optax.contrib.muon


def _kron():
  upstream.patch_psgd()
  from psgd_jax import kron

  return kron.kron


@_extends(_kron, replaced=("weight_decay_mask",))
def psgd_kron(learning_rate, decay_matrices_only: bool = False, **kwargs):
  """PSGD Kron (Li; psgd-jax, Evan Walters' JAX implementation), with :func:`adamw`'s weight-decay mask option."""
  return _kron()(learning_rate, **({"weight_decay_mask": decay_matrices} if decay_matrices_only else {}), **kwargs)


def decay_matrices(params):
  """nanoGPT's weight-decay mask: kernels and embeddings (ndim >= 2) decay, biases and norms do not."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


@_extends(lambda: optax.adamw)
def adamw(learning_rate, decay_matrices_only: bool = False, **kwargs):
  """``optax.adamw``; ``decay_matrices_only``: weight decay on matrices only (nanoGPT's ``configure_optimizers``)."""
  return optax.adamw(learning_rate, **({"mask": decay_matrices} if decay_matrices_only else {}), **kwargs)


@_extends(lambda: optax.nadamw)
def nadamw(learning_rate, decay_matrices_only: bool = False, **kwargs):
  """``optax.nadamw``, with :func:`adamw`'s mask option."""
  return optax.nadamw(learning_rate, **({"mask": decay_matrices} if decay_matrices_only else {}), **kwargs)


SIDES = {"all": "ALL", "input": "INPUT"}


@_extends(_distributed_shampoo, replaced=("graft_type", "precondtioner_type"))
def shampoo(learning_rate, block_size: int = 1536, side: str = "all", graft: str = "RMSPROP_NORMALIZED",
            graft_conv: bool = False, **kwargs):
  """Distributed Shampoo (precondition-opt), two-sided (``side="all"``) or input-side only (``"input"``).

  ``graft``: the name of a ``GraftingType``; ``block_size``: the Lingvo/Praxis language-model recipe's
  1536, which keeps every kernel of the benchmark's models in one block. ``graft_conv``: conv kernels
  (4-D) take the grafting optimizer's step alone (a Shampoo instance that preconditions nothing),
  for a peer that cannot pay for their small axes. Everything else is ``distributed_shampoo``'s
  keyword arguments (``precondtioner_type`` sic upstream).
  """
  upstream.patch_precondition()
  from precondition import distributed_shampoo as ds

  if side not in SIDES:
    raise ValueError(f"shampoo: side={side!r}; choose one of {sorted(SIDES)}")
  settings = dict(precondtioner_type=getattr(ds.PreconditionerType, SIDES[side]), graft_type=getattr(ds.GraftingType, graft),
                  **kwargs)
  tx = ds.distributed_shampoo(learning_rate, block_size, **settings)
  if not graft_conv:
    return tx
  graft_only = ds.distributed_shampoo(learning_rate, block_size, **{**settings, "skip_preconditioning_rank_lt": 99,
                                                                      "frequent_directions": False,
                                                                      "compression_rank": 0})
  return optax.partition({"shampoo": tx, "graft": graft_only},
                         lambda params: jax.tree.map(lambda p: "graft" if p.ndim == 4 else "shampoo", params))


@_extends(lambda: shampoo)
def shampoo_input(learning_rate, side: str = "input", best_effort_shape_interpretation: bool = False,
                  skip_preconditioning_rank_lt: int = 2, **kwargs):
  """Input-side Shampoo: :func:`shampoo` with ``side="input"`` (SCSGD's closest relative). Upstream's input
  side needs each kernel's axes as they are (no merging) and vectors skipped (they take the grafting step)."""
  return shampoo(learning_rate, side=side, best_effort_shape_interpretation=best_effort_shape_interpretation,
                 skip_preconditioning_rank_lt=skip_preconditioning_rank_lt, **kwargs)


@_extends(lambda: shampoo_input)
def sketchy(learning_rate, compression_rank: int = 32, frequent_directions: bool = True,
            reuse_preconditioner: bool = True, preconditioning_compute_steps: int = 1, **kwargs):
  """Sketchy: input-side Shampoo (:func:`shampoo_input`) with frequent directions at ``compression_rank``
  (upstream computes the sketch and the preconditioner on the same steps, so ``preconditioning_compute_steps``
  is 1)."""
  return shampoo_input(learning_rate, frequent_directions=frequent_directions, compression_rank=compression_rank,
                 reuse_preconditioner=reuse_preconditioner,
                 preconditioning_compute_steps=preconditioning_compute_steps, **kwargs)


def muon_hidden(name: str, leaf, output_layer: str = "") -> bool:
  """Whether Muon takes the leaf at path ``name`` (:func:`muon_dimension_numbers`' rule): a hidden kernel."""
  name = name.lower()
  return not (leaf.ndim < 2 or "embed" in name or "pos" in name or (output_layer and output_layer in name))


def muon_dimension_numbers(params, output_layer: str = ""):
  """Muon for every hidden kernel (conv kernels flattened as (kh, kw, cin) x cout), AdamW for the rest:
  vectors, embedding and positional tables (a path containing "embed" or "pos") and the output layer
  (a path containing ``output_layer``), as Muon's authors prescribe. optax's default would give Muon
  every 2-D array (the tables and the head too) and silently send 4-D conv kernels to AdamW."""
  import optax.contrib

  def numbers(path, leaf):
    if not muon_hidden(jax.tree_util.keystr(path), leaf, output_layer):
      return None
    return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(range(leaf.ndim - 1)), output_axis=(leaf.ndim - 1,))

  return jax.tree_util.tree_map_with_path(numbers, params)


# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): per-step coefficients of Muon's quintic
# Newton-Schulz iteration, each step's polynomial the minimax one for the interval the earlier steps left; the five
# steps the nanoGPT speedrun runs (KellerJordan/modded-nanogpt, with its 2% safety factor). The first ``s`` rows are
# the greedy ``s``-step schedule: :func:`polar_express`.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(steps: int) -> dict:
  """``optax.contrib.muon``'s arguments for ``steps`` Newton-Schulz steps at Polar Express's coefficients."""
  if not 1 <= steps <= len(POLAR_EXPRESS):
    raise ValueError(f"polar_express: steps={steps} is outside 1..{len(POLAR_EXPRESS)} (the published schedule)")
  return {"ns_steps": steps, "ns_coeffs": POLAR_EXPRESS[:steps]}


@_extends(_muon)
def muon(learning_rate, output_layer: str = "", adam_learning_rate: float | None = None, **kwargs):
  """``optax.contrib.muon`` with :func:`muon_dimension_numbers` (``output_layer``: the head's name);
  ``adam_learning_rate`` (a rate or a schedule) for its AdamW part, Muon's own if None."""
  import optax.contrib

  return optax.contrib.muon(learning_rate, adam_learning_rate=adam_learning_rate, **kwargs,
                            muon_weight_dimension_numbers=lambda p: muon_dimension_numbers(p, output_layer))


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
         norm_constraint: float = 0.0, explicit_conv_patches: bool = True,
         **kwargs) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning chained with Nesterov SGD, as one transformation.

  kfac-jax's ``OptaxPreconditioner`` (its optax interface) estimates the Fisher's Kronecker factors
  from the model itself, so ``update`` needs the batch and a key: ``update(grads, state, params,
  batch=(inputs, labels), key=key)``. ``apply_fn(params, inputs) -> logits`` is the model;
  ``example_batch`` (any values, the right shapes) lets ``init`` trace it to find the layers.
  ``damping`` (no default upstream) 1e-3; ``inverse_update_period`` 5 and ``curvature_ema`` 0.95 are
  upstream's defaults (its ``curvature_update_period`` must stay 1: upstream refuses others);
  ``norm_constraint`` > 0 caps the preconditioned gradient's Fisher norm (upstream's
  KL clipping; 0: off); the inverses are computed on this device (``distributed_*=False``, outside pmap);
  ``explicit_conv_patches``: conv layers' input factors from their extracted patches, the same statistic
  as upstream's default 4-D convolution loop (:func:`upstream.use_explicit_conv_patches`), at a fraction of its
  cost on CPU.
  """
  upstream.patch_kfac()
  upstream.use_explicit_conv_patches(explicit_conv_patches)
  import kfac_jax

  pre = kfac_jax.OptaxPreconditioner(
      lambda params, batch: kfac_loss(apply_fn, params, batch), damping=damping,
      norm_constraint=norm_constraint or None,
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
