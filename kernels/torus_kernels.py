"""Pallas TPU kernels that execute a torus ``Schedule`` with remote DMAs on 1-D buffers.

Layout (``Layout``): each device holds a flat buffer of ``n`` elements, over which the
schedule's grid of chunks is laid virtually. Chunk ``c`` (row-major over the torus
coordinates) starts at element ``c * stride``, its stream slice ``s`` at ``+ s * L`` and
piece ``k`` of that slice at ``+ k * P``: ``L`` is ``R`` rows of 128 lanes, ``R`` a whole
number of native tiles, ``P`` is ``block_rows`` x 128 (the last piece of a slice may be
shorter), and ``stride`` is ``S * L`` for an all-reduce or the caller's chunk ``m`` for a
reduce-scatter or all-gather. Positions at or beyond ``n`` (or beyond ``stride`` within a
chunk) do not exist: a (chunk, stream, piece) wholly beyond them is never sent, waited
for or added -- sender and receiver address the same chunk, so both ends know -- and the
one piece that straddles ``n`` moves short. Its length is static, since its place in the
grid is; only which device handles it at which step is dynamic, so each DMA sits in a
``pl.when`` on the traced chunk index, the same branch on both ends. No padding exists in
memory or on the wire, and no XLA pad, reshape or slice surrounds the kernels: Mosaic
cannot reshape a 1-D ref, and XLA cannot view a 1-D array of unfactorable length as a
grid without a copy, so the kernels address the 1-D buffer directly.

DMA words: a DMA moves 1-D slices that start on a 512-byte boundary and are a whole
number of 512-byte words long (128 elements of a 32-bit type, 256 of a 16-bit one).
``stride``, ``L`` and ``P`` are whole words, so every DMA is, except for the buffer's last
``n mod word`` elements, its tail. A slice shorter than a word may be moved only where it
ends at the end of its array, and into VMEM only as a whole VMEM array of its exact
length; so the tail travels by a DMA of its own into a receive slot of its length, and is
added through two VMEM arrays of its length. A reduce-scatter or all-gather whose chunk
``m`` is no whole number of words cannot place its chunks on word boundaries: the caller
pads each chunk to whole words (``pallas_backend``).

Each transfer of the schedule moves one slab (the chunks of the grid that are still live,
at one index along the phase's axis, in one stream) to the ring neighbour, one DMA per
chunk (the chunks of a slab are not contiguous in the buffer):

* reduce-scatter: the slab goes HBM -> neighbour's HBM receive slot by remote DMA (one
  slot array per stream, holding its largest slab, chunk ``j`` of a slab at ``j * L``);
  the receiver then adds it to its own partial sums, streaming both through VMEM a piece
  at a time, and stores the sum in the work buffer (the kernel's first output). The
  first phase of each stream reads its own terms from the input, later phases from the
  work buffer, so the input is only read (XLA need not copy an input it may not clobber)
  and the own chunk ends up fully reduced in the work buffer -- or, for a reduce-scatter
  returning only its chunk, in an output of ``stride`` elements that the last step
  stores into.
* all-gather: the slab goes straight from the sender's output buffer into the same place in
  the receiver's output buffer; every place is written exactly once, so no staging is needed.
  Given a reduce-scatter's work buffer (the own chunk reduced in place), the all-gather
  aliases it as its output, so the all-reduce is the two kernels with no copy between.

The streams of a step run concurrently: all their DMAs are started before any is waited on,
so on the 2-D split schedule the +x, -x, +y and -y links of a chip carry traffic together
(and all six links on the 3-D one), in every step where the axes have equal sizes (see
``torus_collectives.schedule``).

Synchronisation:

* an entry barrier (the kernel's barrier semaphore, one ``collective_id`` per kernel
  pattern; ``remote_dma.Topology.barrier``): a device writes into a neighbour only after
  that neighbour has entered the kernel;
* one DMA semaphore per (stream, receive slot, piece) on each side, so a DMA that lands
  early (in whatever order the hardware completes them) is never mistaken for another.
  A piece's semaphore counts all its DMAs (one per chunk of the slab, and the tail's);
  DMA semaphores count bytes, so the receiver waits for every one of them, with the same
  static lengths the sender used, before adding any of them.
  Step t + 2 reuses step t's: its sends start only after the capacity handshake below,
  by which time the receiver has waited step t's semaphores back to zero, and the sender
  waits for its step-t sends before step t + 1 starts;
* reduce-scatter receive slots are double-buffered per stream; a sender waits on a capacity
  semaphore before reusing a slot, signalled by the receiver once it has added the slot's
  previous contents. Capacity semaphores are indexed by (stream, phase, slot), because the
  downstream device changes between phases and signals from two different devices must not
  be confused. The handshake runs whether or not a slab has elements.

Under ``shard_map(check_vma=True)`` the outputs carry the input's varying axes, so callers
pass inputs already varying over the torus axes.

Assumptions: the reduce-scatter sums 32-bit integers and floats in their own type and
16-bit floats in float32 in VMEM, rounding each hop's sum back to the buffer's type, so
partial sums travel at the input's width; the all-gather moves any 16- or 32-bit type;
``R`` is a whole number of native tiles (8 rows for 32-bit types, 16 for 16-bit ones);
the kernels run inside a ``shard_map`` that binds every axis of its mesh (device ids are
mesh coordinates over all of them).

Pipelining: a reduce-scatter slab is sent as pieces of ``block_rows`` rows of every chunk
(the last piece may be shorter), each with its own semaphore pair, all started at once;
the receiver adds piece k (interleaving the streams) as soon as it has landed, while
pieces k + 1, ... are still on the link. Within a ring phase the slab sent at step
t + 1 is the one summed at step t, so piece k of it is sent as soon as its sum is stored
(after the capacity wait), while later pieces are still being added: the link then idles
for one piece's add per phase, not per step (``cost_model.predict(reduce_pieces=...)``
prices this). A step that starts a phase sends once the step before is done.

Code: each kernel takes its refs by name (the mesh coordinates first, then the input,
the outputs, the scratch; the reduce-scatter's scratch grouped in
``_ReduceScatterScratch``) and its statics as keywords. ``_reduce_scatter_kernel`` reads
as the protocol above, step by step; the sections it runs (send, add a piece, free a
slot, wait for the sends) and the addressing of the grid and the slots are the methods of
``_ReduceScatter``. What these kernels share with the split calls (``split_leaf_kernels``) and
the block-scaled kernels (``quantized_kernels``) -- the topology, the entry barrier, the
collective ids, the semaphore budget -- lives in ``remote_dma``.

Nothing here has run on a TPU: the kernels are verified in TPU interpret mode and compile
for v4, v5e, v5p and v6e.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels.buffer_layout import (
  Layout,
  Slab,
  at,
  each_length,
  for_each,
  pieces,
)
from torus_collectives.kernels.remote_dma import (
  MAX_SEMAPHORES,
  Topology,
  collective_id,
  copy_and_wait,
  hbm_like,
  mesh_coordinates,
)

__all__ = [
  "ADD_BYTES",
  "add_in_vmem",
  "add_rounded",
  "all_gather_call",
  "reduce_scatter_call",
]

_RECV_SLOTS = 2


def add_rounded(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a + b`` in ``a``'s type; 16-bit floats add in float32 and round once."""
  if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
    return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)
  return a + b


