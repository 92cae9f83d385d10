"""Argument checks shared by the library's constructors: one place, one wording."""

from __future__ import annotations

import math
from typing import Optional

import jax


def check_float(name: str, value, *, low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False, high_open: bool = False, allow_inf: bool = False) -> None:
  """Raises ``ValueError`` naming ``name`` unless ``value`` is a real number in the interval.

  ``low``/``high`` bound the interval (``None``: unbounded), open at an end with ``low_open`` /
  ``high_open``. NaN is always refused, and so is an infinity unless ``allow_inf``. A traced
  value (``optax.inject_hyperparams`` turns numeric arguments into arrays) is not checked.
  """
  if isinstance(value, jax.core.Tracer):
    return
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a real number, got {value!r}.") from None
  left = "(" if low_open else "["
  right = ")" if high_open else "]"
  where = f"{left}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{right}"
  if not allow_inf and high is None:
    where += " (finite)"
  bad = math.isnan(v) or (math.isinf(v) and not allow_inf)
  bad = bad or (low is not None and (v < low or (low_open and v == low)))
  bad = bad or (high is not None and (v > high or (high_open and v == high)))
  if bad:
    raise ValueError(f"{name} must lie in {where}, got {value!r}.")
