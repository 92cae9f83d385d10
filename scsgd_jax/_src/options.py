"""The conditioning's options, as objects that carry and check their own settings (lineax's way).

:class:`Statistics` says how each kernel's input correlation ``C`` is estimated and kept, :class:`Refresh` when its
conditioner is rebuilt, :class:`Conditioner` what is built from it. Each refuses at construction a setting its
choice would not read; :func:`checked_together` refuses the combinations that cannot run. An integer left ``None``
takes the library's default (:meth:`resolved` says which), so that a default is written in one place,
``defaults.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional, Union

import jax
import numpy as np

from scsgd_jax._src import checks
from scsgd_jax._src import defaults
from scsgd_jax._src import statistics as stats_lib

__all__ = ["Conditioner", "Refresh", "Statistics"]

StatisticsKind = Literal["auto", "dense", "streaming", "diagonal"]


def static_int(name: str, value, minimum: int) -> int:
  """A shape-deciding integer: a Python int ``>= minimum``, or an error naming ``name``."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and not isinstance(value, np.integer):
    raise ValueError(
        f"{name} decides shapes or the compiled schedule and must be a Python int, got an array ({value!r}).")
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
  return int(value)


def _choice(name: str, value, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")


def _flag(name: str, value) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {value!r}.")


def refuse(owner: str, unread: dict) -> None:
  """Refuses, naming ``owner``, the settings of ``unread`` that were given (not ``None``)."""
  given = {k: v for k, v in unread.items() if v is not None}
  if given:
    raise ValueError(f"{owner} does not read {given}: leave {'it' if len(given) == 1 else 'them'} out.")


@dataclasses.dataclass(frozen=True)
class Statistics:
  r"""How each kernel's input correlation :math:`C = E[x x^\top]` is estimated and kept.

  ``kind='auto'`` (default) picks per kernel, best first, the dense ``C``, a streaming sketch
  :math:`C \Omega` at the rank, at each smaller rank, or the diagonal, whichever fits the memory rule: the
  kernel's statistics, factor and what the optimizer keeps beside them within Adam's second moment of the
  kernel (``budget='kernel'``), or within the model's (``budget='model'``, default: the leftover of small
  kernels goes to the kernels of smallest ``n``, the same layer of each block alike). Embeddings keep the exact diagonal
  of their token counts.
  ``'dense'``, ``'streaming'`` and ``'diagonal'`` give every kernel that kind; a
  :class:`~scsgd_jax.sketch.CorrelationStatistics` of your own gives every kernel that (it carries its own rate,
  sketch, prior and floor, so those settings are refused beside it; the fold period and the outlier guard act).
  ``state.summary()`` says what each kernel got.

  Attributes:
    kind: ``'auto'``, ``'dense'``, ``'streaming'``, ``'diagonal'`` or a ``CorrelationStatistics``.
    ema_rate: :math:`\nu \in (0, 1]`, the EMA weight of a new batch per step.
    fold_every: fold the captured rows every this many steps (default 2: half the fold's cost; a fold weighs its
      batch :math:`1 - (1 - \nu)^s`, so the average spans as many steps).
    outlier_threshold: rows whose squared norm exceeds this multiple (``>= 1``) of the running ``tr C`` are
      clipped before they enter the statistics (``inf``: no guard).
    oversample: sketch columns beyond the rank (default 10); not read by ``'diagonal'``.
    power_iterations: the dense ``C``'s range finder's power iterations (default 1); read by ``'dense'`` and
      ``'auto'`` only.
    budget: the memory rule's reach, ``'model'`` (default) or ``'kernel'``; read by ``'auto'`` only.
  """

  kind: Union[StatisticsKind, stats_lib.CorrelationStatistics] = "auto"
  ema_rate: float = defaults.EMA_RATE
  fold_every: int = defaults.STATISTICS_EVERY
  outlier_threshold: float = defaults.OUTLIER_THRESHOLD
  oversample: Optional[int] = None
  power_iterations: Optional[int] = None
  budget: Optional[Literal["model", "kernel"]] = None

  def __post_init__(self):
    static_int("Statistics.fold_every", self.fold_every, 1)
    checks.check_float("Statistics.outlier_threshold", self.outlier_threshold, low=1.0, allow_inf=True)
    if self.custom:
      self._check_custom()
      return
    _choice("Statistics.kind", self.kind, ("auto", "dense", "streaming", "diagonal"))
    checks.check_float("Statistics.ema_rate", self.ema_rate, low=0.0, high=1.0, low_open=True)
    if self.oversample is not None:
      static_int("Statistics.oversample", self.oversample, 0)
    if self.power_iterations is not None:
      static_int("Statistics.power_iterations", self.power_iterations, 0)
    if self.budget is not None:
      _choice("Statistics.budget", self.budget, ("model", "kernel"))
    where = f"Statistics(kind={self.kind!r})"
    if self.kind != "auto":
      refuse(where + " (the memory rule is auto's)", {"budget": self.budget})
    if self.kind in ("streaming", "diagonal"):
      refuse(where + " (power iterations run on the dense C alone)", {"power_iterations": self.power_iterations})
    if self.kind == "diagonal":
      refuse(where + " (it keeps no sketch)", {"oversample": self.oversample})

  @property
  def custom(self) -> bool:
    """Whether ``kind`` is a ``CorrelationStatistics`` of the user's."""
    return isinstance(self.kind, stats_lib.CorrelationStatistics)

  def _check_custom(self) -> None:
    carried = {"ema_rate": None if self.ema_rate == defaults.EMA_RATE else self.ema_rate,
               "oversample": self.oversample, "power_iterations": self.power_iterations, "budget": self.budget}
    refuse("Statistics(kind=<a CorrelationStatistics>) (it carries its own rate and sketch; the memory rule is "
            "auto's)", carried)

  def resolved(self) -> dict:
    """Every setting as it runs: ``None`` replaced by the library's default."""
    return dict(dataclasses.asdict(self),
                oversample=defaults.OVERSAMPLE if self.oversample is None else self.oversample,
                power_iterations=defaults.POWER_ITERATIONS if self.power_iterations is None else self.power_iterations,
                budget=self.budget or defaults.BUDGET)


@dataclasses.dataclass(frozen=True)
class Refresh:
  """When each kernel's conditioner is rebuilt from its statistics.

  Attributes:
    every: the period ``N`` in steps (default 50, the paper's).
    stagger: spread the kernels' refreshes over the period (so that a step refreshes few of them).
    warm_start: bias-corrected statistics and refreshes after 1, 2, 4, ... folds before the period takes over;
      ``False``: the paper's ``C_0 = I`` and refreshes every ``every`` steps from step 0.
    apart: the refreshes leave the training step for a program of their own,
      :func:`scsgd_jax.refresh_conditioners`, which the training loop calls after every update: it rebuilds the
      factors due then (on the schedule above), so the step only folds and conditions and compiles without the
      factorizations. A factor rebuilt after update ``t`` conditions from update ``t + 1`` on (in the step, from
      update ``t``), so the first update, before any factor exists, takes the identity conditioner (plain SGD at
      this rate for one step) unless :func:`scsgd_jax.refresh_conditioners` primes it with its inputs. The input side's conditioning only (:func:`scsgd_jax.scsgd`,
      :func:`scsgd_jax.scale_by_sketched_conditioning`); the eigenbasis and the output side refuse it.
  """

  every: int = defaults.UPDATE_EVERY
  stagger: bool = True
  warm_start: bool = True
  apart: bool = False

  def __post_init__(self):
    static_int("Refresh.every", self.every, 1)
    _flag("Refresh.stagger", self.stagger)
    _flag("Refresh.warm_start", self.warm_start)
    _flag("Refresh.apart", self.apart)

  def refuse_apart(self, who: str, why: str) -> None:
    """Refuses ``apart`` for ``who``, a transformation whose refresh cannot leave its update (``why``)."""
    if self.apart:
      raise ValueError(f"Refresh(apart=True) is for the input side's conditioning only (scsgd, "
                       f"scale_by_sketched_conditioning); {who} {why}. Use Refresh(apart=False).")

  def resolved(self) -> dict:
    """Every setting as it runs."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Conditioner:
  r"""What is built from the statistics: :math:`A^{-1} = Q B^{-1} Q^\top + a^{-1} (I - Q Q^\top)`.

  Attributes:
    kind: ``'full'`` (:math:`A = C^{1/2}`, the paper's Theorem 1; needs the dense ``C``), ``'sketched'``
      (Algorithm 1, rank ``k``) or ``'auto'`` (full where the dense ``C`` is kept and ``n <= full_max_dim``).
    full_max_dim: ``n`` up to which ``'auto'`` builds the full conditioner (default ``4 * rank``); ``'auto'`` only.
    eigenvalue_floor: eigenvalues below this multiple (in ``[0, 1]``) of ``tr(C) / n`` are raised to it (default
      1e-2: no direction amplified more than 10x the average scale).
    normalize: the kernels conditioned by ``C / (tr C / n)``, whose step then scales with the inputs as SGD's:
      ``'embeddings'`` (default; one-hot inputs, whose ``tr C / n`` is ``1 / vocab``), ``'all'`` (one rate that
      fits SGD fits every layer) or ``'none'`` (the paper's ``A`` everywhere).
  """

  # the settings that move only the conditioner's eigenvalues (the eigenbasis, reading its eigenvectors, refuses them)
  EIGENVALUES_ONLY: ClassVar[tuple[str, ...]] = ("eigenvalue_floor", "normalize")

  kind: Literal["auto", "sketched", "full"] = "auto"
  full_max_dim: Optional[int] = None
  eigenvalue_floor: float = defaults.EIGENVALUE_FLOOR
  normalize: Literal["none", "embeddings", "all"] = defaults.NORMALIZE

  def __post_init__(self):
    _choice("Conditioner.kind", self.kind, ("auto", "sketched", "full"))
    if self.full_max_dim is not None:
      static_int("Conditioner.full_max_dim", self.full_max_dim, 0)
    if self.kind != "auto":
      refuse(f"Conditioner(kind={self.kind!r}) (the size rule is auto's)", {"full_max_dim": self.full_max_dim})
    checks.check_float("Conditioner.eigenvalue_floor", self.eigenvalue_floor, low=0.0, high=1.0)
    _choice("Conditioner.normalize", self.normalize, ("none", "embeddings", "all"))

  def resolved(self, rank: Optional[int] = None) -> dict:
    """Every setting as it runs at sketch rank ``rank`` (``None``: the library's default, 32), and that rank."""
    rank = defaults.RANK if rank is None else rank
    limit = defaults.FULL_MAX_DIM_PER_RANK * rank if self.full_max_dim is None else self.full_max_dim
    return dict(dataclasses.asdict(self), full_max_dim=limit, rank=rank)


StatisticsOption = Union[Statistics, stats_lib.CorrelationStatistics]


def as_statistics(statistics: StatisticsOption) -> Statistics:
  """``statistics`` as a :class:`Statistics` (a bare ``CorrelationStatistics`` is ``Statistics(kind=it)``)."""
  return Statistics(kind=statistics) if isinstance(statistics, stats_lib.CorrelationStatistics) else statistics


# the flat names of the options' fields (the keywords of earlier releases, and what command-line configs keep): the
# option and field each is (one table: Conditioning.from_flat and the refusal of a flat keyword read it)
FLAT = {
    "statistics": ("statistics", "kind"), "conditioner": ("conditioner", "kind"),
    "ema_rate": ("statistics", "ema_rate"), "statistics_every": ("statistics", "fold_every"),
    "outlier_threshold": ("statistics", "outlier_threshold"), "oversample": ("statistics", "oversample"),
    "power_iterations": ("statistics", "power_iterations"), "budget": ("statistics", "budget"),
    "update_every": ("refresh", "every"), "stagger": ("refresh", "stagger"), "warm_start": ("refresh", "warm_start"),
    "full_max_dim": ("conditioner", "full_max_dim"), "eigenvalue_floor": ("conditioner", "eigenvalue_floor"),
    "normalize": ("conditioner", "normalize"),
}
OPTIONS = {"statistics": Statistics, "refresh": Refresh, "conditioner": Conditioner}
