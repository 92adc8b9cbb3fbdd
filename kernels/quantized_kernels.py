"""Block-scaled int8 transport in the remote-DMA torus kernels (``quantization``'s format).

These kernels carry out the same ``schedule.build(..., default_variant)`` schedules as
``torus_kernels``, with what ``backends.shard_map`` does with ``lax.ppermute`` and
``transport=(BlockScaled("int8"),) * len(axes)``. Every reduce-scatter hop sends the
partial sums of its slab as int8 values plus one bfloat16 scale per 128 elements. The
receiver dequantizes them, adds its own float32 partial sums, and quantizes the sum again
to send it on. The all-gather quantizes the owner's reduced chunk once and forwards the
bytes unchanged, and every device dequantizes at the end. So results, the order of adds
and the blocks are those of the ``shard_map`` implementation and ``quantization.simulate``.
In TPU interpret mode on CPU they match both bitwise. One caveat, shared with the
``shard_map`` implementation: XLA (on CPU and TPU) flushes subnormal results to zero, so a
block whose largest magnitude is under about 127 times the smallest normal float32
(1.5e-36) gets scale 0 and arrives as zeros, whereas numpy's ``simulate`` keeps a
subnormal scale. On a TPU the float32 reciprocal may also round differently, within
``quantization.error_bound``.

Layout. The wrapper lays out a device's float32 buffer as the ``shard_map`` implementation
does: ``p`` chunks of ``m = ceil(n / p)`` elements, each zero-padded to ``width`` (a whole
number of 128-element rows per stream). The kernel sees it as a 2-D ``[p * S * R, 128]``
float32 array. Chunk ``c`` (row-major over the torus coordinates) begins at row
``c * S * R``, and its stream slice ``s`` at ``+ s * R``. A slice is cut into pieces of
``P`` rows (``PIECE_ROWS``; the last piece may be shorter). Blocks are rows, so a block
never spans two chunks or two streams, as the format requires. A slice may hold any number
of rows ``R``: 32-bit DMAs of a ``[rows, 128]`` HBM array may start and end at any row.
Int8 DMAs start and end on 4-row boundaries (one 512-byte DMA word; Mosaic: "aligned to
the unit subtile (4)"), so every int8 buffer gives a slice ``Rq = ceil4(R)`` rows and a
piece ``ceil4(rows)`` rows. The up to 3 rows of padding per slice travel too.
Glue: the wrapper pads each chunk to ``width``, reshapes the buffer to rows of 128, and
slices the result. When ``n == p * width`` (e.g. 2**20 elements on 16 devices) the
reshapes are bitcasts, and the only op XLA puts around the kernel is the copy of the
program's result. Otherwise XLA emits pads, relayout reshapes and a slice (7 ops for
100,003 elements on v5e:2x4, about 5.7 MB of HBM traffic against the kernel's 2 MB).

Wire format of a piece. The int8 values ``q`` take ``[ceil4(rows), 128]``. The scales take
one ``[1, 128]`` int32 row: lane ``l`` holds the bfloat16 bits of row ``l``'s scale in its
low half and those of row ``l + 128`` in its high half. So a piece of 256 rows (32,768
elements) carries 512 bytes of scales, 2 bytes per block, as the format says. A shorter
piece still sends the whole 512-byte row. Mosaic cannot DMA a bfloat16 row (tiled (8, 128)
in HBM) or a sub-row of lanes. The scale row is built from a column by a masked
sublane sum (``_pack``), and turned back into a column by a masked lane sum (``_unpack``).
This needs no transposes, reshapes, bfloat16 vectors or 16-bit DMAs.

Buffers (HBM; a kernel gets one by declaring an output):

* ``out``: float32, the grid. It is the work buffer of the reduce-scatter (the partial
  sums of the slab each phase ends with). In an all-reduce or all-gather it also holds
  the result, dequantized over the whole grid at the end. ``x``, the input, is only read.
* ``q_gather`` / ``s_gather``: the int8 values and scale rows of the gathered grid. Chunk
  ``c``, stream ``s``, piece ``k`` lies at ``(c * S + s) * Rq + k * P`` / row
  ``(c * S + s) * pieces + k``. Every device writes each place once: its own chunk by
  quantizing it, the others by its upstream neighbour's DMA.
* ``q_slot`` / ``s_slot``: reduce-scatter receive slots, double-buffered per stream, each
  the size of the stream's largest slab, piece-major: piece ``k`` of chunks 0, 1, ... of
  a slab lie one after the other (``QLayout.slot_q_row``), so one DMA moves piece ``k``
  of the whole slab.
* ``q_stage`` / ``s_stage``: the send staging, laid out like the slots. The quantized
  partial sums are stored here (VMEM to HBM) and remote-DMA'd from here to the same place
  in the neighbour's slot. It is double-buffered: step t + 1's payload is quantized while
  step t's sends may still be on the link.

A step, for every stream together (all sends of a step are started before any wait, so
the 2N links of a chip carry traffic at once):

* reduce-scatter send: if the slab was not forwarded by the step before (the first step of
  a phase), its float32 partial sums are read (from ``x`` in the first phase, else from
  ``out``) and quantized into the staging slot ``t % 2``. From step 2 on, if the step two
  back also used the slot, the sender waits on the capacity semaphore first. Then it starts
  two remote DMAs per piece, each for the whole slab: the ``q`` rows and the scale rows.
* reduce-scatter receive, piece group by piece group: wait for every DMA of the group, then
  for each chunk and piece load ``q``, the scales and the own float32 terms into VMEM,
  dequantize, and add in float32 (``deq + own``). Then:
  - if the next step of the phase forwards this slab, quantize the sum straight into
    staging slot ``(t + 1) % 2``. Nothing is stored in float32, since ring step t + 1 sends
    exactly the slab summed at step t;
  - else, if the next step starts the stream's gather (an all-reduce), quantize it into the
    gather buffers at the own chunk;
  - else store the float32 sum in ``out`` (a phase's end), or in the own-chunk output (a
    reduce-scatter's last step).
  After the adds it signals the capacity semaphore of whoever fills the slot at step
  t + 2.
* all-gather: two remote DMAs per chunk of the slab (its slice's ``q`` rows and scale
  rows, all pieces) from ``q_gather`` / ``s_gather`` to the same places in the
  neighbour's buffers, then a wait for the slab that arrives. In an all-gather alone, step
  0 first quantizes the own chunk from ``x``.
* end of step: wait for this step's sends (the staging slot is free again).
* the end of an all-reduce or all-gather: dequantize every chunk of ``q_gather`` into
  ``out``, the own chunk included, so the result is bitwise the same on every device.
  Where a slice is one piece and a chunk's slices are small (``QLayout.batched``), a
  chunk's S slices move in one DMA each way, with the streams at static VMEM offsets
  (Mosaic accepts int8 VMEM slices at 4-row offsets only when they are static). This
  dequantization stays in the kernel: written as an XLA fusion after it, the bytes
  accessed on v5e:4x4 went from 17.7 MB to 29.6 MB (XLA materialised the scales'
  broadcast and copied the int8 slices).

Semaphores: the entry barrier (``pltpu.get_barrier_semaphore``, signalled to each
upstream neighbour of every link the schedule uses) and, for the reduce-scatter, DMA
semaphores per (stream, receive slot, piece group). Each counts all the ``q`` and scale
DMAs of its group's pieces of every chunk of the slab. DMA semaphores count bytes, and both
ends wait with the same descriptors. REGULAR capacity semaphores are kept per (stream,
phase, slot), because the downstream device changes between phases. The all-gather has DMA
semaphores per (stream, step): an upstream neighbour may be steps ahead. Local DMAs are
synchronous (start, then wait) through one VMEM piece buffer of each kind. Values
are chained in VMEM: a received piece is dequantized, added and re-quantized without a
float32 round trip.
``collective_id``: ``torus_kernels.collective_id`` of the kind string
"quantized_<collective>", so it differs from the blocking kernels' ids.

What is simple here and could be faster: local loads and stores are synchronous (no
double buffering across chunks or pieces; on a TPU this latency, not the links, would
bound small and mid-sized all-reduces). The staging costs a local int8 write and read per
hop (a remote DMA straight from VMEM would save it). Every piece, however short, sends a
whole 512-byte scale row (4 bytes per block where a slice has at most 128 rows). Only
int8 blocks of 128 on every axis are supported, on float32 partial sums (a bfloat16
input is widened by the wrapper, as the ``shard_map`` implementation does). Nothing here
has run on a TPU: it is verified in interpret mode and compiles for v4, v5e and v6e
(``tests/test_quantized_kernels.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import quantization
from torus_collectives import schedule as schedule_lib
from torus_collectives._vma import ensure_varying
from torus_collectives.axes import drop_unit_axes
from torus_collectives.kernels.buffer_layout import for_each
from torus_collectives.kernels.torus_kernels import (
  _MAX_SEMAPHORES,
  _phase_index,
  _Topology,
  collective_id,
  mesh_coordinates,
)
from torus_collectives.layout import ceil_div, pad_chunks, pad_to

LANES = 128
FORMAT = quantization.BlockScaled("int8")
LEVELS = FORMAT.levels
# Rows per VMEM piece: a multiple of 32 (one int8 tile), at most 256 (the scale row packs
# two 16-bit scales per lane). 256 rows: 128 KiB of float32, 32 KiB of int8 in VMEM.
PIECE_ROWS = 256
_QUANTUM = 4  # int8 rows per DMA word: int8 DMAs start and end on multiples of 4 rows
_SUB = 128  # rows of a compute sub-block: one scale half-word per row
_RECV_SLOTS = 2
_MAX_PIECE_GROUPS = 4
_BATCH_ROWS = 512  # int8 rows of a chunk's slices dequantized together (64 KiB)
_F32_MAX = float(np.finfo(np.float32).max)


def _up(v: int, k: int) -> int:
  return ceil_div(v, k) * k


# ----------------------------------------------------------------------------------------
# Vector math (VMEM values): the format of ``quantization.quantize_np``, bit for bit.


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x`` ([rows <= 128, 128] float32, a block per row) -> (int8 ``q``, [1, 128] int32
  scale bits: lane l holds the bfloat16 bits of row l's scale in its low 16 bits)."""
  a = jnp.abs(x)
  finite = a <= _F32_MAX  # elementwise isfinite (False for inf and NaN)
  absmax = jnp.max(jnp.where(finite, a, 0.0), axis=1, keepdims=True)
  bad = jnp.max(jnp.where(finite, 0, 1), axis=1, keepdims=True)
  scaled = jnp.where(bad > 0, jnp.float32(np.nan), absmax * jnp.float32(1 / LEVELS))
  # Rounded up to a bfloat16: add 0xFFFF to the float32 bits and clear the low half.
  bits = (lax.bitcast_convert_type(scaled, jnp.int32) + 0xFFFF) & jnp.int32(-65536)
  scale = lax.bitcast_convert_type(bits, jnp.float32)
  positive = scale > 0
  reciprocal = jnp.where(positive, 1.0 / jnp.where(positive, scale, 1.0), 0.0)
  divided = x * reciprocal
  divided = jnp.where(jnp.abs(divided) <= _F32_MAX, divided, 0.0)  # a non-finite block: 0
  q = jnp.clip(jnp.round(divided), -LEVELS, LEVELS).astype(jnp.int8)
  return q, _pack(lax.shift_right_logical(bits, 16))


