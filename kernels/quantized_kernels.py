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
``P`` rows (``PIECE_ROWS``) and one shorter rest: at most two piece sizes (``PieceKind``).
Blocks are rows, so a block never spans two chunks or two streams, as the format requires.
32-bit DMAs of a ``[rows, 128]`` HBM array may start and end at any row. Int8 DMAs start
and end on 4-row boundaries (one 512-byte DMA word; Mosaic: "aligned to the unit subtile
(4)"), so an int8 piece of ``r`` rows travels as ``ceil4(r)`` rows (up to 3 rows of
padding per piece of the rest kind).
Glue: the wrapper pads each chunk to ``width``, reshapes the buffer to rows of 128, and
slices the result. When ``n == p * width`` (e.g. 2**20 elements on 16 devices) the
reshapes are bitcasts, and the only op XLA puts around the kernel is the copy of the
program's result. Otherwise XLA emits pads, relayout reshapes and a slice.

Wire format of a piece. The int8 values ``q`` take ``[ceil4(rows), 128]``. The scales take
one ``[1, 128]`` int32 row: lane ``l`` holds the bfloat16 bits of row ``l``'s scale in its
low half and those of row ``l + 128`` in its high half. So a piece of 256 rows (32,768
elements) carries 512 bytes of scales, 2 bytes per block, as the format says. A shorter
piece still sends the whole 512-byte row. The scale row is built from a column by a
masked sublane sum (``_pack``), and turned back into a column by a masked lane sum
(``_unpack``): no transposes, reshapes, bfloat16 vectors or 16-bit DMAs.

The wire never touches HBM. Each (stream, piece kind) has two rings of ``_SLOTS`` VMEM
slots on every device: a receive ring, which the upstream neighbour's remote DMAs write,
and a staging ring, from which this device's remote DMAs read. A piece goes from the
sender's staging slot straight into the same slot of the receiver's receive ring. HBM
holds only what must outlive a piece: the input (read), the float32 result or work
buffer ``out``, and, for gathers, ``q_gather`` / ``s_gather``, the int8 values and scale
rows of the chunks that a later phase sends (chunk ``c``, stream ``s``, piece ``k`` at
row ``(c * S + s) * Rq + k * P`` / ``(c * S + s) * pieces + k``).

Order: the pipelined ring. A phase (one stream's ring reduce-scatter or all-gather along
one axis, ``hops = n - 1`` transfers) runs piece by piece: for every piece position of its
slabs (chunk ``j`` of the slab, piece ``k``), for every hop ``h``, the device takes in what
hop ``h - 1`` brought for that position and sends hop ``h``'s piece. Within a ring phase
the slab sent at hop ``h`` is the one received at hop ``h - 1``, so a piece's partial sum
moves on as soon as it is formed:

