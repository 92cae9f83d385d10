"""The experiments' flat names for the library's options: a sub-config sets ``update_every`` or ``ema_rate``
(``--config.optimizer.scsgd.update_every=10``) where the library takes
``Conditioning(refresh=Refresh(every=10))``. The library's table (``Conditioning.FLAT_NAMES``) says where each name
lives and ``Conditioning.from_flat`` reads them; records keep the flat names, so a row run before the options
became objects reads as one run after.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import scsgd_jax

#: flat name -> (the library's option, its field): the library's own table
FLAT = scsgd_jax.Conditioning.FLAT_NAMES
OPTIONS = {"statistics": scsgd_jax.Statistics, "refresh": scsgd_jax.Refresh, "conditioner": scsgd_jax.Conditioner}
# the Conditioning's fields a sub-config holds under their own names (beside the flat names of its options)
OWN = ("rank", "kernel_filter", "input_axes", "axis_name", "seed")


def _resolved_type(option: str, field: str) -> type:
  value = OPTIONS[option]().resolved()[field]
  return type(value)


def takes_options(params) -> bool:
  """Whether a function with these parameters takes the library's :class:`scsgd_jax.Conditioning`."""
  return any(isinstance(p.default, scsgd_jax.Conditioning) for p in params.values())


# the eigenbasis reads the conditioner's eigenvectors alone, and refuses the settings that move only its eigenvalues
READS_EIGENVECTORS = (scsgd_jax.scsgd_eigen, scsgd_jax.scsgd_eigen_muon, scsgd_jax.scale_by_eigenbasis_adam)


def flat_parameters(fn, params) -> list[inspect.Parameter]:
  """``params`` of ``fn`` with its ``conditioning`` argument replaced by the settings ``fn`` reads: the
  Conditioning's own fields and its options' fields under their flat names (keyword-only, the field's default,
  an option's annotated with the type of its resolved value)."""
  refused = scsgd_jax.Conditioner.EIGENVALUES_ONLY if fn in READS_EIGENVECTORS else ()
  out = []
  for name, p in params.items():
    if not isinstance(p.default, scsgd_jax.Conditioning):
      out.append(p)
      continue
    fields = {f.name: f for f in dataclasses.fields(scsgd_jax.Conditioning)}
    option_defaults = {(o, f.name): f.default for o, cls in OPTIONS.items() for f in dataclasses.fields(cls)}
    out.append(inspect.Parameter("rank", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[int]))
    for flat, (option, field) in FLAT.items():
      if flat not in refused:
        out.append(inspect.Parameter(flat, inspect.Parameter.KEYWORD_ONLY, default=option_defaults[option, field],
                                     annotation=_resolved_type(option, field)))
    out += [inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY, default=fields[f].default,
                              annotation=fields[f].type) for f in OWN[1:]]
  return out


def conditioning(kwargs: dict[str, Any], **own) -> tuple[scsgd_jax.Conditioning, dict[str, Any]]:
  """``(Conditioning, the rest of kwargs)``: the settings of ``kwargs`` that are the Conditioning's (its fields, its
  options' flat names: :meth:`scsgd_jax.Conditioning.from_flat`), with ``own`` (e.g. ``seed=``)."""
  mine = {k: v for k, v in kwargs.items() if k in FLAT or k in OWN or k in OPTIONS}
  return scsgd_jax.Conditioning.from_flat(**mine, **own), {k: v for k, v in kwargs.items() if k not in mine}


def resolved(flat: dict[str, Any]) -> dict[str, Any]:
  """The flat settings ``flat`` (its values left ``None`` for the library's defaults) as they run: every flat name
  and ``rank`` written out, as the options' ``resolved()`` say."""
  c = scsgd_jax.Conditioning.from_flat(**{k: v for k, v in flat.items() if v is not None and k in FLAT})
  rank = c.sketch_rank() if flat.get("rank") is None else flat["rank"]
  out = dict(flat, rank=rank)
  for name, (option, field) in FLAT.items():
    obj = getattr(c, option)
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
