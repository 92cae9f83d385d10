"""The output side: each kernel conditioned by the correlation of its back-propagated output rows, the
input side's transformation reading the kernel along its output axes (experimental: :mod:`scsgd_jax.contrib`)."""

from __future__ import annotations

from typing import Optional

import jax
import optax

from scsgd_jax._src import defaults
from scsgd_jax._src import estimator as estimator_lib
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import transform
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.conditioning import checked
from scsgd_jax._src.conditioning import refuses_moved_keywords
from scsgd_jax._src.output_rows import (check_output_grads, default_output_axes, output_axes_from,
                                        output_kernel_filter_from, sample_rows)

__all__ = ["scale_by_output_conditioning"]


@refuses_moved_keywords
def scale_by_output_conditioning(
    conditioning: Conditioning = Conditioning(),
    *,
    output_axes: layout_lib.InputAxes = None,
    max_rows: Optional[int] = defaults.MAX_ROWS,
    memory_share: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditions each kernel gradient on its output side: ``G A_out^{-1}``, ``A_out`` built from the correlation
  :math:`\Delta = E[\delta \delta^\top]` of the back-propagated output rows exactly as
  :func:`scale_by_sketched_conditioning` builds ``A`` from the inputs' ``C`` (same arguments, statistics,
  memory rule and refreshes; it is that transformation reading the kernel along its output axes).

  Chained with the input side, ``optax.chain(scale_by_sketched_conditioning(), scale_by_output_conditioning())``
  gives the two-sided :math:`C^{-1/2} G \Delta^{-1/2}` (full conditioners), i.e. full-matrix AdaGrad's
  :math:`E[g g^\top]^{-1/2}` under the Kronecker approximation :math:`E[g g^\top] \approx C \otimes \Delta`
  of K-FAC, at ``O(n k + p k)`` per step with the sketches. :math:`\Delta^{-1/2}` scales as the inverse of
  the loss's scale, so the result belongs behind grafting (:func:`scale_by_grafting`), as in
  :func:`scsgd_jax.contrib.scsgd_two_sided`.

  ``update(updates, state, params=None, *, output_grads)``: the gradient of the loss with respect to the
  perturbations of :func:`output_perturbations_nnx` / :func:`output_perturbations_linen` (passed to the
  capture); rows ``(..., p)`` per kernel over its output axes. Embeddings are left out by default
  (:func:`output_kernel_filter`).

  Args:
    conditioning: the settings, as for :func:`scale_by_sketched_conditioning`: its ``kernel_filter`` (default
      :func:`output_kernel_filter`, less the kernels ``input_axes`` leaves plain), its ``input_axes`` the input
      side's layouts, each kernel then read along the axes they leave (:func:`output_axes_from`), and its ``seed``
      that of the state's PRNG key (the sketches and the row sampling).
    output_axes: each kernel's output axes (callable or mapping), overriding ``input_axes``' and what the
      perturbations say (default: the complement of :func:`default_input_axes`, then what the captured gradients
      carry).
    max_rows: output rows per kernel and step folded into its statistics, sampled uniformly (``None``: all);
      the capture's default for the input side.
    memory_share: the share of the memory rule's budget its statistics take (``Statistics(kind='auto')``).
  """
  c = checked(conditioning, "scale_by_output_conditioning")
  if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
    raise ValueError(f"max_rows must be a positive int or None, got {max_rows!r}.")
  c.refresh.refuse_apart("the output side (scale_by_output_conditioning, scsgd_two_sided)",
                         "rebuilds its factors inside its update")
  est = estimator_lib.Estimator(
      c.replace(kernel_filter=output_kernel_filter_from(c.kernel_filter, c.input_axes)),
      layouts=output_axes_from(c.input_axes) if output_axes is None else output_axes,
      default_axes=default_output_axes, memory_share=memory_share)
  inner = transform.conditioning_transform(est)
  row_seed = c.seed + 1  # the key is made in the update: a key made here would leak from a jit building tx

  def update_fn(updates, state, params=None, *, output_grads=None, **extra_args):
    del extra_args
    check_output_grads(output_grads, "scale_by_output_conditioning")
    output_grads = sample_rows(output_grads, jax.random.fold_in(jax.random.PRNGKey(row_seed), state.count), max_rows)
    return inner.update(updates, state, params, layer_inputs=output_grads)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