* reduce-scatter: hop 0 quantizes the own partial sums (from the input in the stream's
  first phase, from ``out`` later) into a staging slot and sends them. At hop ``h >= 1``
  the piece received at hop ``h - 1`` is dequantized and added to the own float32 terms
  (``deq + own``), and the sum is quantized into a staging slot and sent. After the last
  hop the sum is stored: in float32 into ``out`` (a phase's end) or into the own-chunk
  output (a reduce-scatter's result), or, where an all-gather follows, quantized once,
  its int8 bytes kept in ``q_gather`` and their dequantized values stored in ``out``.
* all-gather: hop 0 sends the piece's bytes from ``q_gather``. A received piece is
  dequantized into ``out``, copied (VMEM to VMEM) into a staging slot and sent on, and
  kept in ``q_gather`` if a later phase sends it again. Every device thus dequantizes
  the same bytes, the own chunk's included, so the result is bitwise the same
  everywhere. An all-gather alone first quantizes the own chunk from the input.

The i-th phases of all streams run together, their pieces interleaved, when they have
the same hops and slab size (every phase of the square tori), so all 2N links of a chip
carry traffic at once; otherwise one stream's phase runs after another's.

Flow control (semaphores). Before the first phase, the entry barrier
(``pltpu.get_barrier_semaphore``, signalled to each upstream neighbour of every link the
schedule uses). Within a phase, per (stream, piece kind):

* credits: a REGULAR semaphore per (stream, phase, kind) on the sender, signalled by the
  receiver. On starting a phase the receiver grants ``_SLOTS`` pieces (its receive ring
  is empty: it has taken in every piece of its previous phase); after taking in its
  n-th piece it grants one more, unless no piece ``n + _SLOTS`` comes. The sender waits
  for one credit before each send. Both ends count the ring's pieces in the same order,
  so piece ``n`` goes to slot ``n mod _SLOTS`` and is sent only once piece
  ``n - _SLOTS`` has been taken in. Credits are kept per phase, since the upstream
  device changes between phases; grants and waits balance, so every semaphore ends at 0.
* arrival: a DMA semaphore per (stream, kind, slot) on the receiver; a slot holds one
  piece at a time, so the two DMAs of a piece are the only ones counted on it.
* departure: a DMA semaphore per (stream, kind, slot) on the sender; before a staging
  slot is refilled, its previous piece's two DMAs are waited for (pieces of one kind all
  have the same size, so the wait is exact), and at a phase's end every slot's last.

No deadlock: every device runs its events in the same order (phase, chunk, kind, piece,
hop, stream), and each event waits only on events earlier in that order (the piece of
hop ``h - 1``, and the taking-in of the piece ``_SLOTS`` earlier on the same ring); a
device grants its credit before it waits for its own. ``collective_id``:
``torus_kernels.collective_id`` of the kind string "quantized_<collective>", so it differs
from the blocking kernels' ids.

HBM traffic (``cost``, checked against the DMAs counted in interpret mode by
``tests/test_kernel_accounting.py``): per element and hop, the own float32 term is read;
the wire is VMEM to VMEM; the result is written once in float32. On v5e:4x4 at 2**20
float32 elements per device the compiler's bytes accessed are 0.81 of the bfloat16
blocking kernel's floor on bfloat16 data and 0.40 of the float32 kernel's (compiler
estimate; the float32 reads and writes of the own terms and the result are most of it).

What is simple here and could be faster: local loads and stores of own terms are
synchronous (no double buffering across pieces; on a TPU this latency, not the links,
would bound small and mid-sized all-reduces). Every piece, however short, sends a whole
512-byte scale row (4 bytes per block where a slice has at most 128 rows). Only int8
blocks of 128 on every axis are supported, on float32 partial sums (a bfloat16 input is
widened by the wrapper, as the ``shard_map`` implementation does). Nothing here has run on
a TPU: it is verified in interpret mode and compiles for v4, v5e and v6e
(``tests/test_quantized_kernels.py``).
"""

from __future__ import annotations

import dataclasses
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
_SLOTS = 2  # ring slots per (stream, piece kind): a piece is computed while the last travels
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


@dataclasses.dataclass(frozen=True)
class PieceKind:
  """The pieces of one size in a stream slice: ``count`` of ``rows`` rows, the first at
  row ``first`` of the slice. A slice has at most two kinds: whole pieces and its rest."""

  count: int
  rows: int
  first: int
  index: int  # piece index (within the slice) of the kind's first piece

  @property
  def q_rows(self) -> int:
    """Int8 rows a piece takes on the wire (int8 DMAs move whole 4-row words)."""
    return _up(self.rows, _QUANTUM)

  @property
  def buf_rows(self) -> int:
    """Rows of a VMEM slot: whole int8 tiles."""
    return _up(self.rows, 32)


class QLayout:
  """Where the grid, its pieces and their int8 and scale images lie (module docstring)."""

  def __init__(self, schedule: schedule_lib.Schedule, rows: int, piece_rows: int = PIECE_ROWS):
    if piece_rows % 32 or not 32 <= piece_rows <= 2 * _SUB:
      raise ValueError(f"piece_rows must be a multiple of 32 in [32, 256], got {piece_rows}")
    self.chunks, self.streams, self.rows = schedule.num_devices, schedule.num_streams, rows
    self.piece_rows = min(piece_rows, _up(rows, 32))
    self.pieces = [(o, min(self.piece_rows, rows - o)) for o in range(0, rows, self.piece_rows)]
    self.q_rows = _up(rows, _QUANTUM)  # int8 rows per slice
    whole, rest = divmod(rows, self.piece_rows)
    self.kinds = [PieceKind(whole, self.piece_rows, 0, 0)] if whole else []
    if rest:
      self.kinds.append(PieceKind(1, rest, whole * self.piece_rows, whole))
    self.buf_rows = self.piece_rows

  @property
  def grid_rows(self) -> int:
    return self.chunks * self.streams * self.rows

  def data_row(self, chunk, stream: int, offset):
    return chunk * (self.streams * self.rows) + stream * self.rows + offset

  def q_row(self, index, offset):
    row = index * self.q_rows + offset
    return row if isinstance(row, int) else pl.multiple_of(row, _QUANTUM)

  def s_row(self, index, piece):
    return index * len(self.pieces) + piece


@dataclasses.dataclass(frozen=True)
class PhaseRun:
  """One stream's ring phase: its ``transfers`` (one per hop), its index in the stream,
  whether it is the stream's first phase, and the kind of the phase after it (or None)."""

  stream: int
  index: int
  transfers: tuple
  first: bool
  next_kind: str | None

  @property
  def phase(self) -> schedule_lib.Phase:
    return self.transfers[0].phase

  @property
  def hops(self) -> int:
    return len(self.transfers)

  def slab_size(self, torus) -> int:
    tr = self.transfers[0]
    return math.prod(torus[a] for a in tr.live_axes if a != tr.phase.axis)


def phase_groups(schedule: schedule_lib.Schedule) -> list[list[PhaseRun]]:
  """The order in which the kernel runs the phases: the i-th phase of every stream
  together (their pieces interleaved, so all links carry traffic at once) when they have
  the same hops and slab size, else one stream's after another's."""
  runs = []
  for s in range(schedule.num_streams):
    transfers = schedule.stream_transfers(s)
    phases = [p for p in schedule.streams[s] if schedule.torus[p.axis] > 1]
    stream_runs, at = [], 0
    for i, phase in enumerate(phases):
      hops = schedule.torus[phase.axis] - 1
      following = phases[i + 1].kind if i + 1 < len(phases) else None
      stream_runs.append(PhaseRun(s, i, tuple(transfers[at : at + hops]), i == 0, following))
      at += hops
    runs.append(stream_runs)
  groups = []
  for i in range(max(len(r) for r in runs)):
    round_ = [r[i] for r in runs if i < len(r)]
    shapes = {(r.hops, r.slab_size(schedule.torus), r.phase.kind) for r in round_}
    groups += [round_] if len(shapes) == 1 else [[r] for r in round_]
  return groups


# ----------------------------------------------------------------------------------------
# The kernel


def _when(condition, body) -> None:
  """``body()`` under ``condition``: a Python bool decides at trace time."""
  if isinstance(condition, bool):
    if condition:
      body()
  else:
    pl.when(condition)(lambda: (body(), None)[1])


# One straight program, as torus_kernels' are (pyproject's per-file C901 exemption says why).
def _kernel(schedule, topo_args, lay: QLayout, collective, coords_ref, x_ref, *refs):  # noqa: C901
  refs = list(refs)
  out_ref = refs.pop(0)  # float32: the work buffer (phase ends), then the result
  own_ref = refs.pop(0) if collective == "reduce_scatter" else None
  qg, sg = (refs.pop(0), refs.pop(0)) if collective != "reduce_scatter" else (None, None)
  rings = [tuple(refs.pop(0) for _ in range(4)) for _ in lay.kinds]  # (rq, rs, tq, ts)
  recv_sems, send_sems, credits, f_buf, q_buf, s_buf, local = refs
  topo = _Topology(*topo_args, coords_ref)
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

  def load_f32(ref, row, rows):
    run_copies([(rows_at(ref, row, rows), f_buf.at[pl.ds(0, rows)])])
    return [f_buf[pl.ds(first, n), :] for _, first, n in _sub_blocks(rows)]

  def store_f32(values, rows, dst_ref, row):
    for (_, first, n), v in zip(_sub_blocks(rows), values):
      f_buf[pl.ds(first, n), :] = v
    run_copies([(f_buf.at[pl.ds(0, rows)], rows_at(dst_ref, row, rows))])

  def dequantized(q_view, s_view, rows):
    words = s_view[pl.ds(0, 1), :]
    return [
      q_view[pl.ds(first, n), :].astype(jnp.float32) * _unpack(words, n, half)
      for half, first, n in _sub_blocks(rows)
    ]

  def quantize_into(values, rows, q_view, s_view):
    words = None
    for (half, first, n), v in zip(_sub_blocks(rows), values):
      q, w = _quantize(v)
      q_view[pl.ds(first, n), :] = q
      w = lax.shift_left(w, 16 * half) if half else w
      words = w if words is None else words | w
    s_view[pl.ds(0, 1), :] = words

  def to_gather(q_view, s_view, kind, gi, offset, piece):
    """Local DMAs of a piece's int8 rows and scale row into the gather buffers."""
    run_copies(
      [
        (q_view.at[pl.ds(0, kind.q_rows)], rows_at(qg, lay.q_row(gi, offset), kind.q_rows)),
        (s_view.at[pl.ds(0, 1)], rows_at(sg, lay.s_row(gi, piece), 1)),
      ]
    )

  # --- the wire --------------------------------------------------------------------------
  def wire(run, ki, slot):
    """The two remote DMAs of a ring slot: int8 rows and scale row, from this device's
    staging slot to the same slot of the downstream device's receive ring."""
    rq, rs, tq, ts = rings[ki]
    qn, s = lay.kinds[ki].q_rows, run.stream
    target = topo.neighbour(run.phase.axis, run.phase.direction)
    return [
      pltpu.make_async_remote_copy(
        src.at[s, slot, pl.ds(0, n)],
        dst.at[s, slot, pl.ds(0, n)],
        send_sems.at[s, ki, slot],
        recv_sems.at[s, ki, slot],
        device_id=target,
      )
      for src, dst, n in ((tq, rq, qn), (ts, rs, 1))
    ]

  def upstream(run):
    return topo.neighbour(run.phase.axis, -run.phase.direction)

  def piece_event(run, j, ki, k, h):  # noqa: C901
    """Hop ``h`` of piece ``k`` (of kind ``ki``) of the ``j``-th chunk of ``run``'s slabs:
    take in what hop ``h - 1`` received (none at hop 0), then send hop ``h``'s piece
    (none after the last hop)."""
    kind, s, hops = lay.kinds[ki], run.stream, run.hops
    rq, rs, tq, ts = rings[ki]
    per_chunk = kind.count * hops
    total = run.slab_size(torus) * per_chunk
    seq = lambda hop: (j * kind.count + k) * hops + hop  # this ring's n-th piece
    offset = kind.first + k * kind.rows
    if not isinstance(offset, int):
      offset = pl.multiple_of(offset, 32)
    piece = kind.index + k
    rs_kind = run.phase.kind == "reduce_scatter"
    sending = h < hops
    slot = seq(h) % _SLOTS if sending else None

    def free_stage():  # the staging slot's previous piece has left
      _when(seq(h) >= _SLOTS, lambda: [c.wait_send() for c in wire(run, ki, slot)])

    if h == 0:  # a phase's first hop sends own data
      tr = run.transfers[0]
      chunk = topo.slab_chunks(tr, topo.slab(tr.phase, 0, sending=True)).chunk(j)
      free_stage()
      if rs_kind:
        own = x_ref if run.first else out_ref
        values = load_f32(own, lay.data_row(chunk, s, offset), kind.rows)
        quantize_into(values, kind.rows, tq.at[s, slot], ts.at[s, slot])
      else:
        gi = chunk * lay.streams + s
        run_copies(
          [
            (
              rows_at(qg, lay.q_row(gi, offset), kind.q_rows),
              tq.at[s, slot, pl.ds(0, kind.q_rows)],
            ),
            (rows_at(sg, lay.s_row(gi, piece), 1), ts.at[s, slot, pl.ds(0, 1)]),
          ]
        )
    else:
      tr = run.transfers[h - 1]
      chunk = topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=False)).chunk(j)
      got = seq(h - 1) % _SLOTS
      for c in wire(run, ki, got):
        c.wait_recv()
      received = dequantized(rq.at[s, got], rs.at[s, got], kind.rows)
      if rs_kind:
        own = load_f32(x_ref if run.first else out_ref, lay.data_row(chunk, s, offset), kind.rows)
        values = [r + o for r, o in zip(received, own)]
        if sending:  # the sum goes on at once
          free_stage()
          quantize_into(values, kind.rows, tq.at[s, slot], ts.at[s, slot])
        elif run.next_kind == "all_gather":  # the reduced own chunk, quantized once
          quantize_into(values, kind.rows, q_buf, s_buf)
          store_f32(
            dequantized(q_buf, s_buf, kind.rows), kind.rows, out_ref, lay.data_row(chunk, s, offset)
          )
          to_gather(q_buf, s_buf, kind, chunk * lay.streams + s, offset, piece)
        elif run.next_kind is None and own_ref is not None:  # a reduce-scatter's result
          store_f32(values, kind.rows, own_ref, lay.data_row(0, s, offset))
        else:  # a phase's end: the next phase reads it
          store_f32(values, kind.rows, out_ref, lay.data_row(chunk, s, offset))
      else:
        store_f32(received, kind.rows, out_ref, lay.data_row(chunk, s, offset))
        if sending:  # forward the bytes unchanged
          free_stage()
          for _, first, n in _sub_blocks(kind.rows):
            tq[s, slot, pl.ds(first, n), :] = rq[s, got, pl.ds(first, n), :]
          ts[s, slot, pl.ds(0, 1), :] = rs[s, got, pl.ds(0, 1), :]
        if run.next_kind == "all_gather":  # a later phase sends it again
          to_gather(rq.at[s, got], rs.at[s, got], kind, chunk * lay.streams + s, offset, piece)
      # The receive slot is free: the upstream may send the piece that comes _SLOTS later.
      _when(
        seq(h - 1) + _SLOTS < total,
        lambda: pl.semaphore_signal(credits.at[s, run.index, ki], 1, device_id=upstream(run)),
      )
    if sending:
      pl.semaphore_wait(credits.at[s, run.index, ki], 1)
      for c in wire(run, ki, slot):
        c.start()

  def ring_sizes(run):
    """(kind index, pieces the run sends on that ring) per piece kind."""
    return [(ki, run.slab_size(torus) * kind.count * run.hops) for ki, kind in enumerate(lay.kinds)]

  def open_rings(group):
    """Lets each upstream device send the first ``_SLOTS`` pieces of each ring."""
    for run in group:
      for ki, total in ring_sizes(run):
        signal = min(_SLOTS, total)
        pl.semaphore_signal(credits.at[run.stream, run.index, ki], signal, device_id=upstream(run))

  def close_rings(group):
    """Waits until every staging slot's last piece has left."""
    for run in group:
      for ki, total in ring_sizes(run):
        for slot in range(min(_SLOTS, total)):
          for c in wire(run, ki, slot):
            c.wait_send()

  def run_group(group):
    open_rings(group)

    def chunk_body(j):
      for ki, kind in enumerate(lay.kinds):

        def piece_body(k, ki=ki):
          for h in range(group[0].hops + 1):
            for run in group:
              piece_event(run, j, ki, k, h)

        for_each(kind.count, piece_body)

    for_each(group[0].slab_size(torus), chunk_body)
    close_rings(group)

  def gather_own_input():
    """An all-gather alone: quantize the own chunk once, keep its bytes and its values."""
    for s in range(lay.streams):
      gi = own_chunk * lay.streams + s
      for kind in lay.kinds:

        def each(k, kind=kind, s=s, gi=gi):
          offset = kind.first + k * kind.rows
          if not isinstance(offset, int):
            offset = pl.multiple_of(offset, 32)
          values = load_f32(x_ref, lay.data_row(0, s, offset), kind.rows)
          quantize_into(values, kind.rows, q_buf, s_buf)
          store_f32(
            dequantized(q_buf, s_buf, kind.rows),
            kind.rows,
            out_ref,
            lay.data_row(own_chunk, s, offset),
          )
          to_gather(q_buf, s_buf, kind, gi, offset, kind.index + k)

        for_each(kind.count, each)

  # --- the schedule --------------------------------------------------------------------
  with jax.named_scope("barrier"):
    topo.barrier(schedule)
  if collective == "all_gather":
    with jax.named_scope("quantize_own"):
      gather_own_input()
  for g, group in enumerate(phase_groups(schedule)):
    with jax.named_scope(f"phase{g}_{group[0].phase.kind}"):
      run_group(group)