def _pack(column: jax.Array) -> jax.Array:
  """[rows <= 128, 1] int32 -> [1, 128]: lane l holds row l (0 beyond ``rows``); a
  masked sublane sum: no transpose, exact in int32."""
  rows = column.shape[0]
  r = lax.broadcasted_iota(jnp.int32, (rows, LANES), 0)
  lane = lax.broadcasted_iota(jnp.int32, (rows, LANES), 1)
  return jnp.sum(jnp.where(r == lane, column, 0), axis=0, keepdims=True)


def _unpack(words: jax.Array, rows: int, half: int) -> jax.Array:
  """The float32 scales ([rows, 1]) of the rows of half ``half`` of a piece, from its
  [1, 128] scale row (a masked lane sum)."""
  r = lax.broadcasted_iota(jnp.int32, (rows, LANES), 0)
  lane = lax.broadcasted_iota(jnp.int32, (rows, LANES), 1)
  word = jnp.sum(
    jnp.where(r == lane, jnp.broadcast_to(words, (rows, LANES)), 0), axis=1, keepdims=True
  )
  b16 = lax.shift_right_logical(word, 16 * half) & 0xFFFF
  return lax.bitcast_convert_type(lax.shift_left(b16, 16), jnp.float32)


def _sub_blocks(rows: int):
  """(half, first row, rows) of the compute sub-blocks of a piece of ``rows`` rows, each
  a whole number of int8 tiles (rows past ``rows`` are computed, never stored)."""
  rows = _up(rows, 32)
  return [(h, h * _SUB, min(_SUB, rows - h * _SUB)) for h in range(ceil_div(rows, _SUB))]


