"""Public optimizer: sketched conditioning chained with Nesterov SGD."""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

import optax
import optax.contrib

from scsgd_jax._src import bound
from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import eigenbasis
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import muon as muon_lib
from scsgd_jax._src import transform
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.conditioning import checked
from scsgd_jax._src.conditioning import refuses_moved_keywords

__all__ = ["scsgd", "scsgd_eigen", "scsgd_eigen_muon"]


@refuses_moved_keywords
def scsgd(
    learning_rate: optax.ScalarOrSchedule,
    conditioning: Conditioning = Conditioning(),
    *,
    momentum: Optional[float] = defaults.MOMENTUM,
    nesterov: bool = True,
    max_relative_step: Optional[float] = defaults.MAX_RELATIVE_STEP,
) -> optax.GradientTransformationExtraArgs:
  r"""SCSGD: SGD (Nesterov momentum by default) on input-side conditioned gradients.

  ``optax.chain(scale_by_sketched_conditioning(...), optax.sgd(learning_rate, momentum, nesterov))``,
  so momentum accumulates the conditioned gradients
  :math:`\delta (A^{-1} x)^\top` of Section 3. ``conditioning``: the settings, a :class:`Conditioning` (see
  :func:`scale_by_sketched_conditioning`). ``max_relative_step``: the chain ends with
  :func:`clip_by_relative_norm` at that ratio: the step of each leaf of two or more axes (of each layer of a scanned
  or vmapped stack) at most that share of its weight's norm (or of a fresh init's, for a small or zero-initialised
  layer). It holds the step where one rate is too high for one layer (a softmax head at the warmup's peak);
  ``None`` leaves it out (the paper's step).

  Example:
    >>> import jax.numpy as jnp, optax, scsgd_jax
    >>> params = {'dense': {'kernel': jnp.zeros((3, 2)), 'bias': jnp.zeros(2)}}
    >>> tx = scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(conditioner=scsgd_jax.Conditioner(kind='full')))
    >>> state = tx.init(params)
    >>> grads = {'dense': {'kernel': jnp.ones((3, 2)), 'bias': jnp.ones(2)}}
    >>> inputs = {'dense': {'kernel': jnp.eye(3)}}
    >>> updates, state = tx.update(grads, state, params, layer_inputs=inputs)
    >>> updates['dense']['bias']
    Array([-0.19, -0.19], dtype=float32)

  References:
    Gonen & Shalev-Shwartz, Faster SGD Using Sketched Conditioning, arXiv:1506.02649, 2015.
  """
  if not callable(learning_rate):
    checks.check_float("learning_rate", learning_rate, low=0.0)
  if momentum is not None:
    checks.check_float("momentum", momentum, low=0.0, high=1.0, high_open=True)
  if max_relative_step is not None:  # named as the caller passed it (clip_by_relative_norm calls it max_ratio)
    checks.check_float("max_relative_step", max_relative_step, low=0.0, low_open=True)
  c = checked(conditioning, "scsgd")
  bounded = () if max_relative_step is None else (bound.clip_by_relative_norm(max_relative_step,
                                                                               slices=_kernel_slices(c)),)
  return optax.chain(transform.scale_by_sketched_conditioning(c),
                     optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov), *bounded)


def _kernel_slices(c: Conditioning) -> bound.Slices:
  """The step bound's layers: each leaf of two or more axes; a kernel by its layout's stack (a scanned or vmapped
  stack bounded layer by layer, as the unrolled model would be), any other leaf by the stack of the kernel nearest
  it in the tree whose stacked axes it shares (a stack's biases and scales: vectors per layer, which pass)."""
  kernels = c.kernels()

  def stacks(params):
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    named = [(layout_lib.path_to_str(p), leaf) for p, leaf in flat]
    stacked = {}
    for path, leaf in named:
      if kernels(path, leaf):
        layout = layout_lib.layout_of(path, leaf, c.input_axes)
        stacked[path] = 0 if layout is None else layout.stack  # a kernel planned plain: whole
    shapes = {path: jnp.shape(leaf) for path, leaf in named}
    out = [stacked[path] if path in stacked else _neighbours_stack(path, shapes, stacked) for path, _ in named]
    return jax.tree_util.tree_unflatten(treedef, [s if jnp.ndim(leaf) - s >= 2 else None
                                                  for s, (_, leaf) in zip(out, named)])

  return stacks


def _neighbours_stack(path: str, shapes: dict, stacked: dict) -> int:
  """The stack of the kernel sharing the longest path prefix with ``path`` whose stacked axes leaf ``path`` has too
  (``shapes``: every leaf's, by path)."""
  parts, best, shared = path.split("/"), 0, 0
  for kernel, stack in stacked.items():
    common = len(os.path.commonprefix([parts, kernel.split("/")]))
    if stack and common > shared and tuple(shapes[path])[:stack] == tuple(shapes[kernel])[:stack]:
      best, shared = stack, common
  return best


