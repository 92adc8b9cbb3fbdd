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
``remote_dma.collective_id`` of the kind string "quantized_<collective>", so it differs
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
from typing import Any

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
from torus_collectives.kernels.remote_dma import (
  MAX_SEMAPHORES,
  Topology,
  collective_id,
  copy_and_wait,
  mesh_coordinates,
  mesh_target,
)
from torus_collectives.tiling import LANES, ceil_div, pad_chunks, pad_to

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
# The kernel's refs: pytrees that ``pallas_call`` flattens in field order (None fields hold
# nothing) and hands to the kernel in the same shape, each field a ref named for what it holds.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Ring:
  """The VMEM rings of one piece kind, each indexed ``[stream, slot]``: a piece's int8
  rows (``PieceKind.buf_rows`` of them) and its scale row (in the first of 8 rows)."""

  recv_q: Any  # int8 rows, written by the upstream neighbour's remote DMAs
  recv_s: Any  # scale rows, likewise
  stage_q: Any  # int8 rows that this device's remote DMAs send
  stage_s: Any  # scale rows, likewise


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Inputs:
  """The kernel's inputs, in HBM; ``x_tail`` is None without a tail."""

  x: Any  # an all-reduce's 1-D buffer (``Flat``), else the float32 grid [rows, 128]
  x_tail: Any  # an all-reduce's last ``Flat.tail`` elements, zero-padded to whole rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Outputs:
  """The kernel's outputs, in HBM; None where the collective has no such buffer."""

  result: Any  # an all-reduce's 1-D result, in its input's type
  out: Any  # the float32 grid: partial sums between two phases; an all-gather's result
  own: Any  # a reduce-scatter's result: the own chunk's float32 sums, [S * R, 128]
  q_gather: Any  # int8 rows of the chunks that a later phase sends
  s_gather: Any  # their scale rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Scratch:
  """The kernel's scratch: the wire's rings and semaphores, and the VMEM of local moves.
  The last three are None but for an all-reduce (``Flat``), the last two without a tail."""

  rings: tuple[_Ring, ...]  # per piece kind
  recv_sems: Any  # DMA [stream, kind, slot]: a receive slot's piece has arrived
  send_sems: Any  # DMA [stream, kind, slot]: a staging slot's piece has left
  credits: Any  # REGULAR [stream, phase, kind]: receive slots the downstream device grants
  f_buf: Any  # float32 [P, 128]: a piece's values on their way from or to HBM
  q_buf: Any  # int8 [P, 128]: a piece quantized outside the rings
  s_buf: Any  # int32 [8, 128]: its scale row
  local_sems: Any  # DMA [3]: the local copies of one move
  x_buf: Any  # a piece of the 1-D input or result, in its type
  x_tail_buf: Any  # the padded tail rows of the input
  tail_buf: Any  # exactly the result's last ``Flat.tail`` elements


# ----------------------------------------------------------------------------------------
# The kernel


def _when(condition, body) -> None:
  """``body()`` under ``condition``: a Python bool decides at trace time."""
  if isinstance(condition, bool):
    if condition:
      body()
  else:
    pl.when(condition)(lambda: (body(), None)[1])


def _rows_at(ref, row, rows):
  """Rows ``[row, row + rows)`` of ``ref``."""
  return ref.at[pl.ds(row, rows)]


def _dequantized(q_view, s_view, rows: int) -> list[jax.Array]:
  """The float32 values of a piece of ``rows`` rows, one per compute sub-block, from its
  int8 rows ``q_view`` and its scale row ``s_view``."""
  words = s_view[pl.ds(0, 1), :]
  return [
    q_view[pl.ds(first, n), :].astype(jnp.float32) * _unpack(words, n, half)
    for half, first, n in _sub_blocks(rows)
  ]


def _quantize_into(values: list[jax.Array], rows: int, q_view, s_view) -> None:
  """Quantizes a piece's float32 sub-blocks ``values`` into its int8 rows ``q_view`` and
  its scale row ``s_view`` (the second sub-block's scales in the high halves)."""
  words = None
  for (half, first, n), v in zip(_sub_blocks(rows), values):
    q, w = _quantize(v)
    q_view[pl.ds(first, n), :] = q
    w = lax.shift_left(w, 16 * half) if half else w
    words = w if words is None else words | w
  s_view[pl.ds(0, 1), :] = words


