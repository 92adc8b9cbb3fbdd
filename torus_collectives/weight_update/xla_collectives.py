"""sharded_update's collectives on XLA, in the forms XLA's TPU compiler emits as genuine
reduce-scatters and all-gathers.

Weight-update sharding moves each step one reduce-scatter of the gradients and one
all-gather of the weights; on a torus each is half an all-reduce's bytes. XLA's TPU
compiler (libtpu 0.0.50) compiles the plain lax forms as all-reduces instead: a flat
``lax.psum_scatter`` as an all-reduce and a slice, and ``lax.all_gather`` over two mesh
axes often as an all-reduce of a zero-padded buffer (over v5e:16x16 for every shape
tried; over v5e:2x2 for a shard that is no whole number of tiles). Each then moves twice
its bytes. The async forms compile to the genuine collectives (ahead-of-time compiles for
v5e, v6e, v5p and v4: ``tests/test_xla_collectives.py``; the probes of ``python -m
bench.async_collectives_report``):

* **Reduce-scatter** (``reduce_scatter_rows``). Device ``d`` receives row ``d`` of a
  bucket's ``[p, m]`` rows (``packing``). XLA's TPU compiler emits a ``reduce-scatter``
  only for an operand ``[p * r, 128]`` scattered along dimension 0, each device's part
  whole ``(sublanes, 128)`` tiles (``r`` a multiple of 8 rows of 32-bit values, 16 of
  16-bit), asked through ``lax.psum_scatter_start(...).done()``, and with a number of
  tiles a device it finds a "span count" for. Every count up to 16 and every multiple of
  16 tried compiled on each generation; 17 and 31 tiles a device fail over v5e:16x16,
  and 31 over v6e:16x16 and v4:4x4x4 (``SPAN_TILES``). Otherwise it refuses to compile
  ("2nd-minor compaction", "no feasible span count"), crashes (a 1-D operand), or, for
  ``lax.psum_scatter`` of the same operand, emits an all-reduce and a slice. So each row
  is padded from ``m`` to ``m'`` elements, the least number of whole tiles (1,024
  elements of 32 bits, 2,048 of 16) that is at most 16 tiles or a multiple of 16, viewed
  as ``[p * m' / 128, 128]`` and reduce-scattered; the first ``m`` elements of the
  result are the shard. Only where the padding is at most half the row
  (``TILE_PADDING_LIMIT``), so the reduce-scatter moves at most one and a half times the
  row's bytes against the all-reduce's two; a shorter row keeps the flat
  ``lax.psum_scatter``.
* **All-gather** (``all_gather_shards``): the async all-gather
  (``all_gather_start(...).done()``, a private jax API: ``_jax_internals``) of the flat
  shard, which XLA's TPU compiler emitted as an ``all-gather`` for every length tried.

Both take a bucket (``packing``) each: one collective for many leaves, as XLA's own
combiner would merge them, since on a large torus each collective pays a latency that
grows with its diameter.

On GPU backends, whose plain lax forms are already the genuine collectives, both take the
plain lax forms. The values are those of ``lax.psum_scatter`` and ``lax.all_gather``,
element for element: the padding is zeros and is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import _jax_internals as jax_internals
from torus_collectives.tiling import LANES, SUBLANES, ceil_div

# A row is reduce-scattered in whole tiles only where that pads it by at most this share.
TILE_PADDING_LIMIT = 1 / 2
# Tiles a device: at most this many, or a multiple of it (module doc).
SPAN_TILES = 16


def sublanes(dtype) -> int:
  """Rows of ``dtype`` in one TPU tile, ``T(8,128)`` of 32-bit words: 8 rows of 32-bit
  values, 16 of 16-bit (packed in pairs), 32 of 8-bit."""
  return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def tiled_row_length(m: int, dtype) -> int | None:
  """The padded row length ``m'`` of a shard of ``m`` elements: whole tiles, at most
  ``SPAN_TILES`` of them or a multiple of it; or None where that would pad the row by
  more than ``TILE_PADDING_LIMIT``."""
  tile = sublanes(dtype) * LANES
  tiles = ceil_div(m, tile)
  if tiles > SPAN_TILES:
    tiles = ceil_div(tiles, SPAN_TILES) * SPAN_TILES
  padded = tiles * tile
  return padded if padded - m <= TILE_PADDING_LIMIT * m else None


def reduce_scatter_rows(rows: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Row ``d`` of the sum over ``axes`` of ``rows`` (``[p, m]``, ``p`` the product of the
  axes' sizes, device ``d`` row-major over them), as a flat ``[m]``: a genuine
  reduce-scatter on TPU where ``tiled_row_length`` allows it (module doc), else
  ``lax.psum_scatter`` of the flattened rows."""
  p, m = rows.shape
  axes = tuple(axes)
  padded = tiled_row_length(m, rows.dtype)
  if padded is None:
    return lax.psum_scatter(rows.reshape(-1), axes, scatter_dimension=0, tiled=True)
  tiles = jnp.pad(rows, ((0, 0), (0, padded - m))).reshape(p * padded // LANES, LANES)

  def asynchronous(v):
    return lax.psum_scatter_start(v, axes, scatter_dimension=0, tiled=True).done()

  def synchronous(v):
    return lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True)

  return _off_gpu(asynchronous, synchronous, tiles).reshape(-1)[:m]


def all_gather_shards(shard: jax.Array, axes: Sequence[str]) -> jax.Array:
  """The ``[p * m]`` tiled all-gather over ``axes`` of each device's flat ``[m]``
  ``shard``, as a genuine all-gather on TPU (module doc)."""
  axes = tuple(axes)

  def asynchronous(v):
    return jax_internals.all_gather_start(v, axes, tiled=True).done()

  def synchronous(v):
    return lax.all_gather(v, axes, tiled=True)

  return _off_gpu(asynchronous, synchronous, shard)


def _off_gpu(asynchronous, synchronous, x: jax.Array) -> jax.Array:
  """``asynchronous(x)`` when lowered for TPU or CPU, ``synchronous(x)`` for GPU."""
  return lax.platform_dependent(x, cuda=synchronous, rocm=synchronous, default=asynchronous)
