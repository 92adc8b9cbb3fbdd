"""The collective backend contract of ``registry``, implemented with the remote-DMA kernels.

Called inside the caller's ``shard_map`` with ``axes`` bound, on a 1-D per-device buffer:

* ``reduce_scatter(x, axes, torus)``: ``[p*m] -> [m]`` == ``lax.psum_scatter(x, axes, tiled=True)``
* ``all_gather(x, axes, torus)``: ``[m] -> [p*m]`` == ``lax.all_gather(x, axes, tiled=True)``
* ``all_reduce(x, axes, torus)``: ``[n] -> [n]`` == ``lax.psum(x, axes)``

All three follow ``schedule.default_variant(torus)``: a bidirectional ring on one axis, the
split torus on two or three (the paper's split 2-D torus, and its 3-D form with six
streams). The all-reduce is that reduce-scatter followed by that all-gather, which is
exactly the all-reduce schedule (its streams are the reduce-scatter phases followed by the
all-gather phases, in lockstep).

Layout (``buffer_layout.Layout``): the kernels take and return the 1-D buffers as they
are, viewing chunk ``c`` as ``S`` stream slices of ``R`` rows of 128 lanes, ``R`` a whole
number of native tiles (8 rows for 32-bit types, 16 for 16-bit ones); chunks too small to
give every stream a tile travel in one stream. What follows the buffer's end is never
read, written or sent, so nothing is padded:

* all-reduce, any ``n``: chunk ``c`` starts at ``c * S * R * 128``, the grid runs past
  ``n`` and the kernels skip what does not exist. No XLA op surrounds the two kernels
  (compiler estimates for ResNet-50's 25,557,032 elements: ``bench.aot_report``).
* reduce-scatter and all-gather, chunks of ``m`` elements at ``c * m`` as lax lays them
  out: the kernels alone when ``m`` is a whole number of 512-byte DMA words (a multiple of
  128 elements of a 32-bit type, 256 of a 16-bit one), since every DMA must start on a
  word. Otherwise each chunk is zero-padded to whole words before (reduce-scatter: the
  input; all-gather: the own chunk) and the padding sliced off after: the glue that
  remains, at most one word per chunk, which also travels over the links.
* ``float32_partials`` widens the input before the reduce-scatter and rounds its work
  buffer after: two converts of the buffer, the price of the option.

dtypes: float32 and int32 reduce in their own type. bfloat16 and float16 partial sums
travel in their own type (the wire bytes of the bound, 2(p-1)/p S, the format of XLA's
bfloat16 all-reduce on TPU), and every hop adds the received partial sum to its own in
float32 in VMEM and rounds the result once; ``KernelConfig(float32_partials=True)``
instead widens the buffer to float32 before the collective and rounds once at the end
(twice the bytes; as ``lax.psum`` on CPU does, whose result it matched bit for bit on a
2x4 mesh). Measured against a float64 sum of 8 random normal bfloat16 terms (2x4 torus,
interpret mode): max error 2.07 u sum|x| per-hop, 0.97 u sum|x| rounded once (u = 2**-8),
RMS error 0.32 % vs 0.17 % of the RMS sum. The all-gather moves any type as is.

Inside ``shard_map`` with ``check_vma=True`` (the default) or ``False``: the kernel outputs
are typed varying over the torus axes, like the ``ppermute`` fallback's, and the public
layer marks the all-reduce invariant.

Block-scaled transport (``transport=``, ``torus_collectives.quantization``): int8 blocks of
128 on every axis run the kernels of ``quantized_kernels`` (the same schedules, partial
sums sent as int8 plus bfloat16 scales, requantized at every hop); other formats, block
sizes, per-axis transport and error feedback are refused, naming ``"shard_map"``.

Platforms (checked by ``remote_dma.mesh_target``): on TPU v4 and newer the kernels compile
with Mosaic. Elsewhere they run only in TPU interpret mode, when the caller traces them
inside ``pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(...))``. TPU v2/v3 are
refused: libtpu cannot compile Pallas remote DMAs for them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from torus_collectives import schedule as schedule_lib
from torus_collectives._vma import ensure_varying
from torus_collectives.kernel_config import KernelConfig
from torus_collectives.kernels import (
  buffer_layout,
  leaf_grid,
  leaf_kernels,
  quantized_kernels,
  split_leaf_kernels,
  torus_kernels,
)
from torus_collectives.kernels.remote_dma import mesh_target
from torus_collectives.tiling import LANES, accumulation_dtype, ceil_div, pad_chunks, pad_to


def _work_dtype(dtype, config: KernelConfig | None) -> jnp.dtype:
  """The type partial sums travel and live in HBM as (see the module docstring)."""
  if config is not None and config.float32_partials:
    return accumulation_dtype(dtype)
  return jnp.dtype(dtype)


def _check(x: jax.Array, axes: Sequence[str], torus: Sequence[int]) -> None:
  if x.ndim != 1 or len(axes) != len(torus) or not 1 <= len(axes) <= 3:
    raise ValueError(
      f"expected a 1-D buffer and 1 to 3 torus axes, got {x.shape=}, {axes=}, {torus=}"
    )


class _Plan:
  """Schedules and layout for one collective on one buffer size."""

  def __init__(self, axes, torus, chunk_elements: int, itemsize: int, config: KernelConfig | None):
    self.axes, self.torus = tuple(axes), tuple(int(n) for n in torus)
    self.mesh_axes, device_kind = mesh_target()
    variant = schedule_lib.default_variant(self.torus)
    rs = schedule_lib.build("reduce_scatter", self.torus, variant)
    ag = schedule_lib.build("all_gather", self.torus, variant)
    # A native VMEM tile: 8 rows of 128 lanes for 32-bit types, 16 for 16-bit ones.
    tile = max(8, 32 // itemsize)
    if ceil_div(chunk_elements, rs.num_streams * LANES) < tile:
      # Too small to fill a tile per stream: a latency-bound collective gains nothing
      # from more links, and every stream costs its own DMAs. Stream 0 alone carries whole
      # chunks (any stream of a schedule is a complete algorithm on its own).
      rs, ag = (dataclasses.replace(s, streams=s.streams[:1]) for s in (rs, ag))
    self.reduce_scatter, self.all_gather = rs, ag
    self.streams = rs.num_streams
    rows = ceil_div(chunk_elements, self.streams * LANES)
    self.config = (config or KernelConfig()).resolve(rows, itemsize, device_kind)
    self.slice_elements = ceil_div(rows, tile) * tile * LANES
    self.chunk_elements = self.streams * self.slice_elements

  def layout(self, n: int, stride: int, dtype) -> buffer_layout.Layout:
    """The kernels' view of a buffer of ``n`` elements whose chunks are ``stride`` apart."""
    return buffer_layout.Layout(
      n=n,
      stride=stride,
      slice_elements=self.slice_elements,
      piece_elements=self.config.block_rows * LANES,
      itemsize=jnp.dtype(dtype).itemsize,
    )

  def run_reduce_scatter(self, x: jax.Array, stride: int, **kwargs) -> jax.Array:
    return torus_kernels.reduce_scatter_call(
      ensure_varying(x, self.axes),
      self.reduce_scatter,
      self.axes,
      self.mesh_axes,
      self.layout(x.size, stride, x.dtype),
      **kwargs,
    )

  def run_all_gather(self, x: jax.Array, n: int, stride: int) -> jax.Array:
    return torus_kernels.all_gather_call(
      ensure_varying(x, self.axes),
      self.all_gather,
      self.axes,
      self.mesh_axes,
      self.layout(n, stride, x.dtype),
    )