# ----------------------------------------------------------------------------------------
# Layout


class QLayout:
  """Where the grid, its pieces and their int8 and scale images lie (module docstring)."""

  def __init__(self, schedule: schedule_lib.Schedule, rows: int, piece_rows: int = PIECE_ROWS):
    if piece_rows % 32 or not 32 <= piece_rows <= 2 * _SUB:
      raise ValueError(f"piece_rows must be a multiple of 32 in [32, 256], got {piece_rows}")
    self.chunks, self.streams, self.rows = schedule.num_devices, schedule.num_streams, rows
    self.piece_rows = min(piece_rows, _up(rows, 32))
    self.pieces = [(o, min(self.piece_rows, rows - o)) for o in range(0, rows, self.piece_rows)]
    self.q_rows = _up(rows, _QUANTUM)  # int8 rows per slice
    groups = min(len(self.pieces), _MAX_PIECE_GROUPS)
    per = ceil_div(len(self.pieces), groups)
    self.groups = [
      list(range(g, min(g + per, len(self.pieces)))) for g in range(0, len(self.pieces), per)
    ]
    self.group_of = {k: g for g, ks in enumerate(self.groups) for k in ks}
    # Receive slots and staging: per stream, two slots of its largest (first) slab.
    self.slot_chunks = [_slot_chunks(schedule, k) for k in range(self.streams)]
    self.stream_base = [_RECV_SLOTS * sum(self.slot_chunks[:k]) for k in range(self.streams)]
    self.slot_slices = _RECV_SLOTS * sum(self.slot_chunks)
    # One piece per slice and a chunk's slices small: the final dequantization moves a
    # chunk's S slices in one DMA each way (static offsets: no int8 alignment needed).
    self.batched = len(self.pieces) == 1 and self.streams * self.q_rows <= _BATCH_ROWS
    self.q_buf_rows = max(
      self.piece_rows, _up(self.streams * self.q_rows, 32) if self.batched else 0
    )
    self.f_buf_rows = max(
      self.piece_rows, self.streams * self.rows + _QUANTUM if self.batched else 0
    )

  @property
  def grid_rows(self) -> int:
    return self.chunks * self.streams * self.rows

  def data_row(self, chunk, stream: int, piece: int):
    return chunk * (self.streams * self.rows) + stream * self.rows + self.pieces[piece][0]

  def q_row(self, index, piece: int):
    row = index * self.q_rows + self.pieces[piece][0]
    return row if isinstance(row, int) else pl.multiple_of(row, _QUANTUM)

  def s_row(self, index, piece: int):
    return index * len(self.pieces) + piece

  def piece_q_rows(self, piece: int) -> int:
    return _up(self.pieces[piece][1], _QUANTUM)

  def slot_base(self, stream: int, slot: int) -> int:
    """First slice index of a stream's receive slot (or staging slot)."""
    return self.stream_base[stream] + slot * self.slot_chunks[stream]

  def slot_q_row(self, stream: int, slot: int, piece: int, j=0):
    """Piece-major: piece ``k`` of chunks 0, 1, ... of a slab lie one after the other, so
    one DMA moves piece ``k`` of the whole slab."""
    base = self.slot_base(stream, slot) * self.q_rows
    row = base + self.slot_chunks[stream] * self.pieces[piece][0] + j * self.piece_q_rows(piece)
    return row if isinstance(row, int) else pl.multiple_of(row, _QUANTUM)

  def slot_s_row(self, stream: int, slot: int, piece: int, j=0):
    base = self.slot_base(stream, slot) * len(self.pieces)
    return base + piece * self.slot_chunks[stream] + j


