"""The two-sided alias: both sides' conditioning grafted onto a base step's per-layer norm, then Nesterov momentum
(experimental: :mod:`scsgd_jax.contrib`)."""

from __future__ import annotations

from typing import Literal

import optax

from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import transform
from scsgd_jax._src.conditioning import Conditioning
from scsgd_jax._src.conditioning import checked
from scsgd_jax._src.conditioning import refuses_moved_keywords
from scsgd_jax._src.contrib import graft
from scsgd_jax._src.contrib import output

__all__ = ["scsgd_two_sided"]


@refuses_moved_keywords
def scsgd_two_sided(
    learning_rate: optax.ScalarOrSchedule,
    conditioning: Conditioning = Conditioning(),
    *,
    momentum: float = defaults.MOMENTUM,
    magnitude: Literal["rms", "factored", "sign"] = "factored",
    memory_share: float = 1.0,
    graft_decay: float = defaults.GRAFT_DECAY,
    graft_eps: float = defaults.GRAFT_EPS,
) -> optax.GradientTransformationExtraArgs:
  r"""Two-sided sketched conditioning, grafted: :math:`C^{-1/2} G \Delta^{-1/2}` per kernel (input side from the
  layer's inputs, output side from its back-propagated output rows), at the per-layer norm of a base step,
  then Nesterov momentum (Shampoo's grafting layout; rates on Adam's scale)::

    optax.chain(scale_by_grafting(<magnitude>,
                                  optax.chain(scale_by_sketched_conditioning(conditioning, memory_share=memory_share),
                                              scale_by_output_conditioning(conditioning.replace(seed=conditioning.seed + 1),
                                                                           memory_share=memory_share))),
                optax.sgd(learning_rate, momentum=momentum, nesterov=True))

  ``update`` takes ``layer_inputs=`` and ``output_grads=`` (see :func:`output_perturbations_nnx`). Leaves
  neither side conditions (biases, norms) get the grafted base step's direction itself. ``conditioning`` goes to
  both sides (the output side's seed is its ``seed + 1``; it reads each kernel along the axes its ``input_axes``
  leave, :func:`scale_by_output_conditioning`).

  Memory: momentum's float per parameter, plus the base step's state (the default ``'factored'``: ``n + p``
  floats per large kernel), plus each side's statistics, each side within the memory rule's budget of one float
  per parameter (``memory_share=0.5``: half of it each). ``magnitude='sign', memory_share=0.5`` keeps the
  whole state within Adam's two floats per parameter; ``'rms'`` (a float per parameter) takes up to twice Adam's.

  Args:
    learning_rate: the rate (or schedule) of the Nesterov SGD that ends the chain.
    conditioning: both sides' :class:`Conditioning`.
    momentum: Nesterov momentum.
    magnitude: the base step whose per-layer norm the direction takes: ``'factored'``, normalized RMSprop
      with Adafactor's factored second moment (:func:`scale_by_normalized_factored_rms`: ``n + p`` floats for a
      kernel whose two largest axes are at least 128), ``'rms'``, normalized RMSprop itself
      (:func:`scale_by_normalized_rms`, distributed Shampoo's ``RMSPROP_NORMALIZED``; a float per parameter), or
      ``'sign'``, ``optax.scale_by_sign`` (distributed Shampoo's ``SQRT_N``: every layer's step has norm
      :math:`\sqrt{\text{size}}` times the rate; no state).
    memory_share: each side's share of the memory rule's budget (``Statistics(kind='auto')``; ``0.5``: the two
      sides split it).
    graft_decay, graft_eps: normalized RMSprop's (``magnitude='factored'``, whose squares take ``graft_eps**2``,
      or ``'rms'``).
  """
  if not callable(learning_rate):
    checks.check_float("learning_rate", learning_rate, low=0.0)
  checks.check_float("momentum", momentum, low=0.0, high=1.0, high_open=True)
  if magnitude not in ("rms", "factored", "sign"):
    raise ValueError(f"magnitude must be 'rms', 'factored' or 'sign', got {magnitude!r}.")
  c = checked(conditioning, "scsgd_two_sided")
  base = {"rms": lambda: graft.scale_by_normalized_rms(graft_decay, graft_eps),
          "factored": lambda: graft.scale_by_normalized_factored_rms(graft_decay, graft_eps),
          "sign": optax.scale_by_sign}[magnitude]()
  return optax.chain(
      graft.scale_by_grafting(base, optax.chain(
          transform.scale_by_sketched_conditioning(c, memory_share=memory_share),
          output.scale_by_output_conditioning(c.replace(seed=c.seed + 1), memory_share=memory_share))),
      optax.sgd(learning_rate, momentum=momentum, nesterov=True))
