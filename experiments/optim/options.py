"""The experiments' flat names for the library's options: a sub-config sets ``update_every`` or ``ema_rate``
(``--config.optimizer.scsgd.update_every=10``) where the library takes ``refresh=Refresh(every=10)`` or
``statistics=Statistics(ema_rate=...)``. One table, :data:`FLAT`, says where each name lives; records keep the
flat names, so a row run before the options became objects reads as one run after.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import scsgd_jax

#: flat name -> (the library's argument, its option's field)
FLAT = {
    "statistics": ("statistics", "kind"),
    "ema_rate": ("statistics", "ema_rate"),
    "statistics_every": ("statistics", "every"),
    "outlier_threshold": ("statistics", "outlier_threshold"),
    "oversample": ("statistics", "oversample"),
    "power_iterations": ("statistics", "power_iterations"),
    "budget": ("statistics", "budget"),
    "update_every": ("refresh", "every"),
    "stagger": ("refresh", "stagger"),
    "warm_start": ("refresh", "warm_start"),
    "conditioner": ("conditioner", "kind"),
    "full_max_dim": ("conditioner", "full_max_dim"),
    "eigenvalue_floor": ("conditioner", "eigenvalue_floor"),
    "normalize": ("conditioner", "normalize"),
}
OPTIONS = {"statistics": scsgd_jax.Statistics, "refresh": scsgd_jax.Refresh, "conditioner": scsgd_jax.Conditioner}


def _resolved_type(option: str, field: str) -> type:
  value = OPTIONS[option]().resolved()[field]
  return type(value)


def takes_options(params) -> bool:
  """Whether a function with these parameters takes the library's options."""
  return any(isinstance(p.default, tuple(OPTIONS.values())) for p in params.values())


# the eigenbasis reads the conditioner's eigenvectors alone, and refuses the settings that move only its eigenvalues
EIGENVALUES_ONLY = ("eigenvalue_floor", "normalize")
READS_EIGENVECTORS = (scsgd_jax.scsgd_eigen, scsgd_jax.scsgd_eigen_muon, scsgd_jax.scale_by_eigenbasis_adam)


def flat_parameters(fn, params) -> list[inspect.Parameter]:
  """``params`` of ``fn`` with each option argument replaced by the fields ``fn`` reads, under their flat names
  (keyword-only, the field's default, annotated with the type of its resolved value)."""
  refused = EIGENVALUES_ONLY if fn in READS_EIGENVECTORS else ()
  out = []
  for name, p in params.items():
    if not isinstance(p.default, tuple(OPTIONS.values())):
      out.append(p)
      continue
    defaults = {f.name: f.default for f in dataclasses.fields(p.default)}
    for flat, (option, field) in FLAT.items():
      if option == name and flat not in refused:
        out.append(inspect.Parameter(flat, inspect.Parameter.KEYWORD_ONLY, default=defaults[field],
                                     annotation=_resolved_type(option, field)))
  return out


def grouped(kwargs: dict[str, Any]) -> dict[str, Any]:
  """``kwargs`` with its flat names gathered into the library's option objects (only those given; an option object
  given under its argument's name passes as it is; a ``CorrelationStatistics`` as ``statistics`` is its kind)."""
  out = {k: v for k, v in kwargs.items() if k not in FLAT or isinstance(v, tuple(OPTIONS.values()))}
  fields: dict[str, dict] = {}
  for flat, (option, field) in FLAT.items():
    if flat in kwargs and flat not in out:
      fields.setdefault(option, {})[field] = kwargs[flat]
  out.update({option: OPTIONS[option](**given) for option, given in fields.items()})
  return out


def resolved(flat: dict[str, Any]) -> dict[str, Any]:
  """The flat settings ``flat`` (its values left ``None`` for the library's defaults) as they run: every flat name
  and ``rank`` written out, as the options' ``resolved()`` say."""
  given = grouped({k: v for k, v in flat.items() if v is not None and k in FLAT})
  rank = scsgd_jax.Conditioner().resolved(flat.get("rank"))["rank"]
  out = dict(flat, rank=rank)
  for name, (option, field) in FLAT.items():
    obj = given.get(option) or OPTIONS[option]()
    out[name] = (obj.resolved(rank) if option == "conditioner" else obj.resolved())[field]
  return out


def with_refresh_apart(kwargs: dict[str, Any]) -> dict[str, Any]:
  """``kwargs`` (flat names) with the refresh as the option object ``Refresh(apart=True)`` on the schedule its flat
  names say (``scsgd_jax.refresh_conditioners`` then rebuilds the factors, apart from the step)."""
  r = resolved(kwargs)
  out = {k: v for k, v in kwargs.items() if FLAT.get(k, ("",))[0] != "refresh"}
  out["refresh"] = scsgd_jax.Refresh(every=r["update_every"], stagger=r["stagger"], warm_start=r["warm_start"],
                                     apart=True)
  return out