class _Hop:
  """One event of a ring: hop ``h`` of piece ``k`` (of kind ``ki``) of the ``j``-th chunk
  of ``run``'s slabs (``j`` and ``k`` may be traced), with its piece's place in the stream
  slice and the staging slot it is sent from (None after the last hop)."""

  def __init__(self, lay: QLayout, run: PhaseRun, j, ki: int, k, h: int):
    self.run, self.j, self.ki, self.k, self.h = run, j, ki, k, h
    self.kind = lay.kinds[ki]
    offset = self.kind.first + k * self.kind.rows
    self.offset = offset if isinstance(offset, int) else pl.multiple_of(offset, 32)
    self.piece = self.kind.index + k  # its index in the stream slice
    self.sending = h < run.hops
    self.slot = self.seq(h) % _SLOTS if self.sending else None

  def seq(self, hop: int):
    """The ring's piece number of this piece position at ``hop``; both ends of the ring
    count its pieces in this order."""
    return (self.j * self.kind.count + self.k) * self.run.hops + hop


class _Device:
  """This device's side of one kernel call: its refs, its place on the torus and the
  moves of the schedule (module docstring), by section: local moves through VMEM, an
  all-reduce's 1-D input and result (``Flat``), the wire (one ``_Hop`` at a time), and the
  rings of a group of phases. Python values (layout, schedule, piece kinds) decide at
  trace time what is traced; chunk and piece indices inside loops are traced."""

  def __init__(
    self,
    inputs: _Inputs,
    outputs: _Outputs,
    scratch: _Scratch,
    topo: Topology,
    schedule: schedule_lib.Schedule,
    lay: QLayout,
    flat: Flat | None,
  ):
    self.inputs, self.outputs, self.scratch = inputs, outputs, scratch
    self.topo, self.lay, self.flat, self.torus = topo, lay, flat, schedule.torus
    self.own_chunk = sum(  # row-major over the torus coordinates
      c * math.prod(self.torus[a + 1 :]) for a, c in enumerate(topo.coords)
    )

  # --- local moves through VMEM (synchronous) -------------------------------------------
  def copy(self, pairs) -> None:
    """Copies each (source, destination) pair, all at once, and waits for them all (at
    most 3 pairs: one local semaphore each)."""
    local = self.scratch.local_sems
    copy_and_wait(pltpu.make_async_copy(s, d, local.at[i]) for i, (s, d) in enumerate(pairs))

  def load_f32(self, ref, row, rows: int) -> list[jax.Array]:
    """The float32 rows ``[row, row + rows)`` of ``ref``, by sub-block, through ``f_buf``."""
    f_buf = self.scratch.f_buf
    self.copy([(_rows_at(ref, row, rows), f_buf.at[pl.ds(0, rows)])])
    return [f_buf[pl.ds(first, n), :] for _, first, n in _sub_blocks(rows)]

  def store_f32(self, values, rows: int, dst_ref, row) -> None:
    """Writes a piece's float32 sub-blocks ``values`` to rows ``[row, row + rows)`` of
    ``dst_ref``, through ``f_buf``."""
    f_buf = self.scratch.f_buf
    for (_, first, n), v in zip(_sub_blocks(rows), values):
      f_buf[pl.ds(first, n), :] = v
    self.copy([(f_buf.at[pl.ds(0, rows)], _rows_at(dst_ref, row, rows))])

  def to_gather(self, q_view, s_view, kind: PieceKind, gi, offset, piece) -> None:
    """Local DMAs of a piece's int8 rows and scale row into the gather buffers (slice
    ``gi`` = chunk * S + stream)."""
    lay, out = self.lay, self.outputs
    self.copy(
      [
        (
          q_view.at[pl.ds(0, kind.q_rows)],
          _rows_at(out.q_gather, lay.q_row(gi, offset), kind.q_rows),
        ),
        (s_view.at[pl.ds(0, 1)], _rows_at(out.s_gather, lay.s_row(gi, piece), 1)),
      ]
    )

  # --- an all-reduce's 1-D input and result (``Flat``) ----------------------------------
  def flat_cases(self, g, s: int, ki: int):
    """(whole, partial) conditions of the piece at grid row ``g``: all its rows lie below
    ``whole_rows``; it is the partial piece (None if no piece of this stream and kind is)."""
    flat = self.flat
    rows, part = self.lay.kinds[ki].rows, flat.partial(self.lay)
    whole = g + rows <= flat.whole_rows
    holds = part is not None and part[1:] == (s, ki)
    return whole, (g == part[0]) if holds else None

  def elements(self, row, rows: int):
    """The 1-D slice of grid rows ``[row, row + rows)``, starting on a DMA word."""
    start = row * LANES
    start = start if isinstance(start, int) else pl.multiple_of(start, self.flat.word)
    return pl.ds(start, rows * LANES)

  def read_flat(self, row, n: int) -> jax.Array:
    """Grid rows ``[row, row + n)`` of the 1-D input (all of them whole rows), as float32."""
    x_buf = self.scratch.x_buf
    self.copy([(self.inputs.x.at[self.elements(row, n)], x_buf.at[pl.ds(0, n * LANES)])])
    return x_buf[pl.ds(0, n * LANES)].astype(jnp.float32).reshape(n, LANES)

  def zero_piece(self, rows: int) -> None:
    """Zeros in ``f_buf`` for a piece of ``rows`` rows (whole int8 tiles of them)."""
    self.scratch.f_buf[pl.ds(0, _up(rows, 32)), :] = jnp.zeros((_up(rows, 32), LANES), jnp.float32)

  def read_partial_piece(self, rows: int) -> None:
    """The partial piece into ``f_buf``: its whole rows, the tail rows, zeros after."""
    flat, f_buf = self.flat, self.scratch.f_buf
    self.zero_piece(rows)
    start, tail_rows = flat.partial(self.lay)[0], flat.tail_rows
    present = flat.whole_rows - start
    if present:
      f_buf[pl.ds(0, present), :] = self.read_flat(start, present)
    if tail_rows:
      self.copy([(self.inputs.x_tail, self.scratch.x_tail_buf)])
      tail = self.scratch.x_tail_buf[...].astype(jnp.float32).reshape(tail_rows, LANES)
      f_buf[pl.ds(present, tail_rows), :] = tail

  def load_flat(self, chunk, s: int, offset, ki: int) -> list[jax.Array]:
    """The float32 values of a piece of the 1-D input, zeros where rows do not exist."""
    rows, f_buf = self.lay.kinds[ki].rows, self.scratch.f_buf
    g = self.lay.data_row(chunk, s, offset)
    whole, partial = self.flat_cases(g, s, ki)

    def whole_piece():
      f_buf[pl.ds(0, rows), :] = self.read_flat(g, rows)

    def zeros():
      self.zero_piece(rows)

    _when(whole, whole_piece)
    if partial is None:
      _when(jnp.logical_not(whole) if not isinstance(whole, bool) else not whole, zeros)
    else:
      _when(partial, lambda: self.read_partial_piece(rows))
      missing = jnp.logical_and(jnp.logical_not(whole), jnp.logical_not(partial))
      _when(missing if not isinstance(g, int) else (not whole and not partial), zeros)
    return [f_buf[pl.ds(first, n), :] for _, first, n in _sub_blocks(rows)]

  def write_flat(self, row, n: int, at: int) -> None:
    """``f_buf`` rows ``[at, at + n)`` to grid rows ``[row, row + n)`` of the 1-D result
    (all of them whole rows), in its type."""
    f_buf, x_buf, dtype = self.scratch.f_buf, self.scratch.x_buf, jnp.dtype(self.flat.dtype)
    x_buf[pl.ds(0, n * LANES)] = f_buf[pl.ds(at, n), :].reshape(n * LANES).astype(dtype)
    self.copy([(x_buf.at[pl.ds(0, n * LANES)], self.outputs.result.at[self.elements(row, n)])])

  def write_partial_piece(self) -> None:
    """The partial piece from ``f_buf`` to the result: its whole rows, then the tail."""
    flat, f_buf, t_buf = self.flat, self.scratch.f_buf, self.scratch.tail_buf
    start = flat.partial(self.lay)[0]
    present = flat.whole_rows - start
    if present:
      self.write_flat(start, present, 0)
    if flat.tail:
      rows_out = f_buf[pl.ds(present, flat.tail_rows), :]
      t_buf[...] = rows_out.reshape(flat.tail_rows * LANES)[: flat.tail].astype(
        jnp.dtype(flat.dtype)
      )
      self.copy([(t_buf, self.outputs.result.at[pl.ds(flat.n - flat.tail, flat.tail)])])

  def store_flat(self, values, chunk, s: int, offset, ki: int) -> None:
    """Writes a piece's values to the 1-D result, where its rows exist."""
    rows, f_buf = self.lay.kinds[ki].rows, self.scratch.f_buf
    g = self.lay.data_row(chunk, s, offset)
    whole, partial = self.flat_cases(g, s, ki)
    for (_, first, n), v in zip(_sub_blocks(rows), values):
      f_buf[pl.ds(first, n), :] = v
    _when(whole, lambda: self.write_flat(g, rows, 0))
    if partial is not None:
      _when(partial, self.write_partial_piece)

  def own_terms(self, run: PhaseRun, chunk, s: int, offset, ki: int) -> list[jax.Array]:
    """The own float32 terms of a piece: from the input in a stream's first phase, from
    the work buffer ``out`` later."""
    if run.first and self.flat is not None:
      return self.load_flat(chunk, s, offset, ki)
    row = self.lay.data_row(chunk, s, offset)
    source = self.inputs.x if run.first else self.outputs.out
    return self.load_f32(source, row, self.lay.kinds[ki].rows)

  def store_result(self, values, chunk, s: int, offset, ki: int) -> None:
    """Writes a piece's values to the result: the 1-D buffer or the float32 grid."""
    if self.flat is not None:
      self.store_flat(values, chunk, s, offset, ki)
    else:
      rows, row = self.lay.kinds[ki].rows, self.lay.data_row(chunk, s, offset)
      self.store_f32(values, rows, self.outputs.out, row)

  # --- the wire -------------------------------------------------------------------------
  def wire(self, run: PhaseRun, ki: int, slot):
    """The two remote DMAs of a ring slot: int8 rows and scale row, from this device's
    staging slot to the same slot of the downstream device's receive ring."""
    ring, sems = self.scratch.rings[ki], self.scratch
    qn, s = self.lay.kinds[ki].q_rows, run.stream
    target = self.topo.neighbour(run.phase.axis, run.phase.direction)
    return [
      pltpu.make_async_remote_copy(
        src.at[s, slot, pl.ds(0, n)],
        dst.at[s, slot, pl.ds(0, n)],
        sems.send_sems.at[s, ki, slot],
        sems.recv_sems.at[s, ki, slot],
        device_id=target,
      )
      for src, dst, n in ((ring.stage_q, ring.recv_q, qn), (ring.stage_s, ring.recv_s, 1))
    ]

  def grant(self, run: PhaseRun, ki: int, count: int) -> None:
    """Lets the upstream device send ``count`` more pieces on ``run``'s ring of kind ``ki``."""
    upstream = self.topo.neighbour(run.phase.axis, -run.phase.direction)
    credits = self.scratch.credits.at[run.stream, run.index, ki]
    pl.semaphore_signal(credits, count, device_id=upstream)

  def free_stage(self, hop: _Hop) -> None:
    """Waits until the staging slot's previous piece (if any) has left."""

    def wait():
      for c in self.wire(hop.run, hop.ki, hop.slot):
        c.wait_send()

    _when(hop.seq(hop.h) >= _SLOTS, wait)

  def send_own(self, hop: _Hop) -> None:
    """Hop 0: stages the own piece: the own terms quantized (reduce-scatter), or the kept
    bytes from the gather buffers (all-gather)."""
    run, kind, s, offset = hop.run, hop.kind, hop.run.stream, hop.offset
    ring, lay, out = self.scratch.rings[hop.ki], self.lay, self.outputs
    tr = run.transfers[0]
    chunk = self.topo.slab_chunks(tr, self.topo.slab(tr.phase, 0, sending=True)).chunk(hop.j)
    self.free_stage(hop)
    if run.phase.kind == "reduce_scatter":
      values = self.own_terms(run, chunk, s, offset, hop.ki)
      _quantize_into(values, kind.rows, ring.stage_q.at[s, hop.slot], ring.stage_s.at[s, hop.slot])
    else:
      gi = chunk * lay.streams + s
      self.copy(
        [
          (
            _rows_at(out.q_gather, lay.q_row(gi, offset), kind.q_rows),
            ring.stage_q.at[s, hop.slot, pl.ds(0, kind.q_rows)],
          ),
          (
            _rows_at(out.s_gather, lay.s_row(gi, hop.piece), 1),
            ring.stage_s.at[s, hop.slot, pl.ds(0, 1)],
          ),
        ]
      )

  def take_in(self, hop: _Hop) -> None:
    """Hops 1 to ``hops``: takes in the piece that hop ``h - 1`` brought (sums it on, or
    forwards it, staging what hop ``h`` sends), then grants its receive slot again."""
    run, kind, s = hop.run, hop.kind, hop.run.stream
    ring = self.scratch.rings[hop.ki]
    tr = run.transfers[hop.h - 1]
    chunk = self.topo.slab_chunks(tr, self.topo.slab(tr.phase, tr.step, sending=False)).chunk(hop.j)
    got = hop.seq(hop.h - 1) % _SLOTS
    for c in self.wire(run, hop.ki, got):
      c.wait_recv()
    received = _dequantized(ring.recv_q.at[s, got], ring.recv_s.at[s, got], kind.rows)
    if run.phase.kind == "reduce_scatter":
      self.sum_received(hop, chunk, received)
    else:
      self.forward_received(hop, chunk, got, received)
    # The receive slot is free: the upstream may send the piece that comes _SLOTS later.
    total = run.slab_size(self.torus) * kind.count * run.hops
    _when(hop.seq(hop.h - 1) + _SLOTS < total, lambda: self.grant(run, hop.ki, 1))

  def sum_received(self, hop: _Hop, chunk, received) -> None:
    """A reduce-scatter's received piece plus the own terms: staged to go on at once, or,
    after the last hop, kept where the schedule needs it next."""
    run, kind, s, offset = hop.run, hop.kind, hop.run.stream, hop.offset
    ring, lay = self.scratch.rings[hop.ki], self.lay
    own = self.own_terms(run, chunk, s, offset, hop.ki)
    values = [r + o for r, o in zip(received, own)]
    if hop.sending:  # the sum goes on at once
      self.free_stage(hop)
      _quantize_into(values, kind.rows, ring.stage_q.at[s, hop.slot], ring.stage_s.at[s, hop.slot])
    elif run.next_kind == "all_gather":  # the reduced own chunk, quantized once
      q_buf, s_buf = self.scratch.q_buf, self.scratch.s_buf
      _quantize_into(values, kind.rows, q_buf, s_buf)
      self.store_result(_dequantized(q_buf, s_buf, kind.rows), chunk, s, offset, hop.ki)
      self.to_gather(q_buf, s_buf, kind, chunk * lay.streams + s, offset, hop.piece)
    elif run.next_kind is None and self.outputs.own is not None:  # a reduce-scatter's result
      self.store_f32(values, kind.rows, self.outputs.own, lay.data_row(0, s, offset))
    else:  # a phase's end: the next phase reads it
      self.store_f32(values, kind.rows, self.outputs.out, lay.data_row(chunk, s, offset))

  def forward_received(self, hop: _Hop, chunk, got, received) -> None:
    """An all-gather's received piece: stored dequantized, its bytes staged unchanged for
    the next hop, and kept in the gather buffers if a later phase sends it again."""
    run, kind, s, offset = hop.run, hop.kind, hop.run.stream, hop.offset
    ring = self.scratch.rings[hop.ki]
    self.store_result(received, chunk, s, offset, hop.ki)
    if hop.sending:  # forward the bytes unchanged
      self.free_stage(hop)
      for _, first, n in _sub_blocks(kind.rows):
        ring.stage_q[s, hop.slot, pl.ds(first, n), :] = ring.recv_q[s, got, pl.ds(first, n), :]
      ring.stage_s[s, hop.slot, pl.ds(0, 1), :] = ring.recv_s[s, got, pl.ds(0, 1), :]
    if run.next_kind == "all_gather":  # a later phase sends it again
      gi = chunk * self.lay.streams + s
      self.to_gather(ring.recv_q.at[s, got], ring.recv_s.at[s, got], kind, gi, offset, hop.piece)

  def piece_event(self, run: PhaseRun, j, ki: int, k, h: int) -> None:
    """Hop ``h`` of piece ``k`` (of kind ``ki``) of the ``j``-th chunk of ``run``'s slabs:
    take in what hop ``h - 1`` received (none at hop 0), then send hop ``h``'s piece
    (none after the last hop) once the downstream device has granted a slot for it."""
    hop = _Hop(self.lay, run, j, ki, k, h)
    if h == 0:  # a phase's first hop sends own data
      self.send_own(hop)
    else:
      self.take_in(hop)
    if hop.sending:
      pl.semaphore_wait(self.scratch.credits.at[run.stream, run.index, ki], 1)
      for c in self.wire(run, ki, hop.slot):
        c.start()

  # --- the rings of a group of phases ---------------------------------------------------
  def ring_sizes(self, run: PhaseRun) -> list[tuple[int, int]]:
    """(kind index, pieces the run sends on that ring) per piece kind."""
    return [
      (ki, run.slab_size(self.torus) * kind.count * run.hops)
      for ki, kind in enumerate(self.lay.kinds)
    ]

  def open_rings(self, group: list[PhaseRun]) -> None:
    """Lets each upstream device send the first ``_SLOTS`` pieces of each ring."""
    for run in group:
      for ki, total in self.ring_sizes(run):
        self.grant(run, ki, min(_SLOTS, total))

  def close_rings(self, group: list[PhaseRun]) -> None:
    """Waits until every staging slot's last piece has left."""
    for run in group:
      for ki, total in self.ring_sizes(run):
        for slot in range(min(_SLOTS, total)):
          for c in self.wire(run, ki, slot):
            c.wait_send()

  def run_group(self, group: list[PhaseRun]) -> None:
    """Runs a group of phases (``phase_groups``) piece by piece: for each chunk of the
    slabs, piece kind and piece, every hop of every run in the group."""
    self.open_rings(group)

    def chunk_body(j):
      for ki, kind in enumerate(self.lay.kinds):

        def piece_body(k, ki=ki):
          for h in range(group[0].hops + 1):
            for run in group:
              self.piece_event(run, j, ki, k, h)

        for_each(kind.count, piece_body)

    for_each(group[0].slab_size(self.torus), chunk_body)
    self.close_rings(group)

  def gather_own_input(self) -> None:
    """An all-gather alone: quantize the own chunk once, keep its bytes and its values."""
    lay, own_chunk = self.lay, self.own_chunk
    q_buf, s_buf = self.scratch.q_buf, self.scratch.s_buf
    for s in range(lay.streams):
      gi = own_chunk * lay.streams + s
      for kind in lay.kinds:

        def each(k, kind=kind, s=s, gi=gi):
          offset = kind.first + k * kind.rows
          if not isinstance(offset, int):
            offset = pl.multiple_of(offset, 32)
          values = self.load_f32(self.inputs.x, lay.data_row(0, s, offset), kind.rows)
          _quantize_into(values, kind.rows, q_buf, s_buf)
          dequantized = _dequantized(q_buf, s_buf, kind.rows)
          self.store_f32(
            dequantized, kind.rows, self.outputs.out, lay.data_row(own_chunk, s, offset)
          )
          self.to_gather(q_buf, s_buf, kind, gi, offset, kind.index + k)

        for_each(kind.count, each)