def _word_multiple(m: int, dtype) -> int:
  """``m`` rounded up to whole DMA words of ``dtype``."""
  align = buffer_layout.dma_alignment(jnp.dtype(dtype).itemsize)
  return ceil_div(m, align) * align


def _block_scaled(transport, with_residual: bool) -> bool:
  """Whether ``transport`` asks for block-scaled transport, which the kernels of
  ``quantized_kernels`` run for int8 blocks of 128 on every axis; anything else raises
  before any device work, naming the implementation that runs it."""
  if with_residual:
    raise ValueError(
      'implementation="pallas" returns no quantization residual (error feedback); use '
      'implementation="shard_map"'
    )
  if transport is None or not any(transport):
    return False
  if any(fmt != quantized_kernels.FORMAT for fmt in transport):
    raise ValueError(
      f'implementation="pallas" runs block-scaled transport as {quantized_kernels.FORMAT} on '
      f'every axis, got {transport}; use implementation="shard_map" for other formats, '
      "block sizes or per-axis transport"
    )
  return True


def reduce_scatter(
  x: jax.Array,
  axes: Sequence[str],
  torus: Sequence[int],
  *,
  config: KernelConfig | None = None,
  transport=None,
  with_residual: bool = False,
) -> jax.Array:
  """``[p*m] -> [m]``: this device's chunk of the sum over the torus."""
  _check(x, axes, torus)
  if _block_scaled(transport, with_residual):
    return quantized_kernels.quantized_reduce_scatter(x, axes, torus, mesh_target()[0])
  p = math.prod(torus)
  if p == 1:
    return x
  if x.size % p:
    raise ValueError(f"reduce_scatter needs a size divisible by {p} devices, got {x.size=}")
  m = x.size // p
  work = _work_dtype(x.dtype, config)
  stride = _word_multiple(m, work)
  plan = _Plan(axes, torus, stride, work.itemsize, config)
  grid = x.astype(work)
  if stride != m:  # chunks off the DMA words: pad each (the remaining glue)
    grid = pad_chunks(grid, p, stride).reshape(-1)
  own = plan.run_reduce_scatter(grid, stride, own_out=True)
  return own[:m].astype(x.dtype)


