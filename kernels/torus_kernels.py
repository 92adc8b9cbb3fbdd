"""Pallas TPU kernels that execute a torus ``Schedule`` with remote DMAs.

Each device holds a buffer of shape ``(*torus, S, R, 128)``: the schedule's grid of chunks
(one dimension per torus axis), each chunk cut into ``S`` stream slices of ``R`` rows of 128
lanes. Every transfer of the schedule moves one slab (the chunks of the grid that are still
live, at one index along the phase's axis, in one stream) to the ring neighbour:

* reduce-scatter: the slab goes HBM -> neighbour's HBM receive slot by remote DMA (one
  slot array per stream, shaped like its first, largest slab: on a 3-D torus that slab
  spans two grid axes, and a DMA needs the same shape on both sides, so no slot is a
  flattened view); the receiver then adds it to its own partial sums, streaming both
  through VMEM in blocks of ``block_rows`` x 128, and stores the sum in the work buffer
  (the kernel's output). The first phase of each stream reads its own terms from the
  input, later phases from the work buffer, so the input is only read (XLA need not copy
  an input it may not clobber) and the own chunk ends up fully reduced in the work buffer.
* all-gather: the slab goes straight from the sender's output buffer into the same place in
  the receiver's output buffer; every place is written exactly once, so no staging is needed.
  Given a reduce-scatter's work buffer (the own chunk reduced in place), the all-gather
  aliases it as its output, so the all-reduce is the two kernels with no copy between.

The streams of a step run concurrently: all their DMAs are started before any is waited on,
so on the 2-D split schedule the +x, -x, +y and -y links of a chip carry traffic together
(and all six links on the 3-D one).

Synchronisation:

* an entry barrier (the kernel's barrier semaphore): a device writes into a neighbour only
  after that neighbour has entered the kernel;
* one DMA semaphore per (stream, receive slot, piece) on each side, so a DMA that lands
  early (in whatever order the hardware completes them) is never mistaken for another.
  Step t + 2 reuses step t's: its sends start only after the capacity handshake below,
  by which time the receiver has waited step t's semaphores back to zero, and the sender
  waits for its step-t sends before step t + 1 starts;
* reduce-scatter receive slots are double-buffered per stream; a sender waits on a capacity
  semaphore before reusing a slot, signalled by the receiver once it has added the slot's
  previous contents. Capacity semaphores are indexed by (stream, phase, slot), because the
  downstream device changes between phases and signals from two different devices must not
  be confused.

Under ``shard_map(check_vma=True)`` the outputs carry the input's varying axes, so callers
pass inputs already varying over the torus axes.

Assumptions: the reduce-scatter sums 32-bit integers and floats in their own type and
16-bit floats in float32 in VMEM, rounding each hop's sum back to the buffer's type, so
partial sums travel at the input's width; the all-gather moves any 16- or 32-bit type;
``R`` is a whole number of native tiles (8 rows for 32-bit types, 16 for 16-bit ones);
the kernels run inside a ``shard_map`` that binds every
axis of its mesh (device ids are mesh coordinates over all of them).

Pipelining: a reduce-scatter slab is sent as pieces of ``block_rows`` rows of every chunk
(the last piece may be shorter), each its own DMA with its own semaphore pair, all started
at once; the receiver adds piece k (interleaving the streams) as soon as it has landed,
while pieces k + 1, ... are still on the link. So within a step only the last piece's add
is not hidden behind the link (``cost_model.predict(reduce_pieces=...)`` prices this).
The next step's sends still start only when the step's adds are done.

Nothing here has run on a TPU: the kernels are verified in TPU interpret mode and compile
for v4, v5e, v5p and v6e.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib

_RECV_SLOTS = 2
# Semaphores live in a small scoped memory (2 KiB, 512 of them, on v5e, where 840 did not
# compile); leave room for the kernel's other scratch.
_MAX_SEMAPHORES = 400

# collective_id: barrier semaphores are per id. Two kernels that sync with different
# neighbour sets must not share one: a device still before the entry barrier of a 1-D ring
# on y would count a signal its x neighbour sent on entering the 2-D torus kernel, DMA into
# a y neighbour that has not entered, and leave the barrier count off by one. So every
# (kind, axes, torus, links) pattern gets its own id -- links: the (axis, direction) pairs
# the schedule uses, which differ between a one-stream and a split schedule on the same
# axes -- a pure function of the pattern (every
# process of a multi-host job computes the same id without coordination). Ids are drawn
# from [_FIRST_ID, 2**15) -- TPU interpret mode stores them as int16 -- by a hash; a
# process-wide table turns a hash collision between two patterns into an error at trace
# time instead of a silent shared barrier. (jax's barrier-semaphore tags would let XLA
# assign ids, but interpret mode does not support them, so they could not be tested.)
_FIRST_ID = 16
_ID_PATTERNS: dict[int, tuple] = {}


def links(schedule: schedule_lib.Schedule) -> list[tuple[int, int]]:
  """The (torus axis, direction) pairs ``schedule`` sends along (axes of size 1 excepted)."""
  return sorted(
    {
      (p.axis, p.direction)
      for phases in schedule.streams
      for p in phases
      if schedule.torus[p.axis] > 1
    }
  )


def collective_id(kind: str, axes: Sequence[str], schedule: schedule_lib.Schedule) -> int:
  """The barrier collective_id of a ``kind`` kernel running ``schedule`` over ``axes``.

  Raises:
    ValueError: if another pattern already traced in this process has the same id.
  """
  pattern = (kind, tuple(axes), schedule.torus, tuple(links(schedule)))
  key = zlib.crc32(repr(pattern).encode())
  cid = _FIRST_ID + key % ((1 << 15) - _FIRST_ID)
  other = _ID_PATTERNS.setdefault(cid, pattern)
  if other != pattern:
    raise ValueError(
      f"collective_id {cid} of {pattern} collides with {other}; the two kernels would share "
      "a barrier semaphore. Rename one of the mesh axes."
    )
  return cid


def _mod(x, n: int):
  return lax.rem(x + n, n)


def mesh_coordinates(mesh_axes: Sequence[str]) -> jax.Array:
  """This device's coordinates over all ``mesh_axes``, the kernels' first (SMEM) operand.

  The kernels read their position from this operand rather than calling ``axis_index``
  themselves, which keeps their bodies free of varying-axes types under ``check_vma``.
  """
  return jnp.stack([lax.axis_index(a) for a in mesh_axes]).astype(jnp.int32)


class _Topology:
  """Where this device sits on the torus, and how to name its neighbours as DMA targets."""

  def __init__(
    self, axes: Sequence[str], torus: Sequence[int], mesh_axes: Sequence[str], coords_ref
  ):
    self.axes, self.torus, self.mesh_axes = tuple(axes), tuple(torus), tuple(mesh_axes)
    self.mesh_coords = tuple(coords_ref[i] for i in range(len(self.mesh_axes)))
    self.coords = tuple(self.mesh_coords[self.mesh_axes.index(a)] for a in self.axes)

  def neighbour(self, axis: int, direction: int) -> tuple:
    """Mesh coordinates of the device ``direction`` steps away along torus axis ``axis``."""
    moved = list(self.mesh_coords)
    moved[self.mesh_axes.index(self.axes[axis])] = _mod(
      self.coords[axis] + direction, self.torus[axis]
    )
    return tuple(moved)

  def slab(self, phase: schedule_lib.Phase, step: int, *, sending: bool):
    """Grid index along ``phase.axis`` this device sends (or receives) at ``step``."""
    slab = phase.send_slab if sending else phase.recv_slab
    return slab(self.coords[phase.axis], step, self.torus[phase.axis])

  def slab_view(self, ref, transfer: schedule_lib.Transfer, index):
    """``ref``'s view of one transfer's slab as ``(chunks, R, 128)``."""
    idx = list(transfer.slab_index(self.coords, index))
    if all(not isinstance(i, slice) for i in idx):  # a single chunk: keep a leading dim
      idx[transfer.phase.axis] = pl.ds(index, 1)
    return ref.at[tuple(idx) + (transfer.stream,)]

  def barrier(self, schedule: schedule_lib.Schedule) -> None:
    """Tells every upstream neighbour we are here; waits until every downstream one is."""
    used = links(schedule)
    sem = pltpu.get_barrier_semaphore()
    for axis, direction in used:
      pl.semaphore_signal(sem, 1, device_id=self.neighbour(axis, -direction))
    pl.semaphore_wait(sem, len(used))


def _phase_index(schedule: schedule_lib.Schedule) -> list[list[int]]:
  """``[stream][global step]`` -> index of the phase within its stream."""
  out = []
  for phases in schedule.streams:
    out.append([i for i, p in enumerate(phases) for _ in range(schedule.torus[p.axis] - 1)])
  return out


def _add(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a + b`` in ``a``'s type; 16-bit floats add in float32 and round once."""
  if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
    return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)
  return a + b


