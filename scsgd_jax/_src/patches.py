"""Input rows of a layer in its kernel's input order: im2col for convolutions.

A Flax conv kernel ``(*window, cin, cout)`` acts as the matrix
``(prod(window) * cin, cout)``; the row of an output position is the input
patch flattened in that same order (window positions row-major, channels
last). Note that ``lax.conv_general_dilated_patches`` orders features
channel-major and so does *not* match this layout; we gather explicitly.

Only sampled positions are gathered, so the cost is ``O(rows * n)``, not
``O(all positions * n)``.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["conv_patch_rows", "dense_rows", "sample_rows"]


def stream_key(key: jax.Array, index: int = 0) -> jax.Array:
  """The ``uint32[4]`` Philox key of stream ``index`` of ``key`` (a typed or raw JAX key): distinct streams
  for the layers of one capture, made by arithmetic, not a threefry hash per layer."""
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  data = jnp.ravel(data).astype(jnp.uint32)
  data = jnp.concatenate([data, jnp.zeros((max(4 - data.shape[0], 0),), jnp.uint32)])[:4]
  return data.at[2].add(jnp.uint32(index))


def uniform_indices(key: jax.Array, count: int, total: int) -> jax.Array:
  """``count`` indices drawn uniformly, with replacement, from ``range(total)`` (``total < 2**32``).

  Philox bits (``lax.rng_bit_generator``), the same on every backend: per captured layer it compiles in a
  fraction of the time of ``jax.random.randint``'s threefry rounds; the modulo's bias is below
  ``total / 2**32``."""
  bits = jax.lax.rng_bit_generator(stream_key(key), (count,), jnp.uint32,
                                   algorithm=jax.lax.RandomAlgorithm.RNG_PHILOX)[1]
  return (bits % jnp.uint32(total)).astype(jnp.int32)


def sample_rows(rows: jax.Array, max_rows: int | None, key: jax.Array | None) -> jax.Array:
  """At most ``max_rows`` rows of ``rows`` (``(m, n)``), uniformly with replacement."""
  m = rows.shape[0]
  if max_rows is None or m <= max_rows:
    return rows
  if key is None:
    raise ValueError(f"sampling {max_rows} of {m} rows needs a PRNG key; pass rng=... to the capture helper.")
  idx = uniform_indices(key, max_rows, m)
  return rows[idx]


def dense_rows(x: jax.Array, max_rows: int | None = None, key: jax.Array | None = None) -> jax.Array:
  """Rows ``(m, n)`` of a Dense layer input ``(..., n)``."""
  return sample_rows(x.reshape(-1, x.shape[-1]), max_rows, key)


def _explicit_padding(padding, in_spatial, window, strides, dilation):
  if isinstance(padding, str):
    name = padding.upper()
    if name not in ("SAME", "VALID"):
      raise NotImplementedError(
          f"padding={padding!r} is not supported for conv input statistics (only 'SAME', 'VALID' and explicit pads)."
      )
    eff = [(w - 1) * d + 1 for w, d in zip(window, dilation)]
    return jax.lax.padtype_to_pads(in_spatial, eff, strides, name)
  if isinstance(padding, int):
    return [(padding, padding)] * len(window)
  pads = []
  for p in padding:
    pads.append((p, p) if isinstance(p, int) else tuple(p))
  if len(pads) != len(window):
    raise ValueError(f"padding {padding!r} has {len(pads)} entries for a {len(window)}-d window.")
  return pads


def conv_patch_rows(
    x: jax.Array,
    window: Sequence[int],
    *,
    strides: Sequence[int] | int = 1,
    padding="VALID",
    dilation: Sequence[int] | int = 1,
    max_rows: int | None = None,
    key: jax.Array | None = None,
) -> jax.Array:
  """im2col rows of an N-d convolution input, in Flax kernel order.

  Args:
    x: input ``(*batch, *spatial, cin)`` (channels last, as Flax).
    window: kernel spatial size.
    strides, padding, dilation: as the layer's ``strides``, ``padding``,
      ``kernel_dilation``.
    max_rows: if given, rows are gathered for this many output positions drawn
      uniformly (with replacement); else for all of them.
    key: PRNG key for the draw.

  Returns:
    ``(rows, prod(window) * cin)``.
  """
  d = len(window)
  strides = (strides,) * d if isinstance(strides, int) else tuple(strides)
  dilation = (dilation,) * d if isinstance(dilation, int) else tuple(dilation)
  spatial = x.shape[-d - 1:-1]
  cin = x.shape[-1]
  x = x.reshape((-1, *spatial, cin))
  batch = x.shape[0]
  pads = _explicit_padding(padding, spatial, window, strides, dilation)
  x = jnp.pad(x, [(0, 0), *pads, (0, 0)])
  padded = x.shape[1:-1]
  out = [(p - (w - 1) * dl - 1) // s + 1 for p, w, dl, s in zip(padded, window, dilation, strides)]
  if any(o <= 0 for o in out):
    raise ValueError(f"conv window {tuple(window)} does not fit the padded input {tuple(padded)}.")
  total = batch * int(np.prod(out))
  if max_rows is None or total <= max_rows:
    grids = np.meshgrid(np.arange(batch), *[np.arange(o) for o in out], indexing="ij")
    pos = [jnp.asarray(g.reshape(-1)) for g in grids]
  else:
    if key is None:
      raise ValueError(f"sampling {max_rows} of {total} patches needs a PRNG key; pass rng=... to the capture helper.")
    flat = uniform_indices(key, max_rows, total)
    pos = list(jnp.unravel_index(flat, (batch, *out)))
  b, centers = pos[0], pos[1:]
  offsets = np.array(list(itertools.product(*[range(w) for w in window])))  # (W, d), row-major
  idx = [b[:, None]]
  for i in range(d):
    idx.append(centers[i][:, None] * strides[i] + jnp.asarray(offsets[:, i] * dilation[i])[None, :])
  patches = x[tuple(idx)]  # (rows, W, cin)
  return patches.reshape(patches.shape[0], -1)
