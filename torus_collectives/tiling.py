"""TPU tiling: the tile sizes (``LANES``, ``SUBLANES``), the torus implementations'
chunks padded to widths they split evenly, and the batch-norm kernels' tile-aligned view
of an activation in XLA's TPU layout.

A collective over p devices views a flat per-device buffer as p chunks, row-major over the
named axes. An implementation may need each chunk padded to a width it can split evenly
(streams, rows, VMEM blocks); the padding is zeros, so sums are unchanged, and it is
sliced off again before results leave the implementation.

Batch norm: a Pallas TPU kernel takes its operands row-major, so it reads an activation
without a relayout copy only through a view whose row-major order is XLA's physical
dimension order. XLA's TPU convolutions lay NHWC activations out as {3,0,2,1}: H, W, N, C
from major to minor, (8, 128) tiles over (N, C), read off a compiled ResNet-50 step for
v5e at every stage shape (per-replica batch 32 and 8). ``bn_view`` is therefore
``[H*W, N, C]`` for NHWC whose batch fills whole tiles of 8 sublanes: the transpose and
reshape into it and back are bitcasts. Other activations get a row-major view, which is
correct but may cost a copy (e.g. an entry parameter that XLA lays out row-major).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

LANES = 128
# The second-minor extent of XLA's TPU tiles, T(8,128) (16-bit types pack pairs of rows
# into one 32-bit word within it, T(8,128)(2,1)).
SUBLANES = 8


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


class BatchNormView(NamedTuple):
  """How a channels-last activation is seen by the batch-norm kernels.

  Attributes:
    perm: the transpose of the activation before the reshape to ``shape``.
    shape: ``(R, S, C)``: leading rows, the second-minor (sublane) extent, channels.
  """

  perm: tuple[int, ...]
  shape: tuple[int, int, int]


def bn_view(shape: tuple[int, ...]) -> BatchNormView:
  """The ``[R, S, C]`` view of a channels-last activation the batch-norm kernels run on.

  NHWC with N a multiple of 8: ``[H*W, N, C]`` (XLA's convolution layout). Otherwise the
  rows ``M`` in order, as ``[M / S, S, C]`` with S = gcd(M, 8).
  """
  channels = shape[-1]
  if len(shape) == 4 and shape[0] % SUBLANES == 0:
    n, h, w, _ = shape
    return BatchNormView((1, 2, 0, 3), (h * w, n, channels))
  rows = math.prod(shape[:-1])
  sublanes = math.gcd(rows, SUBLANES)
  return BatchNormView(tuple(range(len(shape))), (rows // sublanes, sublanes, channels))


def to_bn_view(x: jax.Array) -> jax.Array:
  """``x`` transposed and reshaped into ``bn_view(x.shape)``."""
  view = bn_view(x.shape)
  return jnp.transpose(x, view.perm).reshape(view.shape)


def from_bn_view(v: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The inverse of ``to_bn_view`` for an activation of ``shape``."""
  perm = bn_view(shape).perm
  permuted = tuple(shape[p] for p in perm)
  return jnp.transpose(v.reshape(permuted), tuple(perm.index(i) for i in range(len(perm))))
