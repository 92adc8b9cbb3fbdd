"""Block-scaled int8 transport in the remote-DMA torus kernels (``quantization``'s format).

These kernels carry out the same ``schedule.build(..., default_variant)`` schedules as
``torus_kernels``, with what ``backends.shard_map`` does with ``lax.ppermute`` and
``transport=(BlockScaled("int8"),) * len(axes)``. Every reduce-scatter hop sends the
partial sums of its slab as int8 values plus one bfloat16 scale per 128 elements. The
receiver dequantizes them, adds its own float32 partial sums, and quantizes the sum again
to send it on. The all-gather quantizes the owner's reduced chunk once and forwards the
bytes unchanged, and every device dequantizes each chunk as it arrives (its own from the
same bytes). So results, the order of adds
and the blocks are those of the ``shard_map`` implementation and ``quantization.simulate``.
In TPU interpret mode on CPU they match both bitwise. One caveat, shared with the
``shard_map`` implementation: XLA (on CPU and TPU) flushes subnormal results to zero, so a
block whose largest magnitude is under about 127 times the smallest normal float32
(1.5e-36) gets scale 0 and arrives as zeros, whereas numpy's ``simulate`` keeps a
subnormal scale. On a TPU the float32 reciprocal may also round differently, within
``quantization.error_bound``.

Layout. A device's buffer is the ``shard_map`` implementation's chunk grid: ``p`` chunks
of ``width`` elements (an even number of 128-element rows ``R`` per stream). An all-reduce
lays its ``n`` elements over the grid as they are: chunk ``c`` is elements
``[c * width, (c + 1) * width)``, and positions from ``n`` on do not exist (they count as
zeros, and nothing is read or written there). A reduce-scatter or all-gather has chunks of
the caller's ``m`` elements, each zero-padded to ``width``. Chunk ``c`` (row-major over the
torus coordinates) begins at grid row ``c * S * R``, and its stream slice ``s`` at
``+ s * R``. A slice is cut into pieces of ``P`` rows (``PIECE_ROWS``) and one shorter
rest: at most two piece sizes (``PieceKind``). Blocks are rows, so a block never spans two
chunks or two streams, as the format requires. Int8 DMAs start and end on 4-row
boundaries (one 512-byte DMA word; Mosaic: "aligned to the unit subtile (4)"), so an int8
piece of ``r`` rows travels as ``ceil4(r)`` rows (up to 3 rows of padding per piece of the
rest kind).

Glue. The all-reduce reads its 1-D input (float32, bfloat16 or float16) and writes its 1-D
result in the input's type in place (``Flat``): whole rows by 1-D DMAs of whole 512-byte
words, viewed as ``[rows, 128]`` in VMEM, and the last ``n`` modulo a word elements as a
small padded second input and a DMA of their own out. So the only XLA ops around it are a
slice and pad of those last elements (under 512 bytes), at any size (ResNet-50's
25,557,032-element gradient on v5e:4x4 and v5e:16x16 included; a program whose result is
the sum also gets XLA's copy of it out of the kernel's buffer). The reduce-scatter and
all-gather get a float32 ``[rows, 128]`` grid from the wrapper, which pads each chunk to
``width`` and slices the result: bitcasts where ``m`` is a whole ``width``, XLA pads,
relayouts and a slice otherwise.

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
holds only what must outlive a piece: the input (read), the result (an all-reduce's 1-D
result, or the float32 grid ``out``), the float32 work buffer ``out`` of partial sums
between two reduce-scatter phases, and, for gathers, ``q_gather`` / ``s_gather``, the int8
values and scale rows of the chunks that a later phase sends (chunk ``c``, stream ``s``,
piece ``k`` at row ``(c * S + s) * Rq + k * P`` / ``(c * S + s) * pieces + k``).

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
``tests/test_kernel_accounting.py``): the wire is VMEM to VMEM; the own terms are read at
every hop (from the input in a stream's first phase, so once per element there); the
result is written once. Compiler estimates for ResNet-50's gradient in one buffer, on
v5e:4x4: 0.50 of the bfloat16 blocking kernels' floor on a bfloat16 gradient; on a
float32 gradient, under 0.6 of sending it as bfloat16 (cast, bfloat16 kernels, cast
back) (``tests/test_quantized_kernels.py``).

What is simple here and could be faster: local loads and stores of own terms are
synchronous (no double buffering across pieces; on a TPU this latency, not the links,
would bound small and mid-sized all-reduces). Every piece, however short, sends a whole
512-byte scale row (4 bytes per block where a slice has at most 128 rows). Only int8
blocks of 128 on every axis are supported. Partial sums are float32 (the reduce-scatter
and all-gather widen a 16-bit input in the wrapper, as the ``shard_map`` implementation
does). Nothing here has run on a TPU: it is verified in interpret mode and compiles for
v4, v5e and v6e (``tests/test_quantized_kernels.py``).
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
from torus_collectives.layout import LANES, ceil_div, pad_chunks, pad_to

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
class Flat:
  """An all-reduce's 1-D input and result of ``n`` elements of ``dtype``, addressed in
  place over the grid's rows (no XLA pad, reshape or slice around the kernel).

  Grid row ``g`` holds elements ``[128 g, 128 g + 128)``. Rows below ``whole_rows`` move by
  DMA straight from and to the buffer (1-D DMAs of whole 512-byte words, viewed as rows
  in VMEM). The buffer's last ``tail`` elements (``n`` modulo a word) are no whole word:
  they arrive as a small second input, padded with zeros to ``tail_rows`` rows, and leave
  by a DMA of their own from a VMEM array of exactly their length (a DMA moves a slice
  shorter than a word only where it ends at the end of its array). Rows from
  ``whole_rows + tail_rows`` on do not exist: they are zeros, never read or written. One
  piece at most (``partial``) holds both existing and missing rows."""

  n: int
  dtype: object

  @property
  def word(self) -> int:
    return 512 // jnp.dtype(self.dtype).itemsize

  @property
  def tail(self) -> int:
    return self.n % self.word

  @property
  def whole_rows(self) -> int:
    return (self.n - self.tail) // LANES

  @property
  def tail_rows(self) -> int:
    return ceil_div(self.tail, LANES)

  def partial(self, lay: QLayout):
    """(grid row, stream, kind index) of the piece that holds row ``whole_rows``, or
    None when that row begins a piece and no tail follows (no piece is partial)."""
    row = self.whole_rows
    if row >= lay.grid_rows or (not self.tail and _piece_start(lay, row) == row):
      return None
    return _piece_start(lay, row), (row // lay.rows) % lay.streams, _kind_at(lay, row)


def _piece_start(lay: QLayout, row: int) -> int:
  """The first grid row of the piece that holds grid row ``row``."""
  slice_start = row - row % lay.rows
  return slice_start + (row - slice_start) // lay.piece_rows * lay.piece_rows


def _kind_at(lay: QLayout, row: int) -> int:
  within = row % lay.rows
  return next(i for i, k in enumerate(lay.kinds) if within < k.first + k.count * k.rows)


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


def needs_work_buffer(schedule: schedule_lib.Schedule) -> bool:
  """Whether a reduce-scatter phase hands partial sums to another (through ``out``)."""
  return any(r.next_kind == "reduce_scatter" for g in phase_groups(schedule) for r in g)


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
def _kernel(schedule, topo_args, lay: QLayout, collective, flat, coords_ref, x_ref, *refs):  # noqa: C901
  refs = list(refs)
  xt_ref = refs.pop(0) if flat is not None and flat.tail else None  # the padded tail rows
  res_ref = refs.pop(0) if flat is not None else None  # an all-reduce's 1-D result
  # float32 grid: the work buffer (phase ends); an all-gather's result
  out_ref = refs.pop(0) if flat is None or needs_work_buffer(schedule) else None
  own_ref = refs.pop(0) if collective == "reduce_scatter" else None
  qg, sg = (refs.pop(0), refs.pop(0)) if collective != "reduce_scatter" else (None, None)
  rings = [tuple(refs.pop(0) for _ in range(4)) for _ in lay.kinds]  # (rq, rs, tq, ts)
  recv_sems, send_sems, credits, f_buf, q_buf, s_buf, local = refs[:7]
  x_buf, xt_buf, t_buf = (refs[7:] + [None] * 3)[:3]
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

  # --- an all-reduce's 1-D input and result (``Flat``) ------------------------------------
  def flat_cases(g, s, ki):
    """(whole, partial) conditions of the piece at grid row ``g``: all its rows lie below
    ``whole_rows``; it is the partial piece (None if no piece of this stream and kind is)."""
    rows, part = lay.kinds[ki].rows, flat.partial(lay)
    whole = g + rows <= flat.whole_rows
    holds = part is not None and part[1:] == (s, ki)
    return whole, (g == part[0]) if holds else None

  def elements(row, rows):
    start = row * LANES
    start = start if isinstance(start, int) else pl.multiple_of(start, flat.word)
    return pl.ds(start, rows * LANES)

  def load_flat(chunk, s, offset, ki):
    """The float32 values of a piece of the 1-D input, zeros where rows do not exist."""
    rows = lay.kinds[ki].rows
    g = lay.data_row(chunk, s, offset)
    whole, partial = flat_cases(g, s, ki)

    def from_input(row, n):
      run_copies([(x_ref.at[elements(row, n)], x_buf.at[pl.ds(0, n * LANES)])])
      return x_buf[pl.ds(0, n * LANES)].astype(jnp.float32).reshape(n, LANES)

    def zeros():
      f_buf[pl.ds(0, _up(rows, 32)), :] = jnp.zeros((_up(rows, 32), LANES), jnp.float32)

    def whole_piece():
      f_buf[pl.ds(0, rows), :] = from_input(g, rows)

    def partial_piece():
      zeros()
      start, tail_rows = flat.partial(lay)[0], flat.tail_rows
      present = flat.whole_rows - start
      if present:
        f_buf[pl.ds(0, present), :] = from_input(start, present)
      if tail_rows:
        run_copies([(xt_ref, xt_buf)])
        tail = xt_buf[...].astype(jnp.float32).reshape(tail_rows, LANES)
        f_buf[pl.ds(present, tail_rows), :] = tail

    _when(whole, whole_piece)
    if partial is None:
      _when(jnp.logical_not(whole) if not isinstance(whole, bool) else not whole, zeros)
    else:
      _when(partial, partial_piece)
      missing = jnp.logical_and(jnp.logical_not(whole), jnp.logical_not(partial))
      _when(missing if not isinstance(g, int) else (not whole and not partial), zeros)
    return [f_buf[pl.ds(first, n), :] for _, first, n in _sub_blocks(rows)]

  def store_flat(values, chunk, s, offset, ki):
    """Writes a piece's values to the 1-D result, where its rows exist."""
    rows, dtype = lay.kinds[ki].rows, jnp.dtype(flat.dtype)
    g = lay.data_row(chunk, s, offset)
    whole, partial = flat_cases(g, s, ki)
    for (_, first, n), v in zip(_sub_blocks(rows), values):
      f_buf[pl.ds(first, n), :] = v

    def to_result(row, n, at):
      x_buf[pl.ds(0, n * LANES)] = f_buf[pl.ds(at, n), :].reshape(n * LANES).astype(dtype)
      run_copies([(x_buf.at[pl.ds(0, n * LANES)], res_ref.at[elements(row, n)])])

    def partial_piece():
      start = flat.partial(lay)[0]
      present = flat.whole_rows - start
      if present:
        to_result(start, present, 0)
      if flat.tail:
        rows_out = f_buf[pl.ds(present, flat.tail_rows), :]
        t_buf[...] = rows_out.reshape(flat.tail_rows * LANES)[: flat.tail].astype(dtype)
        run_copies([(t_buf, res_ref.at[pl.ds(flat.n - flat.tail, flat.tail)])])

    _when(whole, lambda: to_result(g, rows, 0))
    if partial is not None:
      _when(partial, partial_piece)

  def own_terms(run, chunk, s, offset, ki):
    if run.first and flat is not None:
      return load_flat(chunk, s, offset, ki)
    row = lay.data_row(chunk, s, offset)
    return load_f32(x_ref if run.first else out_ref, row, lay.kinds[ki].rows)

  def store_result(values, chunk, s, offset, ki):
    if flat is not None:
      store_flat(values, chunk, s, offset, ki)
    else:
      store_f32(values, lay.kinds[ki].rows, out_ref, lay.data_row(chunk, s, offset))

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
        values = own_terms(run, chunk, s, offset, ki)
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
        own = own_terms(run, chunk, s, offset, ki)
        values = [r + o for r, o in zip(received, own)]
        if sending:  # the sum goes on at once
          free_stage()
          quantize_into(values, kind.rows, tq.at[s, slot], ts.at[s, slot])
        elif run.next_kind == "all_gather":  # the reduced own chunk, quantized once
          quantize_into(values, kind.rows, q_buf, s_buf)
          store_result(dequantized(q_buf, s_buf, kind.rows), chunk, s, offset, ki)
          to_gather(q_buf, s_buf, kind, chunk * lay.streams + s, offset, piece)
        elif run.next_kind is None and own_ref is not None:  # a reduce-scatter's result
          store_f32(values, kind.rows, own_ref, lay.data_row(0, s, offset))
        else:  # a phase's end: the next phase reads it
          store_f32(values, kind.rows, out_ref, lay.data_row(chunk, s, offset))
      else:
        store_result(received, chunk, s, offset, ki)
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