def _kernel(
  coords_ref,
  inputs: _Inputs,
  outputs: _Outputs,
  scratch: _Scratch,
  *,
  schedule: schedule_lib.Schedule,
  axes: tuple[str, ...],
  mesh_axes: tuple[str, ...],
  lay: QLayout,
  collective: str,
  flat: Flat | None,
) -> None:
  """The quantized ``collective`` over torus ``axes`` on this device (module docstring):
  the entry barrier, an all-gather's own chunk quantized, then each group of ring phases
  in order. ``coords_ref`` holds ``mesh_coordinates(mesh_axes)``; ``flat`` describes an
  all-reduce's 1-D input and result (None for the others, on the float32 grid)."""
  topo = Topology(axes, schedule.torus, mesh_axes, coords_ref)
  device = _Device(inputs, outputs, scratch, topo, schedule, lay, flat)
  with jax.named_scope("barrier"):
    topo.barrier(schedule)
  if collective == "all_gather":
    with jax.named_scope("quantize_own"):
      device.gather_own_input()
  for g, group in enumerate(phase_groups(schedule)):
    with jax.named_scope(f"phase{g}_{group[0].phase.kind}"):
      device.run_group(group)


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


def _operands(
  collective: str, x: jax.Array, schedule, lay: QLayout, flat: Flat | None
) -> tuple[_Inputs, _Outputs, _Scratch]:
  """The kernel's inputs (arrays), and its outputs' and scratch's types, for ``_call``."""
  streams = schedule.num_streams
  phases = max(len(p) for p in schedule.streams)
  kinds = len(lay.kinds)
  reduce_scatter = collective == "reduce_scatter"
  tail = flat is not None and flat.tail > 0
  inputs = _Inputs(
    x=x,
    x_tail=jnp.pad(x[flat.n - flat.tail :], (0, flat.tail_rows * LANES - flat.tail))
    if tail
    else None,
  )
  gathered = lay.chunks * lay.streams  # slices in the gather buffers
  outputs = _Outputs(
    result=_hbm(x, (flat.n,), x.dtype) if flat is not None else None,
    out=_hbm(x, (lay.grid_rows, LANES), jnp.float32)
    if flat is None or needs_work_buffer(schedule)
    else None,
    own=_hbm(x, (lay.streams * lay.rows, LANES), jnp.float32) if reduce_scatter else None,
    q_gather=None if reduce_scatter else _hbm(x, (gathered * lay.q_rows, LANES), jnp.int8),
    s_gather=None if reduce_scatter else _hbm(x, (gathered * len(lay.pieces), LANES), jnp.int32),
  )
  rings = []
  for kind in lay.kinds:
    q = pltpu.VMEM((streams, _SLOTS, kind.buf_rows, LANES), jnp.int8)
    s = pltpu.VMEM((streams, _SLOTS, 8, LANES), jnp.int32)
    rings.append(_Ring(recv_q=q, recv_s=s, stage_q=q, stage_s=s))
  scratch = _Scratch(
    rings=tuple(rings),
    recv_sems=pltpu.SemaphoreType.DMA((streams, kinds, _SLOTS)),
    send_sems=pltpu.SemaphoreType.DMA((streams, kinds, _SLOTS)),
    credits=pltpu.SemaphoreType.REGULAR((streams, phases, kinds)),
    f_buf=pltpu.VMEM((lay.buf_rows, LANES), jnp.float32),
    q_buf=pltpu.VMEM((lay.buf_rows, LANES), jnp.int8),
    s_buf=pltpu.VMEM((8, LANES), jnp.int32),
    local_sems=pltpu.SemaphoreType.DMA((3,)),
    x_buf=pltpu.VMEM((lay.buf_rows * LANES,), x.dtype) if flat is not None else None,
    x_tail_buf=pltpu.VMEM((flat.tail_rows * LANES,), x.dtype) if tail else None,
    tail_buf=pltpu.VMEM((flat.tail,), x.dtype) if tail else None,
  )
  return inputs, outputs, scratch


