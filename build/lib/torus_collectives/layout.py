"""Buffer layout shared by every torus implementation: chunk sizes and zero padding.

A collective over p devices views a flat per-device buffer as p chunks, row-major over the
named axes. An implementation may need each chunk padded to a width it can split evenly
(streams, rows, VMEM blocks); the padding is zeros, so sums are unchanged, and it is
sliced off again before results leave the implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ceil_div(a: int, b: int) -> int:
  """``ceil(a / b)`` for non-negative integers."""
  return -(-a // b)


def pad_to(x: jax.Array, size: int) -> jax.Array:
  """The 1-D ``x`` zero-padded at its end to ``size`` elements (no copy if it fits)."""
  return jnp.pad(x, (0, size - x.shape[0])) if size > x.shape[0] else x


def pad_chunks(x: jax.Array, p: int, width: int) -> jax.Array:
  """``[p*m] -> [p, width]``: each of the ``p`` chunks zero-padded to ``width >= m``."""
  m = x.shape[0] // p
  grid = x.reshape(p, m)
  return jnp.pad(grid, ((0, 0), (0, width - m))) if width > m else grid


def accumulation_dtype(dtype) -> jnp.dtype:
  """Partial sums of floats are kept in float32 at least (bfloat16 and float16 widen);
  integers are summed in their own type, exactly as ``lax.psum`` does."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(dtype)