def all_gather(
  x: jax.Array,
  axes: Sequence[str],
  torus: Sequence[int],
  *,
  config: KernelConfig | None = None,
  transport=None,
) -> jax.Array:
  """``[m] -> [p*m]``: the chunks of all devices, row-major over ``axes``."""
  _check(x, axes, torus)
  if _block_scaled(transport, False):
    return quantized_kernels.quantized_all_gather(x, axes, torus, mesh_target()[0])
  p = math.prod(torus)
  if p == 1:
    return x
  m = x.size
  stride = _word_multiple(m, x.dtype)
  plan = _Plan(axes, torus, stride, jnp.dtype(x.dtype).itemsize, config)
  out = plan.run_all_gather(pad_to(x, stride), p * stride, stride)
  if stride != m:  # chunks off the DMA words were padded: drop the padding
    out = out.reshape(p, stride)[:, :m].reshape(-1)
  return out


def all_reduce(
  x: jax.Array,
  axes: Sequence[str],
  torus: Sequence[int],
  *,
  config: KernelConfig | None = None,
  transport=None,
  with_residual: bool = False,
) -> jax.Array:
  """``[n] -> [n]``: the sum over the torus, on every device."""
  _check(x, axes, torus)
  if _block_scaled(transport, with_residual):
    return quantized_kernels.quantized_all_reduce(x, axes, torus, mesh_target()[0])
  n, p = x.size, math.prod(torus)
  if p == 1:
    return x
  work = _work_dtype(x.dtype, config)
  plan = _Plan(axes, torus, ceil_div(n, p), work.itemsize, config)
  # Where the chunk boundaries fall is internal to an all-reduce: the kernels lay the grid
  # over the buffer as it is, and positions past its end simply do not exist.
  acc = plan.run_reduce_scatter(x.astype(work), plan.chunk_elements)
  # float32_partials: round the sums, then gather them.
  return plan.run_all_gather(acc.astype(x.dtype), n, plan.chunk_elements)


def _as_leaf(x: jax.Array, rows: int) -> jax.Array:
  """``x`` flattened, zero-padded and viewed as ``[rows, 128]`` (a leaf the leaf kernels
  take)."""
  return pad_to(x.reshape(-1), rows * LANES).reshape(rows, LANES)


# The most leaves one pair of leaf kernels takes: a kernel's code grows with its leaves,
# so a bucket of many (a transformer's) runs as several pairs instead.
MAX_LEAVES_PER_CALL = 64


def _leaf_calls(leaves: list[jax.Array], axes, torus) -> list[jax.Array]:
  """The leaf kernels' reduce-scatter then all-gather of ``leaves``, aliased."""
  mesh_axes, _ = mesh_target()
  shapes = [x.shape for x in leaves]
  rs, ag = leaf_grid.all_reduce_grids(shapes, leaves[0].dtype.itemsize, torus)
  summed = [ensure_varying(x, axes) for x in leaves]
  summed = leaf_kernels.reduce_scatter_call(summed, rs, axes, mesh_axes)
  return leaf_kernels.all_gather_call(summed, ag, axes, mesh_axes)


def all_reduce_leaves(
  leaves: Sequence[jax.Array], axes: Sequence[str], torus: Sequence[int]
) -> list[jax.Array]:
  """Arrays of one dtype -> each one's sum over the torus (``lax.psum(leaf, axes)``), with
  no copy around the leaves the leaf kernels take where they lie.

  The leaves go to the kernels as ``kernel_leaves`` lays them out (each in its own shape,
  or with its two minor dimensions swapped where that is a bitcast, small vectors whole;
  the others packed into one more leaf). One reduce-scatter and one all-gather call of
  ``schedule.default_variant(torus)`` take them all, aliased (up to
  ``MAX_LEAVES_PER_CALL`` leaves a pair; more run as several pairs). 16-bit floats
  travel in their own type and every hop adds in float32, as ``all_reduce`` does.
  """
  leaves = list(leaves)
  torus = tuple(int(n) for n in torus)
  if not leaves or math.prod(torus) == 1:
    return leaves
  kernel = kernel_leaves(leaves)
  summed = []
  for start in range(0, len(kernel), MAX_LEAVES_PER_CALL):
    summed += _leaf_calls(kernel[start : start + MAX_LEAVES_PER_CALL], axes, torus)
  return restored_leaves(summed, leaves)