# Bytes per vector add: one native tile (8 x 128 32-bit or 16 x 128 16-bit elements). A
# loop over tiles keeps the kernel's code one tile's add long per piece and step (compiled
# code 1.6-1.8 MB for ResNet-50 on v5e:4x4, where whole-piece adds gave 2-10 MB); at one
# vector load, add and store per operand tile and iteration the loop should stay within
# HBM bandwidth (not measured: nothing here has run on a TPU).
ADD_BYTES = 4096


def add_in_vmem(own, received, length: int) -> None:
  """``own[:length] += received[:length]`` for 1-D VMEM refs, ``ADD_BYTES`` at a time."""
  block = ADD_BYTES // own.dtype.itemsize
  whole, rest = divmod(length, block)

  def add(start, size):
    at = pl.ds(start, size)
    own[at] = add_rounded(own[at], received[at])

  for_each(
    whole,
    lambda i: add(i * block if isinstance(i, int) else pl.multiple_of(i * block, block), block),
  )
  if rest:
    add(whole * block, rest)


def _accumulate(slab: Slab, each, own_at, src_at, dst_at, own_bufs, in_bufs, sems, block: int):
  """``dst = own + src`` over the chunks of ``slab``, each chunk's segment through VMEM.

  ``each(j, fn)`` calls ``fn(length, chunk, j)`` for the ``j``-th chunk when its segment
  has elements (``each_length``); ``own_at``, ``src_at`` and ``dst_at`` map
  ``(length, chunk, j)`` to HBM views. Double-buffered: chunk ``j + 1`` loads while chunk
  ``j`` is added and stored. ``sems[0|1|2, slot]`` track the own load, the received load
  and the store of a slot; ``own_bufs`` and ``in_bufs`` hold two blocks of ``block``.
  """
  copies = _SlotCopies(own_at, src_at, dst_at, own_bufs, in_bufs, sems, block)
  each(0, copies.start_loads(0))

  def body(j):
    slot = j % 2
    each(j, lambda *seg: [copy.wait() for copy in copies.loads(slot, *seg)])

    @pl.when(j + 1 < slab.size)
    def _prefetch():
      @pl.when(j >= 1)
      def _free_other_slot():
        each(j - 1, lambda *seg: copies.store(1 - slot, *seg).wait())

      each(j + 1, copies.start_loads(1 - slot))

    each(j, copies.add_and_store(slot))

  for_each(slab.size, body)
  total = slab.size
  if total >= 2:
    each(total - 2, lambda *seg: copies.store(total % 2, *seg).wait())
  each(total - 1, lambda *seg: copies.store((total - 1) % 2, *seg).wait())


