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

import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# optimizer name -> the peer packages its runs depend on (recorded with each run)
PACKAGES = {"shampoo": ("precondition-opt",), "shampoo_input": ("precondition-opt",), "sketchy": ("precondition-opt",),
            "kfac": ("kfac-jax",)}

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


def _extends(base: Callable[[], Callable], replaced: tuple[str, ...] = ()):
  """Marks the decorated wrapper as taking, besides its own arguments, every keyword argument of
  ``base()`` (a loader: the package may be an optional one, imported only when asked) but the
  ``replaced`` ones, which the wrapper sets from its own."""

  def decorate(fn):
    fn.extends, fn.replaced = base, replaced
    return fn

  return decorate


def signature(fn: Callable) -> inspect.Signature:
  """``fn``'s signature; for a wrapper marked by :func:`_extends`, its own arguments then the wrapped
  function's, so the experiments' sub-configs reach every argument with upstream's own defaults."""
  sig = inspect.signature(fn)
  if not hasattr(fn, "extends"):
    return sig
  own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
  names = {p.name for p in own} | set(fn.replaced)
  more = [p.replace(kind=p.KEYWORD_ONLY) for p in signature(fn.extends()).parameters.values()
          if p.name not in names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
  return inspect.Signature(own + more)


def _distributed_shampoo():
  patch_precondition()
  from precondition import distributed_shampoo as ds

  return ds.distributed_shampoo


def _muon():
  import optax.contrib

  return optax.contrib.muon


def _decay_matrices(params):
  """nanoGPT's weight-decay mask: kernels and embeddings (ndim >= 2) decay, biases and norms do not."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


@_extends(lambda: optax.adamw)
def adamw(learning_rate, decay_matrices_only: bool = False, **kwargs):
  """``optax.adamw``; ``decay_matrices_only``: weight decay on matrices only (nanoGPT's ``configure_optimizers``)."""
  return optax.adamw(learning_rate, **({"mask": _decay_matrices} if decay_matrices_only else {}), **kwargs)


@_extends(lambda: optax.nadamw)
def nadamw(learning_rate, decay_matrices_only: bool = False, **kwargs):
  """``optax.nadamw``, with :func:`adamw`'s mask option."""
  return optax.nadamw(learning_rate, **({"mask": _decay_matrices} if decay_matrices_only else {}), **kwargs)


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
  patch_precondition()
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


def muon_dimension_numbers(params, output_layer: str = ""):
  """Muon for every hidden kernel (conv kernels flattened as (kh, kw, cin) x cout), AdamW for the rest:
  vectors, embedding and positional tables (a path containing "embed" or "pos") and the output layer
  (a path containing ``output_layer``), as Muon's authors prescribe. optax's default would give Muon
  every 2-D array (the tables and the head too) and silently send 4-D conv kernels to AdamW."""
  import optax.contrib

  def numbers(path, leaf):
    name = jax.tree_util.keystr(path).lower()
    if leaf.ndim < 2 or "embed" in name or "pos" in name or (output_layer and output_layer in name):
      return None
    return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(range(leaf.ndim - 1)), output_axis=(leaf.ndim - 1,))

  return jax.tree_util.tree_map_with_path(numbers, params)


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
  as upstream's default 4-D convolution loop (:func:`use_explicit_conv_patches`), at a fraction of its
  cost on CPU.
  """
  patch_kfac()
  use_explicit_conv_patches(explicit_conv_patches)
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


# ---------------------------------------------------------------------------------------------------
# How each optimizer's authors run it, per model kind: the head to head's settings (one owner: the
# benchmark configs name the kind, never these values). ``learning_rate`` is the centre of the rate
# grid every optimizer gets alike; ``settings`` are keyword arguments of its function (its sub-config).

class Recipe(NamedTuple):
  learning_rate: float
  settings: dict
  source: str


KINDS = ("cnn", "transformer", "linear")

PAPER = ("Gonen & Shalev-Shwartz, Section 3 (the paper's baseline; Caffe's LeNet solver): Nesterov SGD, "
         "momentum 0.9 (configs/default.py), rate 0.01")
SCSGD = "scsgd_jax's defaults (none changed for the benchmark); the paper's rate 0.01"
ADAM = ("Kingma & Ba (2015): Adam's lr 1e-3 and betas (0.9, 0.999); Loshchilov & Hutter (2019) decoupled "
        "weight decay at optax.adamw's default 1e-4 (image classifiers and linear models)")
NANOGPT = ("nanoGPT (Karpathy), config/train_shakespeare_char.py, the same character-level task: AdamW lr 1e-3 "
           "('with baby networks can afford to go a bit higher'), beta2 0.99 ('the number of tokens per iter "
           "is small'), weight decay 0.1 (train.py) on matrices and embeddings only (model.configure_optimizers); "
           "warmup then cosine decay")
NADAM = "Dozat (2016) / optax.nadamw: Adam's rate and betas with Nesterov momentum; weight decay as AdamW's"
MUON = ("Jordan et al. (2024), 'Muon: An optimizer for hidden layers in neural networks' "
        "(kellerjordan.github.io/posts/muon): lr 0.02, momentum 0.95, Nesterov, 5 Newton-Schulz steps "
        "(optax.contrib.muon's defaults) on hidden weight matrices, conv filters flattened as in the CIFAR-10 "
        "speedruns; 'the input embedding, final output layer, and any internal gains or biases should be "
        "optimized using a standard method such as AdamW': here AdamW with AdamW's own tuned rate and betas")
SHAMPOO = ("Anil et al. (2020), distributed Shampoo; its authors' language-model settings (Lingvo/Praxis "
           "DistributedShampoo.HParamsLanguageModeling): beta1 0.9, beta2 0.999, block 1536, matrix_epsilon "
           "1e-8, RMSPROP_NORMALIZED grafting (Adam-like per-layer step sizes), nesterov off, "
           "moving_average_for_momentum, exponent_override 0 (two-sided: inverse 4th roots of both factors), "
           "start_preconditioning_step 51 (after its first refresh period), preconditioning_compute_steps 50; "
           "the grafted step takes an Adam-scale rate (centre 1e-3)")
SKETCHY = ("Feinberg et al. (2023), Sketchy: Shampoo's statistics sketched by frequent directions "
           "(precondition-opt's implementation, input side at rank 32, which upstream requires to refresh every "
           "step), with Shampoo's settings and grafting above")
KFAC = ("kfac-jax (Botev & Martens): its optax interface (OptaxPreconditioner) chained with Nesterov SGD 0.9; "
        "no default rate or damping upstream, so damping is tuned jointly with the rate "
        "(benchmark.joint_grid); KL-clipping norm_constraint 1e-3 (FermiNet's kfac-jax setting); "
        "curvature_ema 0.95 and inverse_update_period 5 (upstream's defaults); conv layers' input factors by "
        "upstream's patches_moments_explicit, 'the exact same functionality' as its default 4-D convolution loop "
        "(14x faster on LeNet's second conv here: 68 vs 963 ms)")

_SHAMPOO_SETTINGS = dict(beta1=0.9, beta2=0.999, block_size=1536, matrix_epsilon=1e-8, graft="RMSPROP_NORMALIZED",
                         nesterov=False, moving_average_for_momentum=True, exponent_override=0,
                         start_preconditioning_step=51, preconditioning_compute_steps=50)
INPUT_SIDE = (" (upstream's INPUT preconditioner type, which needs best_effort_shape_interpretation off; "
              "vectors take the grafting step)")
_OUTPUT_LAYER = {"cnn": "dense2", "transformer": "head", "linear": ""}  # the benchmark models' heads
# the argument that takes AdamW's tuned rate for Muon's AdamW part, per optimizer that has one
MUON_ADAM_RATE = {"muon": "adam_learning_rate", "scsgd_muon": "muon_adam_learning_rate",
                  "scsgd_muon_fresh": "muon_adam_learning_rate"}
# scsgd_muon_fresh: the conditioning's statistics refreshed every 10 steps at EMA rate 0.2, chosen on the
# development task (experiments/results/develop/probes/fresh_statistics, synthetic data) before any benchmark
# task ran it
FRESH_STATISTICS = {"update_every": 10, "ema_rate": 0.2}


def _adam_settings(kind: str) -> dict:
  return dict(b2=0.99, weight_decay=0.1, decay_matrices_only=True) if kind == "transformer" else {}


def recipe(name: str, kind: str) -> Recipe:
  """How the authors of optimizer ``name`` run it on a model of ``kind`` (one of :data:`KINDS`)."""
  if kind not in KINDS:
    raise ValueError(f"unknown model kind {kind!r}; choose one of {KINDS}")
  adam, adam_source = _adam_settings(kind), (NANOGPT if kind == "transformer" else ADAM)
  if name == "sgd":
    return Recipe(0.01, {}, PAPER)
  if name == "scsgd":
    return Recipe(0.01, {}, SCSGD)
  if name == "adamw":
    return Recipe(1e-3, adam, adam_source)
  if name == "nadamw":
    return Recipe(1e-3, adam, f"{NADAM}; {adam_source}")
  if name == "scsgd_adamw":
    return Recipe(1e-3, {f"adamw_{k}": v for k, v in adam.items()},
                  f"scsgd_jax's conditioning at its defaults in front of AdamW as AdamW's recipe: {adam_source}")
  if name == "scsgd_graft":
    # centre: the rate chosen on the development task (experiments/results/develop/, synthetic data; its grid
    # was centred on Adam's 1e-3), frozen before any benchmark task ran it
    return Recipe(3.16e-4, {"graft_decay": _SHAMPOO_SETTINGS["beta2"]},
                  "scsgd_jax's conditioning at its defaults, grafted onto normalized RMSprop as Shampoo's "
                  "RMSPROP_NORMALIZED grafting (Agarwal et al. 2020; beta2 as Shampoo's above), Nesterov 0.9; "
                  "rate centre 3.16e-4, chosen on the development task (synthetic data)")
  if name == "scsgd_two_sided":
    return Recipe(1e-3, {"graft_decay": _SHAMPOO_SETTINGS["beta2"]},
                  "scsgd_jax.scsgd_two_sided at its defaults: both sides' conditioning grafted onto normalized "
                  "RMSprop as Shampoo's RMSPROP_NORMALIZED grafting (Agarwal et al. 2020; beta2 as Shampoo's above), "
                  "Nesterov 0.9; rate centre Adam's 1e-3 (the grafted step is on Adam's scale)")
  if name == "scsgd_two_sided_lean":
    # centre: the rate chosen on the development task (experiments/results/develop/, synthetic data; its grid
    # was centred on Adam's 1e-3), frozen before any benchmark task ran it
    return Recipe(3.16e-4, {},
                  "scsgd_jax.scsgd_two_sided at Adam's memory (magnitude='sign', split_budget=True: "
                  "experiments.optimizers.FIXED): both sides' conditioning at the per-layer norm of sign(g), "
                  "distributed Shampoo's SQRT_N grafting (Anil et al. 2020), Nesterov 0.9; rate centre 3.16e-4, "
                  "chosen on the development task (synthetic data)")
  if name in ("muon", "scsgd_muon", "scsgd_muon_fresh"):
    settings = {"output_layer": _OUTPUT_LAYER[kind], **{f"adam_{k}": v for k, v in adam.items() if k != "decay_matrices_only"}}
    note = "" if _OUTPUT_LAYER[kind] else " (a one-layer model: its only matrix, the output layer, stays on Muon)"
    if name == "muon":
      return Recipe(0.02, settings, MUON + note)
    fresh = FRESH_STATISTICS if name == "scsgd_muon_fresh" else {}
    said = (f"with fresher statistics ({fresh}, chosen on the development task) " if fresh else "at its defaults ")
    return Recipe(0.02, {**{f"muon_{k}": v for k, v in settings.items()}, **fresh},
                  f"scsgd_jax's conditioning {said}in front of Muon as Muon's recipe: {MUON}{note}")
  if name == "shampoo":
    return Recipe(1e-3, dict(_SHAMPOO_SETTINGS), SHAMPOO)
  if name == "shampoo_input":
    return Recipe(1e-3, dict(_SHAMPOO_SETTINGS), SHAMPOO + "; input side only" + INPUT_SIDE)
  if name == "sketchy":
    settings = {**_SHAMPOO_SETTINGS, "preconditioning_compute_steps": 1}
    conv = kind == "cnn"
    if conv:
      settings["graft_conv"] = True
    return Recipe(1e-3, settings, SKETCHY + INPUT_SIDE + ("; conv kernels take the grafting step alone (their small axes cost "
                                             "~50 s a step on the benchmark CPU)" if conv else ""))
  if name == "kfac":
    return Recipe(0.01, dict(norm_constraint=1e-3), KFAC)
  raise ValueError(f"no recipe for optimizer {name!r}")