def split_all_reduce_leaves(
  leaves: Sequence[jax.Array], axes: Sequence[str], torus: Sequence[int]
) -> split_leaf_kernels.SplitLeafAllReduce:
  """``all_reduce_leaves`` as a ``split_leaf_kernels.SplitLeafAllReduce``, issued one hop
  at a time: the same leaves where they lie (``kernel_leaves``), no packing of the bucket
  and no slicing of its sums; ``finish_parts`` returns each leaf's sum."""
  leaves = list(leaves)
  torus = tuple(int(n) for n in torus)
  mesh_axes, _ = mesh_target()
  kernel = kernel_leaves(leaves) if leaves and math.prod(torus) > 1 else []
  return split_leaf_kernels.SplitLeafAllReduce(
    [ensure_varying(x, tuple(axes)) for x in kernel],
    axes,
    torus,
    mesh_axes,
    restore=lambda summed: restored_leaves(summed, leaves) if kernel else leaves,
    like=leaves,
  )


def kernel_leaves(leaves: Sequence[jax.Array]) -> list[jax.Array]:
  """A bucket's leaves as the leaf kernels take them: every leaf with two or more
  dimensions whose second-minor one is a whole number of tiles in its own shape, or with
  its two minor dimensions swapped where XLA lays it out minor dimension first
  (``leaf_grid.kernel_view``), so the swap is a bitcast and no XLA op packs, reshapes or
  copies it; small leaves the kernels cannot cut (vectors, a stem convolution's kernel)
  as they are too, each moved whole; the rest (scalars, larger such leaves) packed,
  zero-padded, into one more leaf of ``[rows, 128]`` after them. ``restored_leaves``
  inverts it.

  Raises:
    ValueError: leaves of several dtypes, or of a width other than 16 or 32 bits.
  """
  itemsize = _shared_itemsize(leaves)
  views = [leaf_grid.kernel_view(leaf.shape, itemsize) for leaf in leaves]
  kernel = [_swap(x) if v == "transposed" else x for x, v in zip(leaves, views) if v]
  packed = [leaf.reshape(-1) for leaf, view in zip(leaves, views) if view is None and leaf.size]
  if packed:
    flat = jnp.concatenate(packed)
    unit = leaf_grid.unit_rows(itemsize)
    kernel.append(_as_leaf(flat, ceil_div(flat.size, unit * LANES) * unit))
  return kernel


def restored_leaves(summed: Sequence[jax.Array], leaves: Sequence[jax.Array]) -> list:
  """``kernel_leaves(leaves)``'s arrays summed -> the sums in ``leaves``' shapes (an empty
  leaf's sum is itself)."""
  itemsize = leaves[0].dtype.itemsize
  views = [leaf_grid.kernel_view(leaf.shape, itemsize) for leaf in leaves]
  packed = [i for i, view in enumerate(views) if view is None and leaves[i].size]
  out, sums = [], iter(summed)
  for leaf, view in zip(leaves, views):
    if view is not None:
      total = next(sums)
      out.append(_swap(total) if view == "transposed" else total)
    else:
      out.append(None if leaf.size else leaf)
  if packed:
    flat = next(sums).reshape(-1)
    ends = itertools.accumulate(leaves[i].size for i in packed)
    for i, end in zip(packed, ends):
      out[i] = flat[end - leaves[i].size : end].reshape(leaves[i].shape)
  return out


def _swap(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)


def _shared_itemsize(leaves: Sequence[jax.Array]) -> int:
  """The bytes of the one dtype the leaves share, a 16- or 32-bit one.

  Raises:
    ValueError: leaves of several dtypes, or of another width.
  """
  dtypes = sorted({str(leaf.dtype) for leaf in leaves})
  if len(dtypes) != 1:
    raise ValueError(f"the leaves of one call share a dtype, got {dtypes}")
  itemsize = leaves[0].dtype.itemsize
  if itemsize not in (2, 4):
    raise ValueError(f"the leaf kernels sum 16- and 32-bit types, got {dtypes[0]}")
  return itemsize