@dataclasses.dataclass(frozen=True)
class _SlotCopies:
  """``_accumulate``'s copies of one chunk's segment ``(length, chunk, j)`` through VMEM
  slot ``slot``: the two loads (own terms, received terms) and the store of their sum."""

  own_at: Callable
  src_at: Callable
  dst_at: Callable
  own_bufs: Any
  in_bufs: Any
  sems: Any
  block: int

  def vmem(self, bufs, slot, length):
    return at(bufs, slot * self.block, length, self.block)

  def loads(self, slot, length, chunk, j):
    return (
      pltpu.make_async_copy(
        self.own_at(length, chunk, j), self.vmem(self.own_bufs, slot, length), self.sems.at[0, slot]
      ),
      pltpu.make_async_copy(
        self.src_at(length, chunk, j), self.vmem(self.in_bufs, slot, length), self.sems.at[1, slot]
      ),
    )

  def store(self, slot, length, chunk, j):
    return pltpu.make_async_copy(
      self.vmem(self.own_bufs, slot, length), self.dst_at(length, chunk, j), self.sems.at[2, slot]
    )

  def start_loads(self, slot):
    return lambda *seg: [copy.start() for copy in self.loads(slot, *seg)]

  def add_and_store(self, slot):
    def run(length, chunk, j):
      own, received = self.vmem(self.own_bufs, slot, length), self.vmem(self.in_bufs, slot, length)
      add_in_vmem(own, received, length)
      self.store(slot, length, chunk, j).start()

    return run


def _slot_chunks(schedule: schedule_lib.Schedule, stream: int) -> int:
  """Chunks of a stream's largest (first) slab: what one receive slot holds."""
  first = schedule.stream_transfers(stream)[0]
  return math.prod(schedule.torus[a] for a in first.live_axes if a != first.phase.axis)


def _tail_stream_piece(layout: Layout, slab_pieces) -> tuple[int, int] | None:
  """(stream, piece) whose segment holds the buffer's tail, or None without a tail."""
  if not layout.tail:
    return None
  at = layout.last_extent - 1  # the tail's last element, within the last chunk
  stream = at // layout.slice_elements
  offset = at - stream * layout.slice_elements
  return stream, next(k for k, (o, size) in enumerate(slab_pieces) if o <= offset < o + size)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=[
    "send_sems",
    "recv_sems",
    "capacity",
    "own_vmem",
    "in_vmem",
    "local_sems",
    "tail_own",
    "tail_in",
  ],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class _ReduceScatterScratch:
  """The reduce-scatter kernel's scratch (module doc, Synchronisation), in this order:
  ``send_sems`` and ``recv_sems``, the remote DMAs' semaphores per (stream, receive slot,
  piece); ``capacity``, the slots' handshake per (stream, phase, slot); ``own_vmem`` and
  ``in_vmem``, two blocks each of the own and the received terms being added, and
  ``local_sems`` per (own load | received load | store, block); with a tail, ``tail_own``
  and ``tail_in``, VMEM arrays of its length (``None`` without one)."""

  send_sems: object
  recv_sems: object
  capacity: object
  own_vmem: object
  in_vmem: object
  local_sems: object
  tail_own: object = None
  tail_in: object = None