def pieces(rows: int, block_rows: int) -> list[tuple[int, int]]:
  """``(first row, rows)`` of the pieces a slab's ``rows`` are cut into: whole blocks, then
  the remainder (slices are padded to whole tiles only, not whole blocks)."""
  return [(start, min(block_rows, rows - start)) for start in range(0, rows, block_rows)]


def _accumulate(dst, own, src, own_bufs, in_bufs, sems) -> None:
  """``dst = own + src`` for ``(*chunks, rows, 128)`` HBM views, ``rows`` at most a VMEM
  block, chunk by chunk through VMEM.

  ``chunks`` is one grid dimension or more (a slab of a 3-D torus can span two).
  ``own`` is ``dst`` itself or the same place in the kernel's input. Double-buffered:
  chunk ``i + 1`` loads while chunk ``i`` is added and stored.
  ``sems[0|1|2, slot]`` track the own load, the received load and the store of a slot.
  """
  *chunks, rows, _ = dst.shape
  total = math.prod(chunks)
  own_vmem = own_bufs.at[:, pl.ds(0, rows)]
  in_vmem = in_bufs.at[:, pl.ds(0, rows)]

  def chunk(i):
    index, rest = [], i
    for size in reversed(chunks):  # row-major over the chunk dimensions
      index.insert(0, rest % size)
      rest = rest // size
    return tuple(index)

  def loads(i, slot):
    return (
      pltpu.make_async_copy(own.at[chunk(i)], own_vmem.at[slot], sems.at[0, slot]),
      pltpu.make_async_copy(src.at[chunk(i)], in_vmem.at[slot], sems.at[1, slot]),
    )

  def store(i, slot):
    return pltpu.make_async_copy(own_vmem.at[slot], dst.at[chunk(i)], sems.at[2, slot])

  for copy in loads(0, 0):
    copy.start()

  def body(i, carry):
    slot = i % 2
    for copy in loads(i, slot):
      copy.wait()

    @pl.when(i + 1 < total)
    def _prefetch():
      @pl.when(i >= 1)
      def _free_other_slot():
        store(i - 1, 1 - slot).wait()

      for copy in loads(i + 1, 1 - slot):
        copy.start()

    own_vmem[slot] = _add(own_vmem[slot], in_vmem[slot])
    store(i, slot).start()
    return carry

  lax.fori_loop(0, total, body, 0)
  if total >= 2:
    store(total - 2, total % 2).wait()
  store(total - 1, (total - 1) % 2).wait()