@refuses_moved_keywords
def scsgd_eigen(
    learning_rate: optax.ScalarOrSchedule,
    conditioning: Conditioning = Conditioning(),
    *,
    b1: float = defaults.ADAM_B1,
    b2: float = defaults.ADAM_B2,
    eps: float = defaults.ADAM_EPS,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Optional[Any] = None,
    tail: eigenbasis.Tail = "factored",
    basis: eigenbasis.Basis = "inputs",
    sides: eigenbasis.Sides = "input",
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW in each kernel's sketched input eigenbasis (one-sided, sketched EKFAC/SOAP)::

    optax.chain(scale_by_eigenbasis_adam(conditioning, b1=b1, b2=b2, eps=eps, nesterov=nesterov, tail=tail,
                                         basis=basis, sides=sides),
                optax.add_decayed_weights(weight_decay, mask),
                optax.scale_by_learning_rate(learning_rate))

  Rates on Adam's scale. ``update`` takes ``layer_inputs=`` (the captured inputs, as :func:`scsgd`; with
  ``basis='gradients'`` the basis comes from the gradient's own rows, SOAP's, and no capture is needed).
  :func:`scale_by_eigenbasis_adam` describes the update, its state and its cost; ``conditioning`` is the
  conditioning's (``Conditioning(conditioner=Conditioner(kind='full'), statistics=Statistics(kind='dense'))``
  gives Adam in the full eigenbasis).
  """
  if not callable(learning_rate):
    checks.check_float("learning_rate", learning_rate, low=0.0)
  checks.check_float("weight_decay", weight_decay, low=0.0)
  return optax.chain(
      eigenbasis.scale_by_eigenbasis_adam(conditioning, b1=b1, b2=b2, eps=eps, nesterov=nesterov, tail=tail,
                                          basis=basis, sides=sides),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate))


@refuses_moved_keywords
def scsgd_eigen_muon(
    learning_rate: optax.ScalarOrSchedule,
    conditioning: Conditioning = Conditioning(),
    *,
    beta: float = 0.95,
    b2: float = defaults.ADAM_B2,
    eps: float = defaults.ADAM_EPS,
    output_layer: str = "",
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    weight_decay: float = 0.0,
    muon: Optional[dict] = None,
    basis: eigenbasis.Basis = "inputs",
    sides: eigenbasis.Sides = "input",
) -> optax.GradientTransformationExtraArgs:
  r"""Muon's momentum scaled by Adam in each hidden kernel's sketched input eigenbasis, then orthogonalized
  (the SOAP-Muon layout, with the eigenbasis sketched)::

    optax.chain(scale_by_eigenbasis_adam(conditioning.replace(kernel_filter=hidden), b1=beta, b2=b2, eps=eps,
                                         nesterov=True, basis=basis, sides=sides, others='identity'),
                muon_without_momentum(learning_rate, hidden, input_axes=conditioning.input_axes,
                                      output_layer=output_layer, adam_learning_rate=adam_learning_rate,
                                      weight_decay=weight_decay, **muon))

  where :func:`muon_without_momentum` is ``optax.contrib.muon(learning_rate, beta=0, ...)`` less the momentum
  buffer that it never reads at ``beta=0`` (the eigenbasis Adam's Nesterov first moment, at Muon's ``beta``, takes
  its place): the same updates bit for bit, one float per hidden parameter less. The hidden kernels
  (``conditioning.kernel_filter``, default every kernel of :func:`default_kernel_filter` but the embedding tables and the
  layer whose path contains ``output_layer``, as Muon's authors prescribe) are conditioned and orthogonalized,
  each as the matrix of its input axes (a layer stack's slices each their own); Muon's AdamW part (rate
  ``adam_learning_rate``, default ``learning_rate``) takes every other leaf's raw gradient. Rates on Muon's
  scale. ``update`` takes ``layer_inputs=`` as :func:`scsgd` does.

  State: :func:`scale_by_eigenbasis_adam`'s for the hidden kernels (within Adam's for the sketched basis), Adam's
  moments for the rest, a counter per transform: within AdamW's floats under the default memory rule. Cost: the
  eigenbasis's five ``(k x n) (n x p)`` products and Muon's Newton-Schulz iterations.

  Args:
    learning_rate: Muon's rate.
    conditioning: the conditioning's :class:`Conditioning` (:func:`scale_by_eigenbasis_adam`); its
      ``kernel_filter`` picks the hidden kernels (default: see above).
    beta: Muon's momentum, kept by the eigenbasis Adam as its Nesterov first moment.
    b2, eps: the eigenbasis Adam's.
    output_layer: the head's name (a substring of its path); ``""``: every kernel is hidden.
    adam_learning_rate: the rate of Muon's AdamW part.
    weight_decay: Muon's decoupled weight decay on the hidden kernels.
    muon: ``optax.contrib.muon``'s other arguments (``ns_steps``, ``adam_b1``, ``adam_b2``,
      ``adam_weight_decay``, ...).
    basis, sides: the eigenbasis' (:func:`scale_by_eigenbasis_adam`): ``basis='gradients', sides='both'`` at full
      rank (``Conditioner('full')``, ``Statistics('dense')``) is SOAP's two-sided basis in front of Muon.
  """
  if not callable(learning_rate):
    checks.check_float("learning_rate", learning_rate, low=0.0)
  checks.check_float("weight_decay", weight_decay, low=0.0)
  c = checked(conditioning, "scsgd_eigen_muon")
  hidden = muon_lib.muon_kernels(c.kernel_filter or muon_lib.muon_kernel_filter(output_layer, c.input_axes),
                                 c.input_axes)
  return optax.chain(
      eigenbasis.scale_by_eigenbasis_adam(c.replace(kernel_filter=hidden), b1=beta, b2=b2, eps=eps, nesterov=True,
                                          basis=basis, sides=sides, others="identity"),
      muon_lib.muon_without_momentum(learning_rate, hidden, input_axes=c.input_axes, output_layer=output_layer,
                                     adam_learning_rate=adam_learning_rate, weight_decay=weight_decay,
                                     **(muon or {})))