class _ReduceScatter:
  """One device's reduce-scatter inside the kernel: the addressing of its refs and the
  sections of its protocol, which ``_reduce_scatter_kernel`` runs in order.

  ``refs`` are the kernel's ``(x_ref, acc_ref, own_ref, recv_slots, tail_slots)``: the
  input, the work buffer, the own chunk's output (``None`` unless asked for), the
  receive slots of each stream (HBM, double-buffered, chunk ``j`` of a slab at
  ``j * L``) and the tail's two receive slots (``None`` without a tail).
  """

  def __init__(
    self,
    schedule: schedule_lib.Schedule,
    topo: Topology,
    layout: Layout,
    slab_pieces,
    refs: tuple,
    scratch: _ReduceScatterScratch,
  ):
    self.schedule, self.topo, self.layout, self.slab_pieces = schedule, topo, layout, slab_pieces
    self.x_ref, self.acc_ref, self.own_ref, self.recv_slots, self.tail_slots = refs
    self.scratch = scratch
    self.steps = schedule.steps()
    self.phase_of = schedule.phase_of_steps()
    self.tail_at = _tail_stream_piece(layout, slab_pieces)
    self.block = min(layout.piece_elements, layout.slice_elements)
    self.slot_sizes = [
      _slot_chunks(schedule, k) * layout.slice_elements for k in range(schedule.num_streams)
    ]

  def slab(self, tr: schedule_lib.Transfer, *, sending: bool) -> Slab:
    """The slab this device sends (or receives) in ``tr``."""
    return self.topo.slab_chunks(tr, self.topo.slab(tr.phase, tr.step, sending=sending))

  def sent_terms(self, t: int):
    """What step ``t`` sends from: the input's terms at step 0; every later slab sent was
    summed into the work buffer a step before."""
    return self.x_ref if t == 0 else self.acc_ref

  def own_terms(self, tr: schedule_lib.Transfer, t: int):
    """The own terms step ``t`` adds to what ``tr`` brings. In a stream's first phase no
    slab is received twice, so they are still the input's; later phases add to sums this
    kernel stored. The input is only ever read, so XLA need not copy an input it may not
    clobber."""
    phase_of = self.phase_of[tr.stream]
    return self.x_ref if phase_of[t] == phase_of[0] else self.acc_ref

  def forwards(self, t: int, tr: schedule_lib.Transfer) -> bool:
    """Whether step ``t + 1`` sends ``tr``'s stream's slab piece by piece, as step ``t``
    sums it: within a ring phase the slab sent at step t + 1 is the one reduced at step t."""
    return t + 1 < len(self.steps) and self.steps[t + 1][tr.stream].step > 0

  def in_grid(self, ref, tr: schedule_lib.Transfer, piece_offset: int):
    """``(length, chunk, j)`` -> that segment of a chunk of ``ref``'s grid."""
    layout = self.layout
    offset = tr.stream * layout.slice_elements + piece_offset
    return lambda length, chunk, j: at(ref, chunk * layout.stride + offset, length, layout.align)

  def in_slot(self, tr: schedule_lib.Transfer, slot: int, piece_offset: int):
    """``(length, chunk, j)`` -> that segment of the ``j``-th chunk in a receive slot."""
    base = slot * self.slot_sizes[tr.stream] + piece_offset
    slots, L, align = self.recv_slots[tr.stream], self.layout.slice_elements, self.layout.align
    return lambda length, chunk, j: at(slots, base + j * L, length, align)

  def sum_destination(self, tr: schedule_lib.Transfer, t: int, piece_offset: int):
    """Where step ``t`` stores its sums: the work buffer, or at the last step, with
    ``own_ref``, the own chunk's output."""
    if self.own_ref is None or t != len(self.steps) - 1:
      return self.in_grid(self.acc_ref, tr, piece_offset)
    offset = tr.stream * self.layout.slice_elements + piece_offset
    return lambda length, chunk, j: at(self.own_ref, offset, length, self.layout.align)

  def remote_copy(self, tr: schedule_lib.Transfer, slot: int, k: int, src, dst):
    """A DMA of piece ``k`` of ``tr``'s slab into ``slot`` downstream: the piece's
    semaphore pair counts all of its DMAs."""
    return pltpu.make_async_remote_copy(
      src,
      dst,
      self.scratch.send_sems.at[tr.stream, slot, k],
      self.scratch.recv_sems.at[tr.stream, slot, k],
      device_id=self.topo.neighbour(tr.phase.axis, tr.phase.direction),
    )

  def piece_copies(self, tr, slot: int, k: int, src_ref, slab: Slab, action) -> None:
    """``action`` on every DMA of piece ``k`` of ``slab``: one per chunk, plus the tail's."""
    layout = self.layout
    piece_offset, size = self.slab_pieces[k]
    src, dst = self.in_grid(src_ref, tr, piece_offset), self.in_slot(tr, slot, piece_offset)
    start = tr.stream * layout.slice_elements + piece_offset

    def each_chunk(j):
      each_length(
        layout,
        slab,
        j,
        start,
        size,
        lambda *seg: action(self.remote_copy(tr, slot, k, src(*seg), dst(*seg))),
        words=True,
      )

    for_each(slab.size, each_chunk)
    if self.tail_at == (tr.stream, k):

      @pl.when(slab.holds(layout.last_chunk))
      def _tail():
        # The buffer's last ``tail`` elements: a slice that ends where its array ends,
        # into a slot of exactly that length (a DMA moves no other slice shorter than a
        # word).
        tail = src_ref.at[pl.ds(layout.n - layout.tail, layout.tail)]
        action(self.remote_copy(tr, slot, k, tail, self.tail_slots[slot]))

  def send(self, t: int, tr: schedule_lib.Transfer, slab: Slab, pieces_to_send) -> None:
    """Starts the DMAs of ``pieces_to_send`` of step ``t``'s ``slab``, after the capacity
    wait where the downstream slot still holds step ``t - 2`` until freed."""
    slot = t % _RECV_SLOTS
    if pieces_to_send[0] == 0 and t >= _RECV_SLOTS:
      pl.semaphore_wait(self.scratch.capacity.at[tr.stream, self.phase_of[tr.stream][t], slot], 1)
    for k in pieces_to_send:
      self.piece_copies(tr, slot, k, self.sent_terms(t), slab, lambda c: c.start())

  def reduce_piece(self, t: int, tr: schedule_lib.Transfer, k: int, slab: Slab) -> None:
    """Waits for piece ``k`` of the received ``slab``, adds the own terms to it and stores
    the sums; sends the piece on at once where step ``t + 1`` forwards it."""
    layout, scratch = self.layout, self.scratch
    slot = t % _RECV_SLOTS
    piece_offset, size = self.slab_pieces[k]
    # A piece's semaphore counts the DMAs of all its chunks: wait for all of them before
    # adding any.
    self.piece_copies(tr, slot, k, self.acc_ref, slab, lambda c: c.wait_recv())
    own = self.own_terms(tr, t)
    start = tr.stream * layout.slice_elements + piece_offset
    _accumulate(
      slab,
      lambda j, fn: each_length(layout, slab, j, start, size, fn, words=True),
      self.in_grid(own, tr, piece_offset),
      self.in_slot(tr, slot, piece_offset),
      self.sum_destination(tr, t, piece_offset),
      scratch.own_vmem,
      scratch.in_vmem,
      scratch.local_sems,
      self.block,
    )
    if self.tail_at == (tr.stream, k):
      pl.when(slab.holds(layout.last_chunk))(
        functools.partial(
          _add_tail,
          layout,
          own,
          self.tail_slots[slot],
          self.acc_ref,
          scratch.tail_own,
          scratch.tail_in,
          scratch.local_sems,
        )
      )
    if self.forwards(t, tr):  # piece k of the next step's slab is summed: send it
      later = self.steps[t + 1][tr.stream]
      self.send(t + 1, later, self.slab(later, sending=True), [k])

  def free_slot(self, t: int, tr: schedule_lib.Transfer) -> None:
    """Signals the capacity of step ``t``'s slot to whoever fills it next (step
    ``t + 2``'s upstream neighbour), once its sums are stored."""
    if t + _RECV_SLOTS < len(self.steps):
      later = self.steps[t + _RECV_SLOTS][tr.stream].phase
      pl.semaphore_signal(
        self.scratch.capacity.at[
          tr.stream, self.phase_of[tr.stream][t + _RECV_SLOTS], t % _RECV_SLOTS
        ],
        1,
        device_id=self.topo.neighbour(later.axis, -later.direction),
      )

  def wait_sent(self, t: int, tr: schedule_lib.Transfer, slab: Slab) -> None:
    """Waits for this device's sends of step ``t``'s ``slab``, every piece."""
    for k in range(len(self.slab_pieces)):
      self.piece_copies(tr, t % _RECV_SLOTS, k, self.sent_terms(t), slab, lambda c: c.wait_send())


