r"""Per-kernel diagnostics: what each conditioner amplifies and what the outlier guard clipped, and how large each
kernel's gradient and step are, as arrays a training loop logs and plots."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from scsgd_jax._src import layout as layout_lib
from scsgd_jax._src import sketch

__all__ = ["kernel_diagnostics", "update_diagnostics"]


def _spectrum(factor: sketch.Factor) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The largest and smallest eigenvalue of ``A^{-1}`` and the tail's ``a^{-1}`` (0 for a full-rank factor)."""
  q, b_inv, a_inv = factor
  if b_inv is None:  # diagonal
    return jnp.max(a_inv), jnp.min(a_inv), jnp.zeros((), a_inv.dtype)
  evals = jnp.linalg.eigvalsh(0.5 * (b_inv + b_inv.T))
  if q is None or q.shape[-1] == q.shape[-2]:  # dense, or k = n: no tail
    return evals[-1], evals[0], jnp.zeros((), evals.dtype)
  return jnp.maximum(evals[-1], a_inv), jnp.minimum(evals[0], a_inv), a_inv


def kernel_diagnostics(state: Any) -> dict[str, dict[str, jax.Array]]:
  r"""Each conditioned kernel's conditioner, summarized for logging (works under ``jit``).

  ``state`` is the state of :func:`scale_by_sketched_conditioning` (or one holding it: a chain's tuple,
  :func:`scsgd_jax.scsgd`'s, :func:`scsgd_jax.scsgd_eigen`'s; the first one found is read). For each kernel path:

  - ``inverse_max``, ``inverse_min``: the largest and smallest eigenvalue of ``A^{-1}`` (the most and least a
    direction of the gradient is amplified; ``A = I`` before the first refresh gives 1 and 1);
  - ``spread``: their ratio, the conditioner's own condition number (at most ``1 / sqrt(eigenvalue_floor)``
    for the floored conditioners);
  - ``tail_inverse``: ``a^{-1}``, applied to the directions the sketch leaves out (0 without a tail);
  - ``clipped_rows``: input rows the outlier guard clipped so far.

  A stacked or grouped kernel gives arrays with one entry per slice.

  >>> import jax.numpy as jnp, scsgd_jax
  >>> tx = scsgd_jax.scsgd(0.1, scsgd_jax.Conditioning(conditioner=scsgd_jax.Conditioner(kind='full')))
  >>> state = tx.init({'dense': {'kernel': jnp.zeros((3, 2))}})
  >>> float(scsgd_jax.kernel_diagnostics(state)['dense/kernel']['spread'])
  1.0
  """
  from scsgd_jax._src.state import ScaleBySketchedConditioningState

  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ScaleBySketchedConditioningState))
           if isinstance(s, ScaleBySketchedConditioningState)]
  if not found:
    raise ValueError("kernel_diagnostics needs the state of scale_by_sketched_conditioning (or of an optimizer "
                     f"built on it: scsgd, scsgd_eigen, a chain holding one); got {type(state).__name__}.")
  inner = found[0]
  out = {}
  for path, factor in inner.factors.items():
    lead = factor.a_inv.ndim - (1 if factor.q is None and factor.b_inv is None else 0)
    spectrum = _spectrum
    for _ in range(lead):  # one entry per slice of a stack or group
      spectrum = jax.vmap(spectrum)
    high, low, tail = spectrum(factor)
    # a kernel reading another's statistics: the rows that kernel folded
    clipped = inner.clipped_rows[inner.factors.index.read(path)]
    out[path] = {"inverse_max": high, "inverse_min": low, "spread": high / jnp.maximum(low, 1e-30),
                 "tail_inverse": tail, "clipped_rows": clipped}
  return out


def update_diagnostics(grads: Any, updates: Any, params: Any,
                       kernel_filter: Optional[Callable[[str, Any], bool]] = None) -> dict[str, dict[str, jax.Array]]:
  r"""Each kernel's gradient and step, summarized for logging beside :func:`kernel_diagnostics` (under ``jit``).

  For each kernel path (``kernel_filter``, default :func:`default_kernel_filter`; the names the conditioning's
  state uses): ``grad_norm`` ``|G|``, ``update_norm`` ``|U|`` (``updates``: what ``tx.update`` returned, the
  change ``optax.apply_updates`` makes), ``param_norm`` ``|W|`` and ``relative_step`` ``|U| / |W|`` (0 for a zero
  kernel): Frobenius norms. A layer whose relative step runs far above the others' is the one a rate too high
  blows up first.

  >>> import jax.numpy as jnp, scsgd_jax
  >>> w = {'dense': {'kernel': jnp.ones((2, 2))}}
  >>> d = scsgd_jax.update_diagnostics(w, {'dense': {'kernel': 0.1 * jnp.ones((2, 2))}}, w)
  >>> round(float(d['dense/kernel']['relative_step']), 6)
  0.1
  """
  keep = kernel_filter or layout_lib.default_kernel_filter
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  grads, updates = treedef.flatten_up_to(grads), treedef.flatten_up_to(updates)
  out = {}
  for (path, w), g, u in zip(flat, grads, updates):
    name = layout_lib.path_to_str(path)
    if not keep(name, w):
      continue
    norm = lambda x: jnp.linalg.norm(jnp.ravel(x).astype(jnp.float32))
    w_norm, u_norm = norm(w), norm(u)
    out[name] = {"grad_norm": norm(g), "update_norm": u_norm, "param_norm": w_norm,
                 "relative_step": jnp.where(w_norm > 0, u_norm / jnp.where(w_norm > 0, w_norm, 1.0), 0.0)}
  return out