def _run_cost(run: PhaseRun, kind: PieceKind, torus, flat: Flat | None) -> tuple[int, int, int]:
  """(HBM bytes, remote bytes, flops) of one phase's pieces of one kind (see ``cost``)."""
  size, hops = run.slab_size(torus), run.hops
  pieces, elements = size * kind.count, kind.rows * LANES
  f32, wire = 4 * elements, kind.q_rows * LANES + 4 * LANES
  result = 0 if flat is not None else f32  # a flat result is counted once, in ``cost``
  accessed, remote = 0, pieces * hops * wire
  if run.phase.kind == "reduce_scatter":
    if not (run.first and flat is not None):
      accessed += pieces * (hops + 1) * f32  # the own terms, at every hop and the end
    flops = pieces * 15 * hops * elements
    if run.next_kind == "all_gather":  # quantized, its bytes kept, its values stored
      accessed += pieces * (wire + result)
      flops += pieces * 14 * elements
    else:
      accessed += pieces * f32
  else:
    accessed += pieces * wire  # the first hop's bytes, from the gather buffers
    accessed += pieces * hops * result  # every piece received, dequantized
    flops = pieces * hops * 2 * elements
    if run.next_kind == "all_gather":
      accessed += pieces * hops * wire
  return accessed, remote, flops