def _reduce_scatter_kernel(
  coords_ref,
  x_ref,
  acc_ref,
  own_ref,
  recv_slots,
  tail_slots,
  scratch: _ReduceScatterScratch,
  *,
  schedule: schedule_lib.Schedule,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
  layout: Layout,
  slab_pieces,
):
  """The reduce-scatter (module doc): the entry barrier, then per step the sends, the
  adds piece by piece as each lands (forwarding what the next step sends), the slots'
  capacity signals and the waits for the sends."""
  rs = _ReduceScatter(
    schedule,
    Topology(axes, schedule.torus, mesh_axes, coords_ref),
    layout,
    slab_pieces,
    (x_ref, acc_ref, own_ref, recv_slots, tail_slots),
    scratch,
  )
  with jax.named_scope("barrier"):
    rs.topo.barrier(schedule)
  for t, transfers in enumerate(rs.steps):
    sent = []
    with jax.named_scope(f"send_step{t}"):
      for tr in transfers:
        slab = rs.slab(tr, sending=True)
        sent.append(slab)
        if not (t > 0 and rs.forwards(t - 1, tr)):  # else already sent, piece by piece
          # One DMA per chunk and piece, a semaphore pair per piece: the receiver adds
          # piece k while the link still carries pieces k + 1, ...
          rs.send(t, tr, slab, range(len(slab_pieces)))
    with jax.named_scope(f"reduce_step{t}"):
      received = [rs.slab(tr, sending=False) for tr in transfers]
      for k in range(len(slab_pieces)):
        for tr, slab in zip(transfers, received):
          rs.reduce_piece(t, tr, k, slab)
      for tr in transfers:
        rs.free_slot(t, tr)
      for tr, slab in zip(transfers, sent):
        rs.wait_sent(t, tr, slab)