def _recv_axes(schedule: schedule_lib.Schedule, stream: int) -> tuple[int, ...]:
  """Grid axes a stream's receive slot spans: those of its first (largest) slab."""
  first = schedule.stream_transfers(stream)[0]
  return tuple(a for a in first.live_axes if a != first.phase.axis)


def _recv_shape(schedule: schedule_lib.Schedule, stream: int) -> tuple[int, ...]:
  return tuple(schedule.torus[a] for a in _recv_axes(schedule, stream)) or (1,)


def _recv_view(recv_ref, slot: int, transfer: schedule_lib.Transfer, schedule):
  """A stream's receive slot ``slot`` viewed with the shape of ``transfer``'s slab.

  The slot spans the stream's first slab; every later slab of a reduce-scatter spans a
  subset of its axes (a single chunk, at the least), so it is the slot's corner along them.
  """
  carried = [a for a in transfer.live_axes if a != transfer.phase.axis]
  recv_axes = _recv_axes(schedule, transfer.stream)
  if carried:
    index = [pl.ds(0, schedule.torus[a]) if a in carried else 0 for a in recv_axes]
  else:  # a single chunk, with a leading dimension of 1 as in ``slab_view``
    index = [pl.ds(0, 1)] + [0] * (len(recv_axes) - 1)
  return recv_ref.at[(slot, *index)]