def _slot_chunks(schedule: schedule_lib.Schedule, stream: int) -> int:
  transfers = [t for t in schedule.stream_transfers(stream) if t.phase.kind == "reduce_scatter"]
  if not transfers:
    return 0
  first = transfers[0]
  return math.prod(schedule.torus[a] for a in first.live_axes if a != first.phase.axis)


# ----------------------------------------------------------------------------------------
# The kernel


# One straight program, as torus_kernels' are (pyproject's per-file C901 exemption says why).
def _kernel(schedule, topo_args, lay: QLayout, collective, coords_ref, x_ref, *refs):  # noqa: C901
  refs = list(refs)
  gathers, scatters = collective != "reduce_scatter", collective != "all_gather"
  out_ref = refs.pop(0)  # float32: the work buffer (phase ends), then the result
  own_ref = refs.pop(0) if collective == "reduce_scatter" else None
  qg, sg = (refs.pop(0), refs.pop(0)) if gathers else (None, None)
  if scatters:
    q_slot, s_slot, q_stage, s_stage = (refs.pop(0) for _ in range(4))
    send_sems, recv_sems, capacity = (refs.pop(0) for _ in range(3))
  if gathers:
    ag_send, ag_recv = refs.pop(0), refs.pop(0)
  f_buf, q_buf, s_buf, local = refs
  topo = _Topology(*topo_args, coords_ref)
  steps = schedule.steps()
  phase_of = _phase_index(schedule)
  torus = schedule.torus
  own_chunk = sum(c * math.prod(torus[a + 1 :]) for a, c in enumerate(topo.coords))

  def rows_at(ref, row, rows):
    return ref.at[pl.ds(row, rows)]

  # --- local moves through VMEM (synchronous) and the vector math ----------------------
  def run_copies(pairs):
    copies = [pltpu.make_async_copy(s, d, local.at[i]) for i, (s, d) in enumerate(pairs)]
    for c in copies:
      c.start()
    for c in copies:
      c.wait()

  def load(k, *, f32=None, q=None):
    """Loads piece ``k``: float32 rows ``f32 = (ref, row)`` into ``f_buf``, and int8 rows
    and a scale row ``q = (q_ref, q_row, s_ref, s_row)`` into ``q_buf`` / ``s_buf``."""
    rows, qn = lay.pieces[k][1], lay.piece_q_rows(k)
    pairs = []
    if f32 is not None:
      pairs.append((rows_at(f32[0], f32[1], rows), f_buf.at[pl.ds(0, rows)]))
    if q is not None:
      pairs.append((rows_at(q[0], q[1], qn), q_buf.at[pl.ds(0, qn)]))
      pairs.append((rows_at(q[2], q[3], 1), s_buf.at[pl.ds(0, 1)]))
    run_copies(pairs)

  def sums(k):
    """``dequantize(q_buf, s_buf) + f_buf`` per compute sub-block of piece ``k``."""
    words = s_buf[pl.ds(0, 1), :]
    out = []
    for half, first, n in _sub_blocks(lay.pieces[k][1]):
      deq = q_buf[pl.ds(first, n), :].astype(jnp.float32) * _unpack(words, n, half)
      out.append(deq + f_buf[pl.ds(first, n), :])
    return out

  def own_values(k):
    return [f_buf[pl.ds(first, n), :] for _, first, n in _sub_blocks(lay.pieces[k][1])]

  def quantize_to(k, values, q_ref, qrow, s_ref, srow):
    """Quantizes piece ``k``'s ``values`` (per sub-block) into ``q_ref[qrow]``, ``s_ref[srow]``."""
    words = None
    for (half, first, n), v in zip(_sub_blocks(lay.pieces[k][1]), values):
      q, w = _quantize(v)
      q_buf[pl.ds(first, n), :] = q
      w = lax.shift_left(w, 16 * half) if half else w
      words = w if words is None else words | w
    s_buf[pl.ds(0, 1), :] = words
    qn = lay.piece_q_rows(k)
    run_copies(
      [
        (q_buf.at[pl.ds(0, qn)], rows_at(q_ref, qrow, qn)),
        (s_buf.at[pl.ds(0, 1)], rows_at(s_ref, srow, 1)),
      ]
    )

  def store_f32(k, values, dst_ref, row):
    for (_, first, n), v in zip(_sub_blocks(lay.pieces[k][1]), values):
      f_buf[pl.ds(first, n), :] = v
    rows = lay.pieces[k][1]
    run_copies([(f_buf.at[pl.ds(0, rows)], rows_at(dst_ref, row, rows))])

  # --- reduce-scatter ------------------------------------------------------------------
  def rs_copies(tr, slot, slab, k):
    """The two remote DMAs of piece ``k`` of ``slab`` (every chunk of it): int8 rows and
    scale rows, from the staging slot to the same place in the neighbour's slot."""
    g = lay.group_of[k]
    target = topo.neighbour(tr.phase.axis, tr.phase.direction)
    q0, s0 = lay.slot_q_row(tr.stream, slot, k), lay.slot_s_row(tr.stream, slot, k)
    return [
      pltpu.make_async_remote_copy(
        rows_at(src, row, size),
        rows_at(dst, row, size),
        send_sems.at[tr.stream, slot, g],
        recv_sems.at[tr.stream, slot, g],
        device_id=target,
      )
      for src, dst, row, size in (
        (q_stage, q_slot, q0, slab.size * lay.piece_q_rows(k)),
        (s_stage, s_slot, s0, slab.size),
      )
    ]

  def forwards(t, stream) -> bool:
    later = steps[t + 1][stream] if t + 1 < len(steps) else None
    return later is not None and later.phase.kind == "reduce_scatter" and later.step > 0

  def starts_gather(t, stream) -> bool:
    later = steps[t + 1][stream] if t + 1 < len(steps) else None
    return later is not None and later.phase.kind == "all_gather"

  def own_terms(t, stream):
    return x_ref if phase_of[stream][t] == phase_of[stream][0] else out_ref

  def uses_slot(t, stream) -> bool:
    return 0 <= t < len(steps) and steps[t][stream].phase.kind == "reduce_scatter"

  def rs_send(t, tr):
    slot = t % _RECV_SLOTS
    slab = topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=True))
    if not (t > 0 and forwards(t - 1, tr.stream)):  # a phase's first step: quantize
      src = x_ref if t == 0 else out_ref

      def quantize_chunk(j):
        chunk = slab.chunk(j)
        for k in range(len(lay.pieces)):
          load(k, f32=(src, lay.data_row(chunk, tr.stream, k)))
          quantize_to(
            k,
            own_values(k),
            q_stage,
            lay.slot_q_row(tr.stream, slot, k, j),
            s_stage,
            lay.slot_s_row(tr.stream, slot, k, j),
          )

      for_each(slab.size, quantize_chunk)
    if uses_slot(t - _RECV_SLOTS, tr.stream):  # the downstream slot holds step t - 2
      pl.semaphore_wait(capacity.at[tr.stream, phase_of[tr.stream][t], slot], 1)
    for k in range(len(lay.pieces)):
      for copy in rs_copies(tr, slot, slab, k):
        copy.start()
    return slab

  def rs_receive(t, tr):
    slot = t % _RECV_SLOTS
    slab = topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=False))
    own = own_terms(t, tr.stream)
    nxt = (t + 1) % _RECV_SLOTS
    for group in lay.groups:
      for k in group:  # a group's semaphores count all its DMAs: wait for all first
        for copy in rs_copies(tr, slot, slab, k):
          copy.wait_recv()

      def add_chunk(j, group=group):
        chunk = slab.chunk(j)
        for k in group:
          q_at = (
            q_slot,
            lay.slot_q_row(tr.stream, slot, k, j),
            s_slot,
            lay.slot_s_row(tr.stream, slot, k, j),
          )
          load(k, f32=(own, lay.data_row(chunk, tr.stream, k)), q=q_at)
          values = sums(k)
          if forwards(t, tr.stream):  # step t + 1 sends this sum: quantize it for it
            quantize_to(
              k,
              values,
              q_stage,
              lay.slot_q_row(tr.stream, nxt, k, j),
              s_stage,
              lay.slot_s_row(tr.stream, nxt, k, j),
            )
          elif starts_gather(t, tr.stream):  # the reduced own chunk, quantized once
            gi = chunk * lay.streams + tr.stream
            quantize_to(k, values, qg, lay.q_row(gi, k), sg, lay.s_row(gi, k))
          elif own_ref is not None and t == len(steps) - 1:
            store_f32(k, values, own_ref, lay.data_row(0, tr.stream, k))
          else:
            store_f32(k, values, out_ref, lay.data_row(chunk, tr.stream, k))

      for_each(slab.size, add_chunk)
    if uses_slot(t + _RECV_SLOTS, tr.stream):  # free the slot for whoever fills it next
      later = steps[t + _RECV_SLOTS][tr.stream].phase
      pl.semaphore_signal(
        capacity.at[tr.stream, phase_of[tr.stream][t + _RECV_SLOTS], slot],
        1,
        device_id=topo.neighbour(later.axis, -later.direction),
      )

  def rs_wait_sends(t, tr, slab):
    for k in range(len(lay.pieces)):
      for copy in rs_copies(tr, t % _RECV_SLOTS, slab, k):
        copy.wait_send()

  # --- all-gather ----------------------------------------------------------------------
  def ag_copies(t, tr, slab, action):
    target = topo.neighbour(tr.phase.axis, tr.phase.direction)

    def each(j):
      gi = slab.chunk(j) * lay.streams + tr.stream
      # A chunk's slice is contiguous in both gather buffers: one DMA each for all pieces.
      for ref, row, n in (
        (qg, lay.q_row(gi, 0), lay.q_rows),
        (sg, lay.s_row(gi, 0), len(lay.pieces)),
      ):
        view = rows_at(ref, row, n)
        action(
          pltpu.make_async_remote_copy(
            view, view, ag_send.at[tr.stream, t], ag_recv.at[tr.stream, t], device_id=target
          )
        )

    for_each(slab.size, each)

  def quantize_own_input(stream):
    gi = own_chunk * lay.streams + stream
    for k in range(len(lay.pieces)):
      load(k, f32=(x_ref, lay.data_row(0, stream, k)))
      quantize_to(k, own_values(k), qg, lay.q_row(gi, k), sg, lay.s_row(gi, k))

  # --- the schedule --------------------------------------------------------------------
  with jax.named_scope("barrier"):
    topo.barrier(schedule)
  for t, transfers in enumerate(steps):
    with jax.named_scope(f"send_step{t}"):
      sent = []
      for tr in transfers:
        if tr.phase.kind == "reduce_scatter":
          sent.append(rs_send(t, tr))
        else:
          if t == 0:  # an all-gather alone: quantize the own chunk once
            quantize_own_input(tr.stream)
          slab = topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=True))
          ag_copies(t, tr, slab, lambda c: c.start())
          sent.append(slab)
    with jax.named_scope(f"receive_step{t}"):
      for tr in transfers:
        if tr.phase.kind == "reduce_scatter":
          rs_receive(t, tr)
        else:
          slab = topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=False))
          ag_copies(t, tr, slab, lambda c: c.wait_recv())
      for tr, slab in zip(transfers, sent):
        if tr.phase.kind == "reduce_scatter":
          rs_wait_sends(t, tr, slab)
        else:
          ag_copies(t, tr, slab, lambda c: c.wait_send())
  if gathers:  # every chunk, the own one included: the same bytes on every device
    with jax.named_scope("dequantize"):

      def dequantize_chunk(c):
        for s in range(lay.streams):
          gi = c * lay.streams + s
          for k in range(len(lay.pieces)):
            load(k, q=(qg, lay.q_row(gi, k), sg, lay.s_row(gi, k)))
            words = s_buf[pl.ds(0, 1), :]
            values = [
              q_buf[pl.ds(first, n), :].astype(jnp.float32) * _unpack(words, n, half)
              for half, first, n in _sub_blocks(lay.pieces[k][1])
            ]
            store_f32(k, values, out_ref, lay.data_row(c, s, k))

      def dequantize_chunk_batched(c):
        S, R, Rq = lay.streams, lay.rows, lay.q_rows
        q0 = pl.multiple_of(c * (S * Rq), _QUANTUM)
        run_copies(
          [
            (rows_at(qg, q0, S * Rq), q_buf.at[pl.ds(0, S * Rq)]),
            (rows_at(sg, c * S, S), s_buf.at[pl.ds(0, S)]),
          ]
        )
        for s in range(S):  # ascending: a slice's padding rows are overwritten by the next
          words = s_buf[pl.ds(s, 1), :]
          for half in range(ceil_div(Rq, _SUB)):
            n = min(_SUB, Rq - half * _SUB)
            q = q_buf[pl.ds(s * Rq + half * _SUB, n), :]
            f_buf[pl.ds(s * R + half * _SUB, n), :] = q.astype(jnp.float32) * _unpack(
              words, n, half
            )
        run_copies([(f_buf.at[pl.ds(0, S * R)], rows_at(out_ref, c * (S * R), S * R))])

      for_each(lay.chunks, dequantize_chunk_batched if lay.batched else dequantize_chunk)


