"""Pallas TPU kernels that run a torus ``Schedule`` on a bucket's leaves where they lie.

``reduce_scatter_call`` and ``all_gather_call`` take the leaves of a bucket as separate
HBM refs in their own shapes (``leaf_grid``: each leaf cut along its second-minor
dimension, its "rows", in tiles, hierarchically in the order a stream visits the axes)
and return them, aliased: the reduce-scatter sums each
device's own parts in place, and the all-gather, given those leaves, copies every part
into place on every device, so the all-reduce is the two calls with nothing between
them or around them. No concatenation packs the leaves into one buffer and no slice
unpacks the sums (what the flat kernels of ``torus_kernels`` cost their callers: every
byte read and written twice more, at HBM speed).

One transfer of the schedule moves, for each leaf, one window ``leaf[..., a:b, :]`` of
its rows (the part of the slab the device sends, ``leaf_grid.piece``): one DMA per leaf,
of one of two static shapes, under a ``pl.when`` on the traced size. A whole leaf's window
is all of it, and its receive slots are stacked on a leading dimension (``leaf_window``,
``slot_window``). Both ends compute the same window from the slab index and the
coordinates they share.

* reduce-scatter: each leaf's range goes to the neighbour's receive slot for that leaf
  (an HBM output per leaf, a region per stream and slot, double-buffered). The leaves are
  cut into up to ``ADD_GROUPS`` groups of about equal size (``add_groups``), each with its
  own semaphore pair: the receiver waits for a group's DMAs, adds each slot into the
  leaf's rows of the slab it received, a block of rows at a time through VMEM (16-bit
  floats add in float32 and round once), and stores the sums in place, while later
  groups are still landing. Within a phase the slab sent at the next step is the one just
  summed, so each group is sent on as soon as its sums are stored.
* all-gather: each leaf's range goes straight to the same rows of the neighbour's leaf.
  Every range is written once, by the device upstream, after its owner has read it for
  the last time.

Synchronisation is the flat kernels' (``torus_kernels``): an entry barrier per call
(``remote_dma.Topology.barrier``); one DMA semaphore pair per (stream, slot, group) for the
reduce-scatter and per (stream, step) for the all-gather, counting the bytes of every
leaf's DMA (the receiver waits, with the sender's shapes, for all of them before it reads
any); and the reduce-scatter's capacity handshake per (stream, phase, slot), so a sender
fills a slot only after the receiver has added what it held two steps before.

Costs: like the flat kernels, per element sent one HBM read and one write for the DMA,
and for a reduction two reads into VMEM, a write of the sum and an add (``_cost``); the
adds pipeline as the flat kernels' pieces do, with the groups as pieces
(``cost_model.predict(reduce_pieces=...)``).

Code: the steps of a phase differ only in the slab index, so each run of steps in which
no stream changes phase is one loop over a traced step (``_each_step``): a kernel's code
grows with the number of leaves and phases, not with the number of devices.

Assumptions: the leaves of one call share a dtype (16- or 32-bit); each has a
second-minor dimension of whole tiles, or is small enough to move whole
(``leaf_grid.LeafGrid``: a vector, a stem convolution's kernel, up to
``leaf_grid.WHOLE_BYTES``); the kernels run inside a ``shard_map`` that binds every mesh
axis. Verified in TPU interpret mode; nothing here has run on a TPU.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels.buffer_layout import for_each
from torus_collectives.kernels.leaf_grid import LeafGrid, piece
from torus_collectives.kernels.remote_dma import (
  Topology,
  collective_id,
  copy_and_wait,
  hbm_like,
  mesh_coordinates,
)
from torus_collectives.kernels.torus_kernels import add_rounded

__all__ = ["ADD_GROUPS", "add_groups", "all_gather_call", "reduce_scatter_call"]

_RECV_SLOTS = 2
# Groups of leaves a receiver adds one after another as they land (``add_groups``).
ADD_GROUPS = 8
# Bytes of one VMEM block of rows added at a time (per operand).
_ADD_BLOCK_BYTES = 64 * 1024


class Ranges:
  """The rows of each leaf that a transfer moves on this device: ``each(tr, slab, fn)``
  calls ``fn(leaf, start_row, rows)`` with ``rows`` static, inside a ``pl.when`` on the
  traced size, once per leaf (of ``leaves``, default all) whose range is not empty."""

  def __init__(self, grid: LeafGrid, topo: Topology):
    self.grid, self.topo = grid, topo

  def each(self, tr: schedule_lib.Transfer, slab, fn, leaves=None) -> None:
    grid, unit = self.grid, self.grid.unit
    axis, stream = tr.phase.axis, tr.stream
    for leaf in range(len(grid.shapes)) if leaves is None else leaves:
      offset, size = piece(grid.units(leaf), grid.path(leaf, stream, self.topo.coords, axis, slab))
      for units in sorted(set(grid.bounds(leaf, stream, axis)) - {0}):
        start = pl.multiple_of(offset * unit, unit)
        pl.when(size == units)(functools.partial(fn, leaf, start, units * unit))


def window(ref, start, rows: int):
  """``ref[..., start : start + rows, :]``: rows of the second-minor dimension under
  every leading index (``start`` a whole number of tiles)."""
  return ref.at[(slice(None),) * (len(ref.shape) - 2) + (pl.ds(start, rows), slice(None))]


def leaf_window(grid: LeafGrid, leaf: int, ref, start, rows: int):
  """The window ``Ranges.each`` gives of leaf ``leaf`` (``ref``): its rows ``start`` to
  ``start + rows``, or, for a whole leaf (``LeafGrid.is_whole``: one unit), all of it."""
  return ref if grid.is_whole(leaf) else window(ref, start, rows)


def slots_shape(grid: LeafGrid, leaf: int, slots: int, slot_units: int) -> tuple:
  """The shape of ``slots`` receive slots of ``slot_units`` units each for leaf ``leaf``:
  stacked along its rows, or, for a whole leaf, along a new leading dimension."""
  shape = grid.shapes[leaf]
  if grid.is_whole(leaf):
    return (slots, *shape)
  return (*shape[:-2], slots * slot_units * grid.unit, shape[-1])


def slot_window(grid: LeafGrid, leaf: int, ref, slot, slot_units: int, rows: int):
  """The first ``rows`` of receive slot ``slot`` (static or traced) of leaf ``leaf``'s
  slots ``ref`` (``slots_shape``)."""
  if grid.is_whole(leaf):
    return ref.at[slot]
  start = slot * slot_units * grid.unit
  if not isinstance(start, int):
    start = pl.multiple_of(start, grid.unit)
  return window(ref, start, rows)


def frame(grid: LeafGrid, leaf: int) -> tuple:
  """What leaf ``leaf``'s VMEM add blocks share: its shape without its cut dimension
  (leading dimensions, minor dimension), or, for a whole leaf, ``("whole", shape)``."""
  shape = tuple(grid.shapes[leaf])
  if grid.is_whole(leaf):
    return ("whole", shape)
  return tuple(shape[:-2]), shape[-1]


def _when(condition, body) -> None:
  """``body()`` where ``condition`` holds: a Python bool decides now, a traced one at run
  time."""
  if isinstance(condition, bool):
    if condition:
      body()
  else:
    pl.when(condition)(body)


def _each_step(schedule: schedule_lib.Schedule, body) -> None:
  """``body(t, transfers, (t0, t1))`` for every global step ``t`` of ``schedule``, with the
  step's transfers. Each run ``[t0, t1)`` of steps in which no stream changes phase is one
  loop with a traced ``t`` (its transfers' ``step`` traced too), so a kernel's code grows
  with the phases, not with the steps (15 per phase on a 16x16 torus)."""
  steps, phase_of = schedule.steps(), schedule.phase_of_steps()
  t0 = 0
  while t0 < len(steps):
    t1 = t0 + 1
    while t1 < len(steps) and all(phases[t1] == phases[t0] for phases in phase_of):
      t1 += 1
    first, run = steps[t0], (t0, t1)
    if t1 - t0 == 1:
      body(t0, first, run)
    else:

      def loop_body(t, carry, first=first, run=run):
        moved = tuple(dataclasses.replace(tr, step=tr.step + (t - run[0])) for tr in first)
        body(t, moved, run)
        return carry

      lax.fori_loop(t0, t1, loop_body, 0)
    t0 = t1


def add_rows(own, received, vmem, sems) -> None:
  """``own += received`` for HBM windows of equal shape, a block of rows at a time
  through the VMEM pair ``vmem`` (16-bit floats add in float32, rounded once). A pair of
  the windows' own shape (a whole leaf's, ``add_scratch``) adds them in one block."""
  own_vmem, in_vmem = vmem
  if tuple(own_vmem.shape) == tuple(own.shape):
    _add_block(own, received, own_vmem, in_vmem, sems)
    return
  rows, block = own.shape[-2], own_vmem.shape[-2]
  whole, rest = divmod(rows, block)

  def add(start, size):
    ov, iv = window(own_vmem, 0, size), window(in_vmem, 0, size)
    _add_block(window(own, start, size), window(received, start, size), ov, iv, sems)

  for_each(
    whole,
    lambda i: add(i * block if isinstance(i, int) else pl.multiple_of(i * block, block), block),
  )
  if rest:
    add(whole * block, rest)


def _add_block(own, received, own_vmem, in_vmem, sems) -> None:
  """``own += received`` (HBM refs) through VMEM refs of their shape."""
  copy_and_wait(
    [
      pltpu.make_async_copy(own, own_vmem, sems.at[0]),
      pltpu.make_async_copy(received, in_vmem, sems.at[1]),
    ]
  )
  own_vmem[...] = add_rounded(own_vmem[...], in_vmem[...])
  copy_and_wait([pltpu.make_async_copy(own_vmem, own, sems.at[2])])


def block_rows(leaf_frame, itemsize: int, unit: int) -> int:
  """Rows of a VMEM add block for leaves of ``leaf_frame`` (``frame``, not whole): whole
  tiles, about ``_ADD_BLOCK_BYTES`` (one tile at least)."""
  lead, width = leaf_frame
  row_bytes = math.prod(lead) * width * itemsize
  return max(unit, _ADD_BLOCK_BYTES // row_bytes // unit * unit)


def add_scratch(leaves: Sequence[jax.Array], grid: LeafGrid) -> tuple[tuple, list]:
  """The distinct frames (``frame``) of ``leaves`` and, per frame, the VMEM pair that
  ``add_rows`` adds their blocks in (the kernel's scratch, in frame order): a whole
  leaf's pair has its shape."""
  frames = tuple(dict.fromkeys(frame(grid, leaf) for leaf in range(len(leaves))))
  vmem = []
  for f in frames:
    if f[0] == "whole":
      shape = f[1]
    else:
      lead, width = f
      shape = (*lead, block_rows(f, grid.itemsize, grid.unit), width)
    vmem += [pltpu.VMEM(shape, leaves[0].dtype)] * 2
  return frames, vmem


def add_groups(grid: LeafGrid) -> list[list[int]]:
  """The leaves cut into ``min(ADD_GROUPS, leaves)`` runs, none empty, each ending at the
  leaf that reaches its share of the elements: a receiver adds group ``g`` while groups
  ``g + 1, ...`` are still landing. The count depends on the number of leaves alone, so
  a program's reader knows it (``bench.overlap_report`` prices the adds with it)."""
  n = len(grid.shapes)
  count = min(ADD_GROUPS, n)
  reached = list(itertools.accumulate(grid.elements(leaf) for leaf in range(n)))
  ends = []
  for g in range(1, count):
    end = bisect.bisect_left(reached, g * reached[-1] / count) + 1
    ends.append(min(max(end, (ends[-1] if ends else 0) + 1), n - (count - g)))
  bounds = [0, *ends, n]
  return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


class _ReduceScatter:
  """One device's reduce-scatter inside the kernel: the addressing of its leaves and
  receive slots, and the sections of the protocol (module doc) that
  ``_reduce_scatter_kernel`` runs step by step."""

  def __init__(self, grid: LeafGrid, topo: Topology, leaves, slots, sems, vmem_of):
    self.grid, self.topo, self.leaves, self.slots = grid, topo, leaves, slots
    self.send_sems, self.recv_sems, self.capacity, self.local_sems = sems
    self.vmem_of = vmem_of
    self.ranges = Ranges(grid, topo)
    self.groups = add_groups(grid)
    self.steps = grid.schedule.steps()
    self.phase_of = grid.schedule.phase_of_steps()

  def slot_view(self, leaf: int, tr, t, rows: int):
    """The first ``rows`` of leaf ``leaf``'s receive slot of ``tr``'s stream at step ``t``."""
    slot = tr.stream * _RECV_SLOTS + t % _RECV_SLOTS
    return slot_window(self.grid, leaf, self.slots[leaf], slot, self.grid.slot_units(leaf), rows)

  def dmas(self, tr, t, group: int, *, sending: bool, action) -> None:
    """``action`` on the DMA of each leaf of ``group`` that moves the slab this device
    sends (or receives) in ``tr`` at step ``t``: the same descriptors on both ends, a
    semaphore pair per (stream, slot, group)."""
    slab = self.topo.slab(tr.phase, tr.step, sending=sending)
    sems = (
      self.send_sems.at[tr.stream, t % _RECV_SLOTS, group],
      self.recv_sems.at[tr.stream, t % _RECV_SLOTS, group],
    )

    def run(leaf, start, rows):
      src = leaf_window(self.grid, leaf, self.leaves[leaf], start, rows)
      dst = self.slot_view(leaf, tr, t, rows)
      action(self.topo.remote_copy(src, dst, *sems, tr.phase.axis, tr.phase.direction))

    self.ranges.each(tr, slab, run, self.groups[group])

  def send(self, tr, t, groups) -> None:
    """Starts step ``t``'s sends of ``groups`` (after ``wait_capacity``)."""
    for group in groups:
      self.dmas(tr, t, group, sending=True, action=lambda c: c.start())

  def wait_capacity(self, tr, t, phase: int) -> None:
    """Before step ``t``'s first send (``phase``: its phase's index in the stream): waits
    until the downstream slot no longer holds step ``t - 2``."""
    capacity = self.capacity.at[tr.stream, phase, t % _RECV_SLOTS]
    _when(t >= _RECV_SLOTS, lambda: pl.semaphore_wait(capacity, 1))

  def reduce(self, tr, t, group: int) -> None:
    """Waits for the received slab's DMAs of ``group``, then adds each leaf into place."""
    self.dmas(tr, t, group, sending=False, action=lambda c: c.wait_recv())

    def add(leaf, start, rows):
      own = leaf_window(self.grid, leaf, self.leaves[leaf], start, rows)
      vmem = self.vmem_of[frame(self.grid, leaf)]
      add_rows(own, self.slot_view(leaf, tr, t, rows), vmem, self.local_sems)

    slab = self.topo.slab(tr.phase, tr.step, sending=False)
    self.ranges.each(tr, slab, add, self.groups[group])

  def step(self, t, transfers, run: tuple[int, int]) -> None:
    """Global step ``t`` (in the run ``[t0, t1)`` of one phase per stream): the sends,
    unless the step before forwarded them; each group's adds, forwarding it as the next
    step's send within the run; the slots' capacity signals; the waits for the sends."""
    t0, t1 = run
    groups = range(len(self.groups))
    phases = [self.phase_of[tr.stream][t0] for tr in transfers]

    def send_all():
      for tr, phase in zip(transfers, phases):
        self.wait_capacity(tr, t, phase)
        self.send(tr, t, groups)

    _when(t == t0, send_all)
    for group in groups:
      for tr, phase in zip(transfers, phases):
        self.reduce(tr, t, group)
        later = dataclasses.replace(tr, step=tr.step + 1)

        def forward(later=later, phase=phase, group=group):
          if group == 0:
            self.wait_capacity(later, t + 1, phase)
          self.send(later, t + 1, [group])

        _when(t + 1 < t1, forward)
    for tr in transfers:
      self.free_slot(tr, t, run)
    for tr in transfers:
      for group in groups:
        self.dmas(tr, t, group, sending=True, action=lambda c: c.wait_send())

  def free_slot(self, tr, t, run: tuple[int, int]) -> None:
    """Signals the capacity of step ``t``'s slot to whoever fills it next (step
    ``t + 2``'s upstream neighbour), once its sums are stored. Within the run of steps
    ``t`` lies in, that is the same phase's upstream; the last two steps of a run signal
    the next phase's."""
    t0, t1 = run
    phase = self.phase_of[tr.stream][t0]

    def signal(later: schedule_lib.Phase, later_phase: int):
      pl.semaphore_signal(
        self.capacity.at[tr.stream, later_phase, t % _RECV_SLOTS],
        1,
        device_id=self.topo.neighbour(later.axis, -later.direction),
      )

    _when(t + _RECV_SLOTS < t1, lambda: signal(tr.phase, phase))
    for last in range(max(t0, t1 - _RECV_SLOTS), t1):
      if last + _RECV_SLOTS < len(self.steps):
        later = self.steps[last + _RECV_SLOTS][tr.stream].phase
        later_phase = self.phase_of[tr.stream][last + _RECV_SLOTS]
        _when(t == last, functools.partial(signal, later, later_phase))


def _reduce_scatter_kernel(coords_ref, *refs, grid: LeafGrid, axes, mesh_axes, frames: tuple):
  """The reduce-scatter (module doc). ``refs``: the inputs (aliased, unused), the leaves,
  their receive slots, then the scratch: send and receive semaphores per (stream, slot,
  add group), the capacity semaphores per (stream, phase, slot), a VMEM pair per leaf
  frame, and the VMEM copies' semaphores.

  Within a run of steps of one phase, the slab sent at step ``t + 1`` is the one summed
  at step ``t``: each group of it is sent on as soon as its sums are stored, so only a
  run's first step sends at its start."""
  n = len(grid.shapes)
  send_sems, recv_sems, capacity, *vmem, local_sems = refs[3 * n :]
  vmem_of = {f: (vmem[2 * i], vmem[2 * i + 1]) for i, f in enumerate(frames)}
  topo = Topology(axes, grid.schedule.torus, mesh_axes, coords_ref)
  rs = _ReduceScatter(
    grid,
    topo,
    refs[n : 2 * n],
    refs[2 * n : 3 * n],
    (send_sems, recv_sems, capacity, local_sems),
    vmem_of,
  )
  with jax.named_scope("barrier"):
    topo.barrier(grid.schedule)
  _each_step(grid.schedule, rs.step)


def _all_gather_kernel(coords_ref, *refs, grid: LeafGrid, axes, mesh_axes):
  """The all-gather (module doc). ``refs``: the inputs (aliased, unused), the leaves,
  then the send and receive semaphores per (stream, step)."""
  n = len(grid.shapes)
  leaves = refs[n : 2 * n]
  send_sems, recv_sems = refs[2 * n :]
  schedule = grid.schedule
  topo = Topology(axes, schedule.torus, mesh_axes, coords_ref)
  ranges = Ranges(grid, topo)

  def dmas(tr, t, *, sending, action):
    sems = (send_sems.at[tr.stream, t], recv_sems.at[tr.stream, t])

    def run(leaf, start, rows):
      view = leaf_window(grid, leaf, leaves[leaf], start, rows)
      action(topo.remote_copy(view, view, *sems, tr.phase.axis, tr.phase.direction))

    ranges.each(tr, topo.slab(tr.phase, tr.step, sending=sending), run)

  with jax.named_scope("barrier"):
    topo.barrier(schedule)

  def step(t, transfers, run):
    for tr in transfers:
      dmas(tr, t, sending=True, action=lambda c: c.start())
    for tr in transfers:
      dmas(tr, t, sending=False, action=lambda c: c.wait_recv())
    for tr in transfers:
      dmas(tr, t, sending=True, action=lambda c: c.wait_send())

  _each_step(schedule, step)


def _cost(grid: LeafGrid, *, reduce: bool) -> pl.CostEstimate:
  """The call's cost for XLA's scheduler: per element a device sends, on average over the
  devices, one HBM read and one write for the DMA, and for a reduction two reads into
  VMEM, the write of the sum and one add (``torus_kernels._schedule_cost``'s count)."""
  total = sum(grid.elements(leaf) for leaf in range(len(grid.shapes)))
  sent = grid.schedule.bytes_sent_per_device(total)  # in elements: an itemsize of 1
  return pl.CostEstimate(
    flops=math.ceil(sent) if reduce else 0,
    transcendentals=0,
    bytes_accessed=math.ceil((5 if reduce else 2) * sent * grid.itemsize),
    remote_bytes_transferred=math.ceil(sent * grid.itemsize),
  )


def _call(kernel, leaves, extra_outputs, scratch, grid, axes, mesh_axes, kind, reduce):
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out_shape = [hbm_like(leaf, leaf.shape) for leaf in leaves] + list(extra_outputs)
  outputs = pl.pallas_call(
    functools.partial(kernel, grid=grid, axes=tuple(axes), mesh_axes=tuple(mesh_axes)),
    out_shape=out_shape,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[any_spec] * len(leaves),
      out_specs=[any_spec] * len(out_shape),
      scratch_shapes=scratch,
    ),
    input_output_aliases={1 + i: i for i in range(len(leaves))},
    cost_estimate=_cost(grid, reduce=reduce),
    compiler_params=pltpu.CompilerParams(
      collective_id=collective_id(kind, axes, grid.schedule), has_side_effects=True
    ),
    name=f"torus_{kind}_{'_'.join(axes)}",
  )(mesh_coordinates(mesh_axes), *leaves)
  return list(outputs[: len(leaves)])