def cost(
  schedule: schedule_lib.Schedule, lay: QLayout, collective: str, flat: Flat | None = None
) -> pl.CostEstimate:
  """Every HBM access and remote byte the kernel makes, per device (every device makes
  the same ones, since the grid is whole). A local DMA counts a read and a write of HBM
  where its ends are in HBM; a remote DMA goes from VMEM to the neighbour's VMEM and
  touches no HBM. With ``flat`` (an all-reduce), the first phase reads every element of
  the input once, the padded tail rows included, and the result is written once; rows
  that do not exist are neither read nor written. Flops: about 12 vector ops per element
  quantized, 3 per element dequantized and added, 2 per element dequantized."""
  accessed = remote = flops = 0
  for group in phase_groups(schedule):
    for run in group:
      for kind in lay.kinds:
        run_bytes, run_remote, run_flops = _run_cost(run, kind, schedule.torus, flat)
        accessed, remote, flops = accessed + run_bytes, remote + run_remote, flops + run_flops
  if collective == "all_gather":  # the own chunk: read, quantized, kept, dequantized
    for kind in lay.kinds:
      elements = kind.rows * LANES
      wire = kind.q_rows * LANES + 4 * LANES
      accessed += lay.streams * kind.count * (8 * elements + wire)
      flops += lay.streams * kind.count * 14 * elements
  if flat is not None:
    itemsize = jnp.dtype(flat.dtype).itemsize
    rows_read = min(flat.whole_rows, lay.grid_rows) + flat.tail_rows
    accessed += (rows_read * LANES + flat.n) * itemsize
  return pl.CostEstimate(
    flops=flops, transcendentals=0, bytes_accessed=accessed, remote_bytes_transferred=remote
  )