# ----------------------------------------------------------------------------------------
# Cost


def _wire(lay: QLayout) -> int:
  """Bytes of a stream slice on the wire: int8 rows plus a 512-byte scale row per piece."""
  return lay.q_rows * LANES + len(lay.pieces) * 4 * LANES


def cost(schedule: schedule_lib.Schedule, lay: QLayout, collective: str) -> pl.CostEstimate:
  """Every HBM access and remote byte the kernel makes, per device (every device makes
  the same ones, since the grid is whole). A local DMA counts a read and a write; a remote
  DMA a read here and a write in the neighbour's HBM. Flops: about 12 vector ops per
  element quantized, 3 per element dequantized and added, 2 per element dequantized."""
  accessed = remote = flops = 0
  f32, wire = lay.rows * LANES * 4, _wire(lay)
  elements = lay.rows * LANES
  steps = schedule.steps()
  for t, transfers in enumerate(steps):
    for tr in transfers:
      size = math.prod(schedule.torus[a] for a in tr.live_axes if a != tr.phase.axis)
      accessed += 2 * size * wire  # the remote DMAs: read here, write there
      remote += size * wire
      if tr.phase.kind == "all_gather":
        continue
      if tr.step == 0:  # a phase's first slab, quantized from float32 into the staging
        accessed += size * (f32 + wire)
        flops += 12 * size * elements
      accessed += size * (wire + f32)  # load q, scales and own terms
      flops += 3 * size * elements
      following = steps[t + 1][tr.stream] if t + 1 < len(steps) else None
      if following is not None and (following.phase.kind == "all_gather" or following.step > 0):
        accessed += size * wire  # quantized for the next step or for the gather
        flops += 12 * size * elements
      else:
        accessed += size * f32  # stored in float32
  if collective == "all_gather":  # the own chunk quantized once
    accessed += lay.streams * (f32 + wire)
    flops += 12 * lay.streams * elements
  if collective != "reduce_scatter":  # every chunk dequantized at the end
    accessed += lay.chunks * lay.streams * (wire + f32)
    flops += 2 * lay.chunks * lay.streams * elements
  return pl.CostEstimate(
    flops=flops, transcendentals=0, bytes_accessed=accessed, remote_bytes_transferred=remote
  )