def reduce_scatter_call(
  leaves: Sequence[jax.Array],
  grid: LeafGrid,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
) -> list[jax.Array]:
  """Runs the reduce-scatter ``grid.schedule`` over ``leaves`` in place: returns
  them with this device's parts (``leaf_grid``) fully summed, the rest partial sums."""
  schedule = grid.schedule
  streams = schedule.num_streams
  phases = max(len(p) for p in schedule.streams)
  count = streams * _RECV_SLOTS
  slots = [
    hbm_like(leaf, slots_shape(grid, i, count, max(grid.slot_units(i), 1)))
    for i, leaf in enumerate(leaves)
  ]
  frames, vmem = add_scratch(leaves, grid)
  scratch = [
    pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, min(ADD_GROUPS, len(leaves)))),
    pltpu.SemaphoreType.DMA((streams, _RECV_SLOTS, min(ADD_GROUPS, len(leaves)))),
    pltpu.SemaphoreType.REGULAR((streams, phases, _RECV_SLOTS)),
    *vmem,
    pltpu.SemaphoreType.DMA((3,)),
  ]
  kernel = functools.partial(_reduce_scatter_kernel, frames=frames)
  return _call(kernel, leaves, slots, scratch, grid, axes, mesh_axes, "leaf_reduce_scatter", True)


def all_gather_call(
  leaves: Sequence[jax.Array],
  grid: LeafGrid,
  axes: Sequence[str],
  mesh_axes: Sequence[str],
) -> list[jax.Array]:
  """Runs the all-gather ``grid.schedule`` over ``leaves`` in place: every
  device's own parts (``leaf_grid``) are copied into place on every device."""
  schedule = grid.schedule
  shape = (schedule.num_streams, max(schedule.num_steps, 1))
  scratch = [pltpu.SemaphoreType.DMA(shape), pltpu.SemaphoreType.DMA(shape)]
  return _call(
    _all_gather_kernel, leaves, [], scratch, grid, axes, mesh_axes, "leaf_all_gather", False
  )