def _add_tail(layout: Layout, own_ref, slot_ref, acc_ref, own_vmem, in_vmem, sems) -> None:
  """``acc[n - tail:] = own[n - tail:] + slot`` through VMEM arrays of exactly the tail's
  length (the only VMEM destination a DMA shorter than a word may have)."""
  tail = pl.ds(layout.n - layout.tail, layout.tail)
  copy_and_wait(
    [
      pltpu.make_async_copy(own_ref.at[tail], own_vmem, sems.at[0, 0]),
      pltpu.make_async_copy(slot_ref, in_vmem, sems.at[1, 0]),
    ]
  )
  own_vmem[...] = add_rounded(own_vmem[...], in_vmem[...])
  copy_and_wait([pltpu.make_async_copy(own_vmem, acc_ref.at[tail], sems.at[2, 0])])


def _all_gather_kernel(
  coords_ref,
  x_ref,
  out_ref,
  send_sems,
  recv_sems,
  local_sem,
  *,
  schedule: schedule_lib.Schedule,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
  layout: Layout,
):
  """The all-gather (module doc): the own chunk into its place unless ``x_ref`` is the
  output, the entry barrier, then per step every stream's slab straight into the same
  place downstream; ``send_sems`` and ``recv_sems`` per (stream, step)."""
  topo = Topology(axes, schedule.torus, mesh_axes, coords_ref)
  L, align = layout.slice_elements, layout.align
  grid = schedule.torus
  if x_ref.shape != out_ref.shape:  # the own chunk alone: place it first
    own = sum(c * math.prod(grid[a + 1 :]) for a, c in enumerate(topo.coords))
    place = at(out_ref, own * layout.stride, layout.stride, align)
    copy_and_wait([pltpu.make_async_copy(x_ref, place, local_sem)])
  else:  # the whole grid, aliased with the output: the own chunk is already in place
    del x_ref, local_sem

  def copies(tr, t, slab, action):
    # Sender and receiver address the same chunks at the same places; a slice that
    # holds the buffer's end is sent whole (a DMA between HBM arrays may end short of a
    # word where its arrays end).
    def each_chunk(j):
      def run(length, chunk, j):
        view = at(out_ref, chunk * layout.stride + tr.stream * L, length, align)
        action(
          pltpu.make_async_remote_copy(
            view,
            view,
            send_sems.at[tr.stream, t],
            recv_sems.at[tr.stream, t],
            device_id=topo.neighbour(tr.phase.axis, tr.phase.direction),
          )
        )

      each_length(layout, slab, j, tr.stream * L, L, run, words=False)

    for_each(slab.size, each_chunk)

  with jax.named_scope("barrier"):
    topo.barrier(schedule)
  for t, transfers in enumerate(schedule.steps()):
    with jax.named_scope(f"gather_step{t}"):
      sent = [topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=True)) for tr in transfers]
      for tr, slab in zip(transfers, sent):
        copies(tr, t, slab, lambda c: c.start())
      for tr in transfers:
        slab = topo.slab_chunks(tr, topo.slab(tr.phase, tr.step, sending=False))
        copies(tr, t, slab, lambda c: c.wait_recv())
      for tr, slab in zip(transfers, sent):
        copies(tr, t, slab, lambda c: c.wait_send())


