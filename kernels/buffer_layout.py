"""The torus kernels' view of a 1-D buffer as a schedule's grid of chunks.

A kernel addresses the caller's flat buffer of ``n`` elements directly (Mosaic cannot
reshape a 1-D ref, and XLA cannot view a 1-D array of unfactorable length as a grid
without a copy). The grid lies over it virtually (``Layout``): chunk ``c``, row-major over
the torus coordinates, at ``c * stride``, its stream slices and pieces after it. What
would lie at or past ``n`` does not exist. A transfer's slab is a set of chunks
(``Slab``); ``each_length`` emits the DMAs of one segment of every chunk with the static
length that segment has there, under a ``pl.when`` on the traced chunk index, so a DMA
never reads or writes past the buffer's end and both ends of a transfer take the same
branch.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from torus_collectives import schedule as schedule_lib

# The DMA engine moves 1-D HBM slices that start on a 512-byte boundary and are a whole
# number of 512-byte words long; the only shorter slice it moves is one that ends where
# its array ends, and into VMEM only when it fills a VMEM array of exactly its length.
DMA_WORD_BYTES = 512


def dma_alignment(itemsize: int) -> int:
  """Elements of ``itemsize`` bytes in one DMA word (128 for 32-bit types, 256 for 16-bit)."""
  return DMA_WORD_BYTES // itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a schedule's grid of chunks lies in a kernel's 1-D buffer of ``n`` elements.

  Chunk ``c`` (row-major over the torus coordinates) starts at ``c * stride``, its stream
  slice ``s`` at ``+ s * slice_elements``, piece ``k`` of that slice at
  ``+ k * piece_elements``. The grid is virtual: positions at or beyond ``n`` (and beyond
  ``stride`` within a chunk) do not exist, are never sent, waited for or added. So chunks
  before ``last_chunk`` are whole, chunk ``last_chunk`` holds ``last_extent`` elements,
  and later chunks are empty. ``stride`` and both slice lengths are whole DMA words; only
  the buffer's final ``tail`` elements (``n`` modulo a DMA word) are not, and travel by
  DMAs of their own (see ``_reduce_scatter_kernel``).
  """

  n: int
  stride: int
  slice_elements: int
  piece_elements: int
  itemsize: int

  def __post_init__(self):
    words = (self.stride, self.slice_elements, self.piece_elements)
    if self.n < 1 or any(size < 1 or size % self.align for size in words):
      raise ValueError(f"chunk stride and slice lengths must be whole DMA words: {self}")

  @property
  def align(self) -> int:
    return dma_alignment(self.itemsize)

  @property
  def last_chunk(self) -> int:
    return (self.n - 1) // self.stride

  @property
  def last_extent(self) -> int:
    return self.n - self.last_chunk * self.stride

  @property
  def tail(self) -> int:
    return self.n % self.align

  def lengths(self, offset: int, size: int) -> tuple[int, int]:
    """Elements of the segment ``[offset, offset + size)`` of a chunk that exist in a whole
    chunk and in the last chunk."""
    clip = lambda extent: min(max(extent - offset, 0), size)
    return clip(self.stride), clip(self.last_extent)

  def valid_elements(self, offset: int, size: int, chunks: int) -> int:
    """Elements of the segment that exist, summed over ``chunks`` chunks of the grid."""
    whole, last = self.lengths(offset, size)
    return self.last_chunk * whole + last if chunks > self.last_chunk else chunks * whole


class Slab:
  """The chunks of one transfer's slab: ``size`` of them, row-major over the slab's grid
  axes other than the phase's (``carried``), the ``j``-th at chunk ``chunk(j)``. A receive
  slot holds the ``j``-th chunk's stream slice at ``j * slice_elements``, so sender and
  receiver, who enumerate the same slab, agree on where everything goes."""

  def __init__(self, transfer: schedule_lib.Transfer, torus, coords, slab):
    self.phase_axis = transfer.phase.axis
    self.carried = [a for a in transfer.live_axes if a != self.phase_axis]
    self.torus, self.coords, self.slab = tuple(torus), tuple(coords), slab
    self.size = math.prod(self.torus[a] for a in self.carried)
    self.row_stride = [math.prod(self.torus[a + 1 :]) for a in range(len(self.torus))]
    fixed = [self.slab if a == self.phase_axis else self.coords[a] for a in range(len(torus))]
    self.base = sum(
      fixed[a] * self.row_stride[a] for a in range(len(torus)) if a not in self.carried
    )

  def chunk(self, j):
    c, rest = self.base, j
    for a in reversed(self.carried):
      c = c + (rest % self.torus[a]) * self.row_stride[a]
      rest = rest // self.torus[a]
    return c

  def position(self, chunk: int) -> int:
    """Index in the slab of grid chunk ``chunk``, if the slab holds it (``holds``)."""
    index = np.unravel_index(chunk, self.torus)
    j = 0
    for a in self.carried:
      j = j * self.torus[a] + int(index[a])
    return j

  def holds(self, chunk: int):
    """Whether this slab holds grid chunk ``chunk`` (a traced bool)."""
    index = np.unravel_index(chunk, self.torus)
    held = self.slab == int(index[self.phase_axis])
    for a, own in enumerate(self.coords):
      if a != self.phase_axis and a not in self.carried:
        held = jnp.logical_and(held, own == int(index[a]))
    return held


def each_length(layout: Layout, slab: Slab, j, offset: int, size: int, fn, *, words: bool):
  """Calls ``fn(length, chunk, j)`` for the ``j``-th chunk of ``slab`` if the segment
  ``[offset, offset + size)`` of that chunk has elements, inside a ``pl.when`` on the
  (traced) chunk index, with the static length it has there. With ``words``, a length is
  cut to whole DMA words (the buffer's tail is then left to the caller). In the last chunk
  the chunk and ``j`` are passed as Python ints, so every offset there is static."""
  whole, last = layout.lengths(offset, size)
  if words:
    last -= last % layout.align
  chunk = slab.chunk(j)

  def call(length, chunk, j):
    def body():
      fn(length, chunk, j)

    return body

  if whole == last:
    if whole and layout.last_chunk == math.prod(slab.torus) - 1:
      fn(whole, chunk, j)
    elif whole:
      pl.when(chunk <= layout.last_chunk)(call(whole, chunk, j))
    return
  if whole and layout.last_chunk > 0:
    pl.when(chunk < layout.last_chunk)(call(whole, chunk, j))
  if last:
    last_chunk = layout.last_chunk
    pl.when(chunk == last_chunk)(call(last, last_chunk, slab.position(last_chunk)))


def at(ref, start, size: int, align: int):
  """``ref[start : start + size]`` for a 1-D ref; ``start`` a multiple of ``align``."""
  if not isinstance(start, int):
    start = pl.multiple_of(start, align)
  return ref.at[pl.ds(start, size)]


def for_each(size: int, body) -> None:
  """``body(j)`` for ``j`` in ``range(size)``: traced once, as a loop if ``size > 1``."""
  if size == 1:
    body(0)
  elif size > 1:
    lax.fori_loop(0, size, lambda j, carry: (body(j), carry)[1], 0)


def pieces(slice_elements: int, piece_elements: int) -> list[tuple[int, int]]:
  """``(offset, elements)`` of the pieces a stream slice is cut into: whole pieces, then
  the remainder."""
  return [
    (start, min(piece_elements, slice_elements - start))
    for start in range(0, slice_elements, piece_elements)
  ]