# ----------------------------------------------------------------------------------------
# pallas_call and the shard_map-level wrappers


def _hbm(x: jax.Array, shape, dtype):
  aval = jax.typeof(x).update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False)
  return pltpu.HBM.from_type(aval)


def _call(collective, grid, schedule, axes, mesh_axes, lay: QLayout):
  """Runs the quantized ``collective`` kernel on the 2-D float32 ``grid`` (rows of 128).
  Returns the own chunk's float32 sums (reduce-scatter) or the dequantized grid."""
  streams, steps = schedule.num_streams, schedule.num_steps
  phases = max(len(p) for p in schedule.streams)
  gathers, scatters = collective != "reduce_scatter", collective != "all_gather"
  outputs, scratch, semaphores = [((lay.grid_rows, LANES), jnp.float32)], [], 0
  if collective == "reduce_scatter":
    outputs.append(((lay.streams * lay.rows, LANES), jnp.float32))
  if gathers:
    gi = lay.chunks * lay.streams
    outputs += [((gi * lay.q_rows, LANES), jnp.int8), ((gi * len(lay.pieces), LANES), jnp.int32)]
  if scatters:  # receive slots, then send staging (same layout)
    q, s = lay.slot_slices * lay.q_rows, lay.slot_slices * len(lay.pieces)
    outputs += [((q, LANES), jnp.int8), ((s, LANES), jnp.int32)] * 2
    groups = len(lay.groups)
    scratch += [
      pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, groups)),
      pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, groups)),
      pltpu.SemaphoreType.REGULAR((streams, phases, _RECV_SLOTS)),
    ]
    semaphores += 2 * streams * _RECV_SLOTS * groups + streams * phases * _RECV_SLOTS
  if gathers:
    scratch += [pltpu.SemaphoreType.DMA((streams, steps))] * 2
    semaphores += 2 * streams * steps
  if semaphores > _MAX_SEMAPHORES:
    raise ValueError(f"{semaphores} semaphores: more than the {_MAX_SEMAPHORES} a kernel may hold")
  scratch += [
    pltpu.VMEM((lay.f_buf_rows, LANES), jnp.float32),
    pltpu.VMEM((lay.q_buf_rows, LANES), jnp.int8),
    pltpu.VMEM((8, LANES), jnp.int32),
    pltpu.SemaphoreType.DMA((3,)),
  ]
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(
    _kernel, schedule, (tuple(axes), schedule.torus, tuple(mesh_axes)), lay, collective
  )
  results = pl.pallas_call(
    kernel,
    out_shape=tuple(_hbm(grid, shape, dtype) for shape, dtype in outputs),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[any_spec],
      out_specs=(any_spec,) * len(outputs),
      scratch_shapes=scratch,
    ),
    cost_estimate=cost(schedule, lay, collective),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id(f"quantized_{collective}", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_quantized_{collective}_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), grid)
  return results[1] if collective == "reduce_scatter" else results[0]


