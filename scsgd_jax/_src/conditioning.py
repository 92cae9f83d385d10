"""The conditioning's settings as one frozen object, checked in one place: what every alias and transformation of
the library takes as its ``conditioning`` argument, and the shape the settings keep from the alias to the plans."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Hashable, Optional

from scsgd_jax._src import defaults
from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import options
from scsgd_jax._src import statistics as stats_lib

__all__ = ["Conditioning"]


@dataclasses.dataclass(frozen=True)
class Conditioning:
  r"""How the kernels' gradients are conditioned on their inputs (Gonen & Shalev-Shwartz, Section 3): one argument
  of :func:`scsgd`, :func:`scsgd_eigen`, :func:`scsgd_eigen_muon` and the ``scale_by_*`` transformations.

  Attributes:
    rank: sketch rank ``k`` (``None``: the library's default, 32; :meth:`sketch_rank`). A plan below a rank given
      here is warned of.
    statistics: how ``C`` is kept, a :class:`Statistics` (its kind, EMA rate, fold period, outlier guard, sketch,
      memory rule), or a :class:`~scsgd_jax.sketch.CorrelationStatistics` of your own (held as
      ``Statistics(kind=it)``).
    refresh: when the conditioner is rebuilt, a :class:`Refresh` (period, staggering, warm start, apart).
    conditioner: what is built, a :class:`Conditioner` (full or sketched, eigenvalue floor, normalization).
    kernel_filter: ``(path, leaf) -> bool`` selecting the conditioned leaves (default: Flax's kernels and
      embeddings, and the matrices ``input_axes`` names, :func:`default_kernel_filter`).
    input_axes: each kernel's layout, a callable ``(path, leaf) -> axes`` or a mapping ``{path: axes | Layout |
      Plain}`` (e.g. :func:`scsgd_jax.input_axes_nnx` of the model), read by ``init``, which otherwise sees only
      the parameters and reads a kernel by :func:`default_input_axes`. Plans are fixed at ``init``: an update
      whose captured layers read a kernel otherwise is refused, naming the kernel and this fix.
    axis_name: under ``jax.pmap`` or ``shard_map`` with a data-parallel axis, its name: the folded statistics are
      averaged over it (``lax.pmean``). Not needed under ``jit`` with sharded arrays (the rows are global there).
    seed: seed of the PRNG key kept in the state (the sketches and the row sampling).

  Example:
    >>> import scsgd_jax
    >>> c = scsgd_jax.Conditioning(rank=16, refresh=scsgd_jax.Refresh(every=20))
    >>> c.sketch_rank(), c.refresh.every
    (16, 20)
  """

  # the options' fields by flat name, {name: (option, field)}: what :meth:`from_flat` takes beside the own fields
  FLAT_NAMES: ClassVar[dict[str, tuple[str, str]]] = options.FLAT

  rank: Optional[int] = None
  statistics: options.StatisticsOption = options.Statistics()
  refresh: options.Refresh = options.Refresh()
  conditioner: options.Conditioner = options.Conditioner()
  kernel_filter: Optional[Callable[[str, Any], bool]] = None
  input_axes: layout_lib.InputAxes = None
  axis_name: Optional[Hashable] = None
  seed: int = 0

  def __post_init__(self):
    if self.rank is not None:
      options.static_int("Conditioning.rank", self.rank, 1)
    object.__setattr__(self, "statistics", _checked_options(self))
    if self.kernel_filter is not None and not callable(self.kernel_filter):
      raise TypeError(
          f"Conditioning.kernel_filter must be a callable (path, leaf) -> bool, got {self.kernel_filter!r}.")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise TypeError(f"Conditioning.seed must be an int, got {self.seed!r}.")

  @classmethod
  def from_flat(cls, **settings) -> "Conditioning":
    """A Conditioning from flat settings, as command-line configs keep them: its own fields by name, and its
    options' fields by their flat names (:attr:`FLAT_NAMES`: ``ema_rate``, ``update_every``, ...;
    ``statistics=`` and ``conditioner=`` name a kind, or pass the option itself).

    Example:
      >>> import scsgd_jax
      >>> c = scsgd_jax.Conditioning.from_flat(rank=8, update_every=10, statistics='dense')
      >>> c.refresh.every, c.statistics.kind
      (10, 'dense')
    """
    objects = {k: v for k, v in settings.items()
               if k in options.OPTIONS and isinstance(v, (*options.OPTIONS.values(), stats_lib.CorrelationStatistics))}
    unknown = sorted(k for k in settings if k not in FIELDS and k not in cls.FLAT_NAMES)
    if unknown:
      raise TypeError(f"Conditioning.from_flat takes its fields {list(FIELDS)} and the flat names "
                      f"{sorted(cls.FLAT_NAMES)}, not {unknown}.")
    fields: dict[str, dict] = {}
    for name, value in settings.items():
      if name in cls.FLAT_NAMES and name not in objects:
        option, field = cls.FLAT_NAMES[name]
        if option in objects:
          raise TypeError(f"Conditioning.from_flat got {option}= as an option object and {name}= beside it: set "
                          f"{field}= on the object.")
        fields.setdefault(option, {})[field] = value
    own = {k: v for k, v in settings.items() if k in FIELDS and k not in options.OPTIONS}
    return cls(**own, **objects, **{o: options.OPTIONS[o](**given) for o, given in fields.items()})

  def __repr__(self) -> str:
    """The settings that differ from the defaults (``Conditioning()`` for none)."""
    changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
               if getattr(self, f.name) is not f.default and getattr(self, f.name) != f.default]
    return f"Conditioning({', '.join(changed)})"

  def sketch_rank(self) -> int:
    """The rank as it runs: :attr:`rank`, or the library's default."""
    return defaults.RANK if self.rank is None else int(self.rank)

  def kernels(self) -> Callable[[str, Any], bool]:
    """The filter of the kernels conditioned (:func:`kernels_of`: :attr:`kernel_filter`, or the default and the
    matrices an ``input_axes`` mapping names)."""
    return layout_lib.kernels_of(self.kernel_filter, self.input_axes)

  def replace(self, **changes) -> "Conditioning":
    """A copy with ``changes`` (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


def _checked_options(c: "Conditioning") -> options.Statistics:
  """``c.statistics`` as a :class:`Statistics` (a bare ``CorrelationStatistics`` is ``Statistics(kind=it)``), after
  refusing, naming the arguments, a combination of options that cannot run or where one would do nothing."""
  statistics, refresh, conditioner = c.statistics, c.refresh, c.conditioner
  for name, value, kind in (("statistics", statistics, (options.Statistics, stats_lib.CorrelationStatistics)),
                            ("refresh", refresh, options.Refresh), ("conditioner", conditioner, options.Conditioner)):
    if not isinstance(value, kind):
      hint = {"statistics": "scsgd_jax.Statistics(kind=...)", "refresh": "scsgd_jax.Refresh(every=...)",
              "conditioner": "scsgd_jax.Conditioner(kind=...)"}[name]
      raise TypeError(f"{name} must be a {hint}, got {value!r}.")
  statistics = options.as_statistics(statistics)
  if statistics.custom:
    if conditioner.eigenvalue_floor != defaults.EIGENVALUE_FLOOR:
      raise ValueError(
          "statistics= is a CorrelationStatistics, which carries its own floor; ['Conditioner.eigenvalue_floor'] "
          "would do nothing beside it: set it on the statistics object (e.g. scsgd_jax.sketch.ema_correlation(rate, "
          "eigenvalue_floor=...)).")
    return statistics
  kind = statistics.kind
  if conditioner.kind == "full" and kind in ("streaming", "diagonal"):
    raise ValueError(f"Conditioner(kind='full') needs the dense C: it cannot run on Statistics(kind={kind!r}).")
  if conditioner.kind == "full":  # every kernel keeps the dense C and gets the full C^(1/2): no sketch, no choice
    options.refuse(f"Conditioner(kind='full') on Statistics(kind={kind!r}) (every kernel keeps the dense C and its "
                   "full C^(1/2): no sketch runs and the memory rule chooses nothing)",
                   {"Statistics.oversample": statistics.oversample,
                    "Statistics.power_iterations": statistics.power_iterations, "Statistics.budget": statistics.budget})
  if kind in ("streaming", "diagonal"):
    options.refuse(f"Conditioner on Statistics(kind={kind!r}) (the size rule picks the full C^(1/2) where the dense C "
                   "is kept)", {"Conditioner.full_max_dim": conditioner.full_max_dim})
  return statistics


def checked(conditioning, who: str) -> Conditioning:
  """``conditioning`` if it is a :class:`Conditioning`, else a ``TypeError`` naming ``who`` and the fix (an int is a
  rank passed where the conditioning now goes)."""
  if isinstance(conditioning, Conditioning):
    return conditioning
  hint = (f" (a rank? pass scsgd_jax.Conditioning(rank={conditioning!r}))"
          if isinstance(conditioning, int) and not isinstance(conditioning, bool) else "")
  raise TypeError(f"{who}'s conditioning must be a scsgd_jax.Conditioning(...), got {conditioning!r}{hint}.")


# the settings that were keywords of the aliases and transformations, and where each one went: a field of
# Conditioning, or a field of one of its options
FIELDS = tuple(f.name for f in dataclasses.fields(Conditioning))


def _moved(name: str) -> Optional[str]:
  if name in FIELDS:
    return f"scsgd_jax.Conditioning({name}=...)"
  if name in options.FLAT:
    option, field = options.FLAT[name]
    return f"scsgd_jax.Conditioning({option}=scsgd_jax.{options.OPTIONS[option].__name__}({field}=...))"
  return None


def refuses_moved_keywords(fn):
  """``fn``, refusing in one line a keyword that is now a setting of :class:`Conditioning` (Python's own error would
  not say where it went)."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    moved = [k for k in kwargs if _moved(k)]
    if moved:
      raise TypeError(f"{fn.__name__}() takes no {', '.join(moved)}: the conditioning's settings are one argument, "
                      + "; ".join(f"{k} is {_moved(k)}" for k in moved) + ", passed as conditioning=.")
    return fn(*args, **kwargs)

  return wrapper