def _elements_sent(schedule: schedule_lib.Schedule, layout: Layout) -> float:
  """Elements one device sends over the schedule, averaged over the devices.

  Which devices move the last, partial chunk and the empty ones past the buffer's end
  changes with the step, so devices differ, by more than a chunk where chunks are empty:
  counted in interpret mode, an all-reduce of 33,001 float32 elements on 2x4 (a grid of
  8 chunks of 8,192 elements, of which the buffer fills 4 and 233 elements of a fifth)
  sends 99-132 KB per device in its reduce-scatter and 50-180 KB in its all-gather, 116 KB
  on average in each. Summed over all devices a transfer moves each existing element of
  its stream's slices ``slab size`` times (every device sends one slab, and the slabs of
  all devices cover the grid that often)."""
  total = 0
  for step in schedule.steps():
    for tr in step:
      slab_size = math.prod(schedule.torus[a] for a in tr.live_axes if a != tr.phase.axis)
      total += slab_size * layout.valid_elements(
        tr.stream * layout.slice_elements, layout.slice_elements, schedule.num_devices
      )
  return total / schedule.num_devices


def _schedule_cost(
  schedule: schedule_lib.Schedule,
  layout: Layout,
  *,
  reduce: bool,
  own_copy: int = 0,
) -> pl.CostEstimate:
  """The kernel's cost for XLA's scheduler, priced from the schedule and the layout.

  Counted per existing element a device sends (``_elements_sent``; positions beyond the
  buffer's end are never moved, so padding never counts): one HBM read by the sending
  DMA and one HBM write where it lands (remote, but in some chip's HBM). A reduction
  adds, per received element, two HBM reads into VMEM (own partial sum and received one),
  one HBM write of the sum, and one add: 5 HBM accesses per element sent in all, 2
  without reduction (the tail's DMAs move exactly its elements, too). ``own_copy``
  elements copied locally (the all-gather placing its own chunk) cost a read and a write
  each. Over a ring reduce-scatter plus all-gather of S bytes on p devices this is the
  ideal 7 (p-1)/p S. The estimate is the mean over the devices, rounded up; counting
  every DMA in TPU interpret mode finds it exact (``tests/test_kernel_accounting.py``).
  A device's own bytes differ from the mean (``_elements_sent``).
  """
  sent = _elements_sent(schedule, layout)
  itemsize = layout.itemsize
  return pl.CostEstimate(
    flops=math.ceil(sent) if reduce else 0,
    transcendentals=0,
    bytes_accessed=math.ceil(((5 if reduce else 2) * sent + 2 * own_copy) * itemsize),
    remote_bytes_transferred=math.ceil(sent * itemsize),
  )