def _plan(collective, axes, torus, mesh_axes):
  """(kept axes, kept torus, mesh axes, schedule) with unit axes dropped."""
  from torus_collectives.kernels import pallas_backend

  if not 1 <= len(axes) == len(torus) <= 3:
    raise ValueError(f"expected 1 to 3 torus axes, got {axes=}, {torus=}")
  kept_torus, kept_axes = drop_unit_axes(tuple(int(n) for n in torus), tuple(axes))
  if mesh_axes is None:
    mesh_axes, _ = pallas_backend._target()
  if not kept_axes:
    return kept_axes, kept_torus, tuple(mesh_axes), None
  schedule = schedule_lib.build(collective, kept_torus, schedule_lib.default_variant(kept_torus))
  return kept_axes, kept_torus, tuple(mesh_axes), schedule


def _width(m: int, streams: int) -> int:
  """The chunk width of ``backends.shard_map`` (``_padded_width``): whole 128-element
  rows per stream."""
  return _up(m, streams * LANES)


def _launch(collective, x, axes, torus, mesh_axes, piece_rows):
  """Checks ``x``, lays it out as the ``shard_map`` implementation's chunk grid and runs
  the kernel: (its float32 result, ``m``, ``p``, ``width``), or None on a torus of one."""
  if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"expected a 1-D floating buffer, got {x.shape} {x.dtype}")
  axes, torus, mesh_axes, schedule = _plan(collective, axes, torus, mesh_axes)
  if schedule is None:
    return None
  p, wide = math.prod(torus), x.astype(jnp.float32)
  if collective == "reduce_scatter" and x.size % p:
    raise ValueError(f"reduce_scatter needs a size divisible by {p} devices, got {x.size=}")
  m = {"all_reduce": ceil_div(x.size, p), "reduce_scatter": x.size // p}.get(collective, x.size)
  width = _width(m, schedule.num_streams)
  if collective == "all_gather":
    grid = pad_to(wide, width)
  else:
    grid = pad_chunks(pad_to(wide, p * m), p, width)
  lay = QLayout(schedule, width // (schedule.num_streams * LANES), piece_rows)
  grid = ensure_varying(grid.reshape(-1, LANES), axes)
  return _call(collective, grid, schedule, axes, mesh_axes, lay), m, p, width


def quantized_all_reduce(
  x: jax.Array,
  axes: Sequence[str],
  torus: Sequence[int],
  mesh_axes: Sequence[str] | None = None,
  *,
  piece_rows: int = PIECE_ROWS,
) -> jax.Array:
  """``[n] -> [n]``: the sum over the torus with int8 block-scaled transport, identical
  on every device, equal to ``backends.shard_map.all_reduce(x, axes, torus,
  transport=(BlockScaled("int8"),) * len(axes))``. Call inside ``shard_map``."""
  launched = _launch("all_reduce", x, axes, torus, mesh_axes, piece_rows)
  if launched is None:
    return x
  out, m, p, width = launched
  return out.reshape(p, width)[:, :m].reshape(-1)[: x.size].astype(x.dtype)


def quantized_reduce_scatter(
  x: jax.Array,
  axes: Sequence[str],
  torus: Sequence[int],
  mesh_axes: Sequence[str] | None = None,
  *,
  piece_rows: int = PIECE_ROWS,
) -> jax.Array:
  """``[p*m] -> [m]``: this device's chunk of the sum, int8 block-scaled on every hop;
  equal to ``backends.shard_map.reduce_scatter(..., transport=...)``."""
  launched = _launch("reduce_scatter", x, axes, torus, mesh_axes, piece_rows)
  if launched is None:
    return x
  own, m, _, _ = launched
  return own.reshape(-1)[:m].astype(x.dtype)


def quantized_all_gather(
  x: jax.Array,
  axes: Sequence[str],
  torus: Sequence[int],
  mesh_axes: Sequence[str] | None = None,
  *,
  piece_rows: int = PIECE_ROWS,
) -> jax.Array:
  """``[m] -> [p*m]``: every device's chunk, each quantized once by its owner and
  dequantized by everyone; equal to ``backends.shard_map.all_gather(..., transport=...)``."""
  launched = _launch("all_gather", x, axes, torus, mesh_axes, piece_rows)
  if launched is None:
    return x
  out, m, p, width = launched
  return out.reshape(p, width)[:, :m].reshape(-1).astype(x.dtype)