# ----------------------------------------------------------------------------------------
# pallas_call and the shard_map-level wrappers


def _hbm(x: jax.Array, shape, dtype):
  aval = jax.typeof(x).update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False)
  return pltpu.HBM.from_type(aval)


def _call(collective, x, schedule, axes, mesh_axes, lay: QLayout, flat: Flat | None):
  """Runs the quantized ``collective`` kernel: on the 1-D all-reduce input ``x`` (with
  ``flat``), returning its 1-D result, or on the 2-D float32 grid ``x`` (rows of 128),
  returning the own chunk's float32 sums (reduce-scatter) or the dequantized grid."""
  streams = schedule.num_streams
  phases = max(len(p) for p in schedule.streams)
  kinds = len(lay.kinds)
  inputs, outputs = [x], []
  if flat is not None:
    if flat.tail:
      inputs.append(jnp.pad(x[flat.n - flat.tail :], (0, flat.tail_rows * LANES - flat.tail)))
    outputs.append(((flat.n,), x.dtype))
  if flat is None or needs_work_buffer(schedule):
    outputs.append(((lay.grid_rows, LANES), jnp.float32))
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
  if flat is not None:  # the input's and result's pieces, their tail rows, the tail
    scratch.append(pltpu.VMEM((lay.buf_rows * LANES,), x.dtype))
    if flat.tail:
      scratch += [
        pltpu.VMEM((flat.tail_rows * LANES,), x.dtype),
        pltpu.VMEM((flat.tail,), x.dtype),
      ]
  semaphores = streams * kinds * (2 * _SLOTS + phases) + 3
  if semaphores > _MAX_SEMAPHORES:
    raise ValueError(f"{semaphores} semaphores: more than the {_MAX_SEMAPHORES} a kernel may hold")
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(
    _kernel, schedule, (tuple(axes), schedule.torus, tuple(mesh_axes)), lay, collective, flat
  )
  results = pl.pallas_call(
    kernel,
    out_shape=tuple(_hbm(x, shape, dtype) for shape, dtype in outputs),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[any_spec] * len(inputs),
      out_specs=(any_spec,) * len(outputs),
      scratch_shapes=scratch,
    ),
    cost_estimate=cost(schedule, lay, collective, flat),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id(f"quantized_{collective}", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_quantized_{collective}_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), *inputs)
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
  """The chunk width of ``backends.shard_map`` (``_padded_width``): an even number of
  128-element rows per stream, so a 16-bit buffer's slices start on DMA words."""
  return _up(m, 2 * streams * LANES)