def _call(collective, x, schedule, axes, mesh_axes, lay: QLayout, flat: Flat | None):
  """Runs the quantized ``collective`` kernel: on the 1-D all-reduce input ``x`` (with
  ``flat``), returning its 1-D result, or on the 2-D float32 grid ``x`` (rows of 128),
  returning the own chunk's float32 sums (reduce-scatter) or the dequantized grid."""
  inputs, outputs, scratch = _operands(collective, x, schedule, lay, flat)
  streams, kinds = schedule.num_streams, len(lay.kinds)
  phases = max(len(p) for p in schedule.streams)
  semaphores = streams * kinds * (2 * _SLOTS + phases) + 3
  if semaphores > MAX_SEMAPHORES:
    raise ValueError(f"{semaphores} semaphores: more than the {MAX_SEMAPHORES} a kernel may hold")
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(
    _kernel,
    schedule=schedule,
    axes=tuple(axes),
    mesh_axes=tuple(mesh_axes),
    lay=lay,
    collective=collective,
    flat=flat,
  )
  results = pl.pallas_call(
    kernel,
    out_shape=outputs,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=(jax.tree.map(lambda _: any_spec, inputs),),
      out_specs=jax.tree.map(lambda _: any_spec, outputs),
      scratch_shapes=(scratch,),
    ),
    cost_estimate=cost(schedule, lay, collective, flat),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id(f"quantized_{collective}", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_quantized_{collective}_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), inputs)
  if collective == "reduce_scatter":
    return results.own
  return results.result if flat is not None else results.out


def _plan(collective, axes, torus, mesh_axes):
  """(kept axes, kept torus, mesh axes, schedule) with unit axes dropped; the mesh axes
  are the traced ``shard_map``'s unless given (``remote_dma.mesh_target``)."""
  if not 1 <= len(axes) == len(torus) <= 3:
    raise ValueError(f"expected 1 to 3 torus axes, got {axes=}, {torus=}")
  kept_torus, kept_axes = drop_unit_axes(tuple(int(n) for n in torus), tuple(axes))
  if mesh_axes is None:
    mesh_axes, _ = mesh_target()
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