def _reduce_scatter_kernel(schedule, topo_args, slab_pieces, coords_ref, x_ref, acc_ref, *refs):
  streams = schedule.num_streams
  recv_refs = refs[:streams]  # one per stream: (slots, *its first slab's chunks, R, 128)
  send_sems, recv_sems, capacity, buf_own, buf_in, local_sems = refs[streams:]
  topo = _Topology(*topo_args, coords_ref)
  steps = schedule.steps()
  phase_of = _phase_index(schedule)

  def own_terms(tr, t):
    # In a stream's first phase no slab is received twice, so the own term of every add
    # is still the input's; later phases add to sums this kernel stored. The input is
    # only ever read, so XLA need not copy an input it may not clobber.
    return x_ref if phase_of[tr.stream][t] == phase_of[tr.stream][0] else acc_ref

  def rows(view, piece):  # rows [start, start + size) of every chunk of a slab view
    start, size = piece
    return view.at[(slice(None),) * (len(view.shape) - 2) + (pl.ds(start, size),)]

  with jax.named_scope("barrier"):
    topo.barrier(schedule)
  for t, transfers in enumerate(steps):
    slot = t % _RECV_SLOTS
    copies = []
    with jax.named_scope(f"send_step{t}"):
      for tr in transfers:
        # Step 0 sends the input's terms; every later slab sent was summed a step before.
        src = topo.slab_view(
          x_ref if t == 0 else acc_ref, tr, topo.slab(tr.phase, tr.step, sending=True)
        )
        dst = _recv_view(recv_refs[tr.stream], slot, tr, schedule)
        if t >= _RECV_SLOTS:  # the downstream slot still holds step t - 2 until freed
          pl.semaphore_wait(capacity.at[tr.stream, phase_of[tr.stream][t], slot], 1)
        # One DMA (and semaphore pair) per piece: the receiver adds piece k while the
        # link still carries pieces k + 1, ...
        piece_copies = []
        for k, piece in enumerate(slab_pieces):
          copy = pltpu.make_async_remote_copy(
            rows(src, piece),
            rows(dst, piece),
            send_sems.at[tr.stream, slot, k],
            recv_sems.at[tr.stream, slot, k],
            device_id=topo.neighbour(tr.phase.axis, tr.phase.direction),
          )
          copy.start()
          piece_copies.append(copy)
        copies.append(piece_copies)
    with jax.named_scope(f"reduce_step{t}"):
      for k, piece in enumerate(slab_pieces):
        for tr, piece_copies in zip(transfers, copies):
          piece_copies[k].wait_recv()
          place = topo.slab(tr.phase, tr.step, sending=False)
          _accumulate(
            rows(topo.slab_view(acc_ref, tr, place), piece),
            rows(topo.slab_view(own_terms(tr, t), tr, place), piece),
            piece_copies[k].dst_ref,
            buf_own,
            buf_in,
            local_sems,
          )
      for tr in transfers:
        if t + _RECV_SLOTS < len(steps):  # free the slot for whoever fills it next
          later = steps[t + _RECV_SLOTS][tr.stream].phase
          pl.semaphore_signal(
            capacity.at[tr.stream, phase_of[tr.stream][t + _RECV_SLOTS], slot],
            1,
            device_id=topo.neighbour(later.axis, -later.direction),
          )
      for piece_copies in copies:
        for copy in piece_copies:
          copy.wait_send()


def _all_gather_kernel(
  schedule, topo_args, coords_ref, x_ref, out_ref, send_sems, recv_sems, local_sem
):
  topo = _Topology(*topo_args, coords_ref)
  if x_ref.shape != out_ref.shape:  # the own chunk alone: place it first
    own = pltpu.make_async_copy(x_ref, out_ref.at[topo.coords], local_sem)
    own.start()
    own.wait()
  else:  # the whole grid, aliased with the output: the own chunk is already in place
    del x_ref, local_sem
  with jax.named_scope("barrier"):
    topo.barrier(schedule)
  for t, transfers in enumerate(schedule.steps()):
    copies = []
    with jax.named_scope(f"gather_step{t}"):
      for tr in transfers:
        # Sender and receiver differ only along the phase axis, where both address the
        # same slab, so the slab has the same view on both sides.
        view = topo.slab_view(out_ref, tr, topo.slab(tr.phase, tr.step, sending=True))
        copy = pltpu.make_async_remote_copy(
          view,
          view,
          send_sems.at[tr.stream, t],
          recv_sems.at[tr.stream, t],
          device_id=topo.neighbour(tr.phase.axis, tr.phase.direction),
        )
        copy.start()
        copies.append(copy)
      for copy in copies:
        copy.wait_recv()
      for copy in copies:
        copy.wait_send()


def _schedule_cost(
  schedule: schedule_lib.Schedule,
  slice_elements: int,
  itemsize: int,
  *,
  reduce: bool,
  own_copy: int = 0,
) -> pl.CostEstimate:
  """The kernel's cost for XLA's scheduler, priced from the schedule itself.

  Counted per element a device sends (``sent``, summed over the schedule's transfers): one
  HBM read by the sending DMA and one HBM write where it lands (remote, but in some
  chip's HBM). A reduction adds, per received element, two HBM reads into VMEM (own
  partial sum and received one), one HBM write of the sum, and one add: 5 HBM accesses
  per element sent in all, 2 without reduction. ``own_copy`` elements copied locally
  (the all-gather placing its own chunk) cost a read and a write each. Over a ring
  reduce-scatter plus all-gather of S bytes on p devices this is the ideal 7 (p-1)/p S.
  """
  sent = sum(
    t.slab_elements(schedule.torus, slice_elements) for step in schedule.steps() for t in step
  )
  return pl.CostEstimate(
    flops=sent if reduce else 0,
    transcendentals=0,
    bytes_accessed=((5 if reduce else 2) * sent + 2 * own_copy) * itemsize,
    remote_bytes_transferred=sent * itemsize,
  )