def reduce_scatter_call(
  x: jax.Array,
  schedule: schedule_lib.Schedule,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
  layout: Layout,
  *,
  own_out: bool = False,
) -> jax.Array:
  """Runs a reduce-scatter ``schedule`` on the 1-D ``x`` of ``layout.n`` elements.

  Returns the work buffer (``x``'s shape): the own chunk holds the full sum, the rest
  partial sums; or, with ``own_out``, the own chunk's ``layout.stride`` elements alone
  (the last step stores them there instead of into the work buffer).
  """
  streams = schedule.num_streams
  phases = max(len(p) for p in schedule.streams)
  slab_pieces = pieces(layout.slice_elements, layout.piece_elements)
  semaphores = 2 * streams * _RECV_SLOTS * len(slab_pieces) + streams * phases * _RECV_SLOTS
  if semaphores > MAX_SEMAPHORES:
    raise ValueError(
      f"{len(slab_pieces)} pieces of {layout.piece_elements // 128} rows (block_rows) per "
      f"slice of {layout.slice_elements // 128} rows need {semaphores} semaphores, more "
      f"than the {MAX_SEMAPHORES} a kernel may hold; pass a larger "
      "KernelConfig(block_rows=...)"
    )
  tail_at = _tail_stream_piece(layout, slab_pieces)
  if own_out and tail_at:
    raise ValueError(f"own_out needs whole DMA words per chunk: {layout}")
  kernel = functools.partial(
    _reduce_scatter_kernel,
    schedule=schedule,
    axes=tuple(axes),
    mesh_axes=tuple(mesh_axes),
    layout=layout,
    slab_pieces=slab_pieces,
  )
  block = min(layout.piece_elements, layout.slice_elements)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  # Receive slots live in HBM; an output is how a kernel gets an HBM buffer. One per
  # stream, holding its largest slab twice (double-buffered); two more of the tail's
  # length when the buffer ends inside a DMA word. The outputs, as the kernel names them:
  # the work buffer, the own chunk (or None), the slots, the tail's slots (or None).
  out_shape = (
    hbm_like(x, (layout.n,)),
    hbm_like(x, (layout.stride,)) if own_out else None,
    tuple(
      hbm_like(x, (_RECV_SLOTS * _slot_chunks(schedule, k) * layout.slice_elements,))
      for k in range(streams)
    ),
    (hbm_like(x, (layout.tail,)),) * _RECV_SLOTS if tail_at else None,
  )
  scratch = _ReduceScatterScratch(
    send_sems=pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, len(slab_pieces))),
    recv_sems=pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, len(slab_pieces))),
    capacity=pltpu.SemaphoreType.REGULAR((streams, phases, _RECV_SLOTS)),
    own_vmem=pltpu.VMEM((2 * block,), x.dtype),
    in_vmem=pltpu.VMEM((2 * block,), x.dtype),
    local_sems=pltpu.SemaphoreType.DMA((3, 2)),
    tail_own=pltpu.VMEM((layout.tail,), x.dtype) if tail_at else None,
    tail_in=pltpu.VMEM((layout.tail,), x.dtype) if tail_at else None,
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    in_specs=[any_spec],
    out_specs=jax.tree.map(lambda _: any_spec, out_shape),
    scratch_shapes=[scratch],
  )
  acc, own, _, _ = pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid_spec=grid_spec,
    cost_estimate=_schedule_cost(schedule, layout, reduce=True),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id("reduce_scatter", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_reduce_scatter_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), x)
  return own if own_out else acc


def all_gather_call(
  x: jax.Array,
  schedule: schedule_lib.Schedule,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
  layout: Layout,
) -> jax.Array:
  """Runs an all-gather ``schedule``; returns the 1-D buffer of ``layout.n`` elements.

  ``x`` is either the own chunk (``layout.stride`` elements, the grid whole: ``n`` is
  ``p * stride``), which the kernel copies into its place first, or a whole buffer of
  ``n`` elements whose own chunk is the one to gather (a reduce-scatter's work buffer):
  then the buffer is the output, aliased, and the rest of it is overwritten, so the
  hand-over from a reduce-scatter copies nothing.
  """
  steps, streams = schedule.num_steps, schedule.num_streams
  in_place = x.shape == (layout.n,)
  kernel = functools.partial(
    _all_gather_kernel,
    schedule=schedule,
    axes=tuple(axes),
    mesh_axes=tuple(mesh_axes),
    layout=layout,
  )
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    in_specs=[any_spec],
    out_specs=any_spec,
    scratch_shapes=[
      pltpu.SemaphoreType.DMA((streams, steps)),
      pltpu.SemaphoreType.DMA((streams, steps)),
      pltpu.SemaphoreType.DMA(()),
    ],
  )
  return pl.pallas_call(
    kernel,
    out_shape=hbm_like(x, (layout.n,)),
    grid_spec=grid_spec,
    input_output_aliases={1: 0} if in_place else {},
    cost_estimate=_schedule_cost(
      schedule, layout, reduce=False, own_copy=0 if in_place else layout.stride
    ),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id("all_gather", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_all_gather_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), x)