# ----------------------------------------------------------------------------------------
# Cost


def _wire(lay: QLayout) -> int:
  """Bytes of a stream slice on the wire: int8 rows plus a 512-byte scale row per piece."""
  return lay.q_rows * LANES + len(lay.pieces) * 4 * LANES


def cost(schedule: schedule_lib.Schedule, lay: QLayout, collective: str) -> pl.CostEstimate:
  """Every HBM access and remote byte the kernel makes, per device (every device makes
  the same ones, since the grid is whole). A local DMA counts a read and a write of HBM
  where its ends are in HBM; a remote DMA goes from VMEM to the neighbour's VMEM and
  touches no HBM. Flops: about 12 vector ops per element quantized, 3 per element
  dequantized and added, 2 per element dequantized."""
  accessed = remote = flops = 0
  torus = schedule.torus
  for group in phase_groups(schedule):
    for run in group:
      size, hops = run.slab_size(torus), run.hops
      for kind in lay.kinds:
        pieces = size * kind.count
        elements = kind.rows * LANES
        f32, wire = 4 * elements, kind.q_rows * LANES + 4 * LANES
        remote += pieces * hops * wire
        if run.phase.kind == "reduce_scatter":
          accessed += pieces * (hops + 1) * f32  # the own terms, at every hop and the end
          flops += pieces * (12 * hops + 3 * hops) * elements
          if run.next_kind == "all_gather":  # quantized, its values kept, its bytes kept
            accessed += pieces * (f32 + wire)
            flops += pieces * 14 * elements
          else:
            accessed += pieces * f32
        else:
          accessed += pieces * wire  # the first hop's bytes, from the gather buffers
          accessed += pieces * hops * f32  # every piece received, dequantized into out
          flops += pieces * hops * 2 * elements
          if run.next_kind == "all_gather":
            accessed += pieces * hops * wire
  if collective == "all_gather":  # the own chunk: read, quantized, kept, dequantized
    for kind in lay.kinds:
      elements = kind.rows * LANES
      wire = kind.q_rows * LANES + 4 * LANES
      accessed += lay.streams * kind.count * (8 * elements + wire)
      flops += lay.streams * kind.count * 14 * elements
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
  streams = schedule.num_streams
  phases = max(len(p) for p in schedule.streams)
  kinds = len(lay.kinds)
  outputs = [((lay.grid_rows, LANES), jnp.float32)]
  if collective == "reduce_scatter":
    outputs.append(((lay.streams * lay.rows, LANES), jnp.float32))
  else:
    gi = lay.chunks * lay.streams
    outputs += [((gi * lay.q_rows, LANES), jnp.int8), ((gi * len(lay.pieces), LANES), jnp.int32)]
  scratch = []
  for kind in lay.kinds:  # per kind: receive ring, then staging ring
    q = pltpu.VMEM((streams, _SLOTS, kind.buf_rows, LANES), jnp.int8)
    s = pltpu.VMEM((streams, _SLOTS, 8, LANES), jnp.int32)
    scratch += [q, s, q, s]
  scratch += [
    pltpu.SemaphoreType.DMA((streams, kinds, _SLOTS)),
    pltpu.SemaphoreType.DMA((streams, kinds, _SLOTS)),
    pltpu.SemaphoreType.REGULAR((streams, phases, kinds)),
    pltpu.VMEM((lay.buf_rows, LANES), jnp.float32),
    pltpu.VMEM((lay.buf_rows, LANES), jnp.int8),
    pltpu.VMEM((8, LANES), jnp.int32),
    pltpu.SemaphoreType.DMA((3,)),
  ]
  semaphores = streams * kinds * (2 * _SLOTS + phases) + 3
  if semaphores > _MAX_SEMAPHORES:
    raise ValueError(f"{semaphores} semaphores: more than the {_MAX_SEMAPHORES} a kernel may hold")
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