def _hbm_like(x: jax.Array, shape):
  """An output type of ``shape`` in HBM, varying over the same mesh axes as ``x``. Left
  free, XLA may place a small output in another memory space and copy it out again."""
  return pltpu.HBM.from_type(jax.typeof(x).update(shape=tuple(shape), weak_type=False))


def reduce_scatter_call(
  x: jax.Array,
  schedule: schedule_lib.Schedule,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
  block_rows: int,
) -> jax.Array:
  """Runs a reduce-scatter ``schedule`` on ``x`` of shape ``(*torus, S, R, 128)``.

  Returns the work buffer: the own chunk ``[*coords]`` holds the full sum, the rest holds
  partial sums.
  """
  streams = schedule.num_streams
  _, rows, lanes = x.shape[-3:]
  phases = max(len(p) for p in schedule.streams)
  slab_pieces = pieces(rows, block_rows)
  semaphores = 2 * streams * _RECV_SLOTS * len(slab_pieces) + streams * phases * _RECV_SLOTS
  if semaphores > _MAX_SEMAPHORES:
    raise ValueError(
      f"{len(slab_pieces)} pieces of {block_rows=} per slice of {rows} rows need "
      f"{semaphores} semaphores, more than the {_MAX_SEMAPHORES} a kernel may hold; pass "
      "a larger KernelConfig(block_rows=...)"
    )
  kernel = functools.partial(
    _reduce_scatter_kernel,
    schedule,
    (tuple(axes), schedule.torus, tuple(mesh_axes)),
    slab_pieces,
  )
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    in_specs=[any_spec],
    out_specs=(any_spec,) * (1 + streams),
    scratch_shapes=[
      pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, len(slab_pieces))),
      pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, len(slab_pieces))),
      pltpu.SemaphoreType.REGULAR((streams, phases, _RECV_SLOTS)),
      pltpu.VMEM((2, min(block_rows, rows), lanes), x.dtype),
      pltpu.VMEM((2, min(block_rows, rows), lanes), x.dtype),
      pltpu.SemaphoreType.DMA((3, 2)),
    ],
  )
  # Receive slots live in HBM; an output is how a kernel gets an HBM buffer. One per
  # stream, shaped like its largest slab (on a 3-D torus that spans two grid axes).
  recv_shapes = [(_RECV_SLOTS, *_recv_shape(schedule, k), rows, lanes) for k in range(streams)]
  acc, *_ = pl.pallas_call(
    kernel,
    out_shape=(_hbm_like(x, x.shape), *(_hbm_like(x, shape) for shape in recv_shapes)),
    grid_spec=grid_spec,
    cost_estimate=_schedule_cost(schedule, rows * lanes, x.dtype.itemsize, reduce=True),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id("reduce_scatter", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_reduce_scatter_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), x)
  return acc


def all_gather_call(
  x: jax.Array,
  schedule: schedule_lib.Schedule,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
) -> jax.Array:
  """Runs an all-gather ``schedule``; returns the full grid ``(*torus, S, R, 128)``.

  ``x`` is either the own chunk ``(S, R, 128)``, which the kernel copies into its place
  first, or a whole grid ``(*torus, S, R, 128)`` whose own chunk ``[*coords]`` is the one to
  gather (a reduce-scatter's work buffer): then the grid is the output, aliased, and the
  rest of it is overwritten, so the hand-over from a reduce-scatter copies nothing.
  """
  steps, streams = schedule.num_steps, schedule.num_streams
  chunk_shape = x.shape[-3:]
  in_place = x.shape == schedule.torus + chunk_shape
  kernel = functools.partial(
    _all_gather_kernel, schedule, (tuple(axes), schedule.torus, tuple(mesh_axes))
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
  chunk_elements = chunk_shape[-2] * chunk_shape[-1]
  return pl.pallas_call(
    kernel,
    out_shape=_hbm_like(x, schedule.torus + chunk_shape),
    grid_spec=grid_spec,
    input_output_aliases={1: 0} if in_place else {},
    cost_estimate=_schedule_cost(
      schedule,
      chunk_elements,
      x.dtype.itemsize,
      reduce=False,
      own_copy=0 if in_place else math.prod(chunk_shape),
    ),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id("all_gather", axes, schedule),
      has_side_effects=True,
    ),
    name=f"torus_all_gather_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), x)