def _launch(collective, x, axes, torus, mesh_axes, piece_rows):
  """Checks ``x``, lays it out as the ``shard_map`` implementation's chunk grid and runs
  the kernel: (its result, ``m``, ``p``, ``width``), or None on a torus of one. An
  all-reduce addresses ``x`` in place (``Flat``); the others get a float32 grid."""
  if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"expected a 1-D floating buffer, got {x.shape} {x.dtype}")
  axes, torus, mesh_axes, schedule = _plan(collective, axes, torus, mesh_axes)
  if schedule is None:
    return None
  p, streams = math.prod(torus), schedule.num_streams
  if collective == "reduce_scatter" and x.size % p:
    raise ValueError(f"reduce_scatter needs a size divisible by {p} devices, got {x.size=}")
  m = {"all_reduce": ceil_div(x.size, p), "reduce_scatter": x.size // p}.get(collective, x.size)
  width = _width(m, streams)
  lay = QLayout(schedule, width // (streams * LANES), piece_rows)
  if collective == "all_reduce":  # chunks of ``width`` back to back; padding at the end
    flat = x if x.dtype.itemsize in (2, 4) else x.astype(jnp.float32)
    flat = ensure_varying(flat, axes)
    return (
      _call(collective, flat, schedule, axes, mesh_axes, lay, Flat(x.size, flat.dtype)),
      m,
      p,
      width,
    )
  wide = x.astype(jnp.float32)
  grid = pad_to(wide, width) if collective == "all_gather" else pad_chunks(wide, p, width)
  grid = ensure_varying(grid.reshape(-1, LANES), axes)
  return _call(collective, grid, schedule, axes, mesh_axes, lay, None), m, p, width


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
  transport=(BlockScaled("int8"),) * len(axes))``. Call inside ``shard_map``. ``x`` is
  read and the result written in place, in ``x``'s type (16- and 32-bit floats; others
  are summed as float32): no XLA op on the buffer surrounds the kernel (only a slice and
  pad of its last ``n`` modulo 512 bytes)."""
  launched = _launch("all_reduce", x, axes, torus, mesh_axes, piece_rows)
  if launched is None:
    return x
  return launched[0].astype(x.dtype)


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
