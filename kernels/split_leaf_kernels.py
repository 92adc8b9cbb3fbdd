"""The leaf kernels' all-reduce as chains of Pallas calls that return while their DMAs fly.

``leaf_kernels`` sums a bucket's leaves where they lie, in two blocking calls: the
TensorCore waits from the first DMA to the last, so the whole transfer is exposed. Here
the same hops over the same leaves (``leaf_grid``: each leaf in its own shape, cut along
its second-minor dimension, one window of each leaf per transfer) run as one Pallas call
per hop, each returning while its DMAs are on the link (jax's start/done pattern for
asynchronous Pallas calls). Whoever
drives the chain (``SplitLeafAllReduce.advance``) may place compute between the calls and
pin it there (``pin``): how ``torus_collectives.experimental.overlap`` threads the gradient
sum through the backward pass with no concatenation into buckets and no slice of the sums.

Each stream ``s`` of the schedule (``schedule.default_variant``: on a 2-D torus the four
streams of the split torus variant, one per link of a chip) is one chain of hops: its
transfers of the reduce-scatter's schedule, then its transfers of the all-gather's, ``H``
in all. Call ``k`` (``0 .. H``) of a chain, on every device:

1. (``k < H``) signals the device that sends to it at hop ``k`` that it has entered the
   call (``Topology.signal_upstream`` on hop ``k``'s link);
2. (``k > 0``) waits for hop ``k - 1``: its receive (every leaf's window of the slab it
   receives) and its own send; after a reduce-scatter hop, adds the received windows into
   the leaves' rows through VMEM (16-bit floats in float32, rounded once:
   ``leaf_kernels.add_rows``);
3. (``k < H``) waits until the device it sends to at hop ``k`` has entered call ``k``, and
   starts hop ``k``: each leaf's window of the slab it sends, into that device's receive
   slot (reduce-scatter) or into the same rows of its leaf (all-gather).

Call 0 is the chain's "start", call ``H`` its "done"; the rest are "steps". The chains of
one bucket are issued together, call ``k`` of every stream in turn, and take the leaves
from one another (each call aliases them through, touching only its stream's rows), so the
leaves are one chain of buffers in place from the first call to the last.

Synchronisation:

* the DMA semaphores are fresh per call: hop ``k``'s DMAs count on the pair call ``k``
  returns, and only call ``k + 1`` of the chain waits on them. The receive semaphore that
  hop ``k``'s DMA increments on the neighbour is the neighbour's output of its call ``k``,
  which exists only once the neighbour has entered that call: hence step 3's wait, on the
  barrier semaphore of the link's collective id (``_link_id``, one per torus axis and
  direction). Every call on one link sends to the same neighbour and every device issues
  the calls in one order, so the barrier's count pairs the ``j``-th calls on a link, of
  any chain of any bucket;
* two receive slots per leaf and chain, alternating by hop: hop ``k`` writes slot
  ``k mod 2`` of the device it sends to, which held hop ``k - 2``'s slab; that device
  added it in its call ``k - 1`` and finished that call before it entered call ``k``
  (step 3 waits for that), so no capacity handshake is needed;
* the all-gather writes each window once, into a device that has finished reading it: a
  device's part is fully summed only after every other device's last send of it has
  landed, and a DMA's receive completes after its read.

Costs: per element sent one HBM read and one remote write, and for a reduction, in the
next call, two reads into VMEM, the write of the sum and one add (``_cost``). Each call
adds the link's barrier signal latency (not modelled). Memory: two receive slots per leaf
and chain, each the largest window a hop of the chain moves.

Code: a call's hop index is a scalar operand, so the calls in the interior of one phase
run the same kernel (``_Call``): a chain has a few kernels per phase, not one per hop.

Assumptions: the leaves share a dtype (16- or 32-bit) and have whole tiles in their
second-minor dimension or are small enough to move whole (``leaf_grid.LeafGrid``); the
calls run inside a ``shard_map`` that binds every mesh axis; every device issues all
chains' calls in one order (one program under ``shard_map`` does; a runtime that runs
independent calls concurrently needs the leaves' data dependency, which the chains have,
and the caller's pins). Verified in TPU interpret mode with the split-call extension
(``testing.split_interpret``); nothing here has run on a TPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels.leaf_grid import LeafGrid, all_reduce_grids
from torus_collectives.kernels.leaf_kernels import (
  Ranges,
  add_rows,
  add_scratch,
  frame,
  leaf_window,
  slot_window,
  slots_shape,
)
from torus_collectives.kernels.remote_dma import (
  Topology,
  collective_id,
  hbm_like,
  mesh_coordinates,
  wait_downstream,
)

__all__ = ["SplitLeafAllReduce"]

_SLOTS = 2
_ANY = pl.BlockSpec(memory_space=pl.ANY)
_SEM = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
_DMA_SEM = pltpu.SemaphoreType.DMA(())


def _link_id(axis_name: str, size: int, direction: int) -> int:
  """The barrier collective id of every call that sends along ``axis_name`` in
  ``direction``: one per link, whichever chain or bucket the call belongs to."""
  ring = schedule_lib.build("reduce_scatter", (size,), "ring")
  return collective_id("async_leaf" if direction == 1 else "async_leaf_ccw", (axis_name,), ring)


@dataclasses.dataclass(frozen=True)
class _Chain:
  """One stream's hops over a bucket (module doc): the two grids, the torus axes (those
  of more than one device) and the mesh."""

  reduce: LeafGrid
  gather: LeafGrid
  stream: int
  axes: tuple[str, ...]
  mesh_axes: tuple[str, ...]

  @functools.cached_property
  def hops(self) -> tuple[tuple[LeafGrid, schedule_lib.Transfer, int], ...]:
    """``(grid, transfer, first)`` per hop: the transfer's grid, the transfer, and the hop
    index where its phase begins (its ``step`` is the hop's index less ``first``)."""
    hops = []
    for grid in (self.reduce, self.gather):
      for tr in grid.schedule.stream_transfers(self.stream):
        hops.append((grid, tr, len(hops) - tr.step))
    return tuple(hops)

  @property
  def reduce_hops(self) -> int:
    return len(self.reduce.schedule.stream_transfers(self.stream))

  def slot_units(self, leaf: int) -> int:
    """Units of one receive slot of ``leaf``: the largest window a hop of the chain moves
    (its first phase's)."""
    first = self.reduce.axis_order(self.stream)[0]
    return max(self.reduce.bounds(leaf, self.stream, first)[1], 1)

  def hop_bytes(self, k: int) -> int:
    """Bytes hop ``k`` moves per device, on average over the devices."""
    grid, tr, _ = self.hops[k]
    total = sum(grid.elements(leaf) for leaf in range(len(grid.shapes))) * grid.itemsize
    devices, streams = math.prod(grid.schedule.torus), grid.schedule.num_streams
    return math.ceil(tr.slab_elements(grid.schedule.torus, 1) * total / devices / streams)


@dataclasses.dataclass(frozen=True)
class _Call:
  """What a call's kernel is built from, besides its traced hop index: the hops it waits
  for and starts as ``(grid, template transfer, first hop of the phase)`` (None: the
  start's wait, the done's send), so the interior calls of a phase share one kernel."""

  chain: _Chain
  waits: tuple | None
  sends: tuple | None

  @staticmethod
  def of(chain: _Chain, k: int) -> _Call:
    def phase(j):
      if not 0 <= j < len(chain.hops):
        return None
      grid, tr, first = chain.hops[j]
      return grid, dataclasses.replace(tr, step=0), first

    return _Call(chain, phase(k - 1), phase(k))

  @property
  def name(self) -> str:
    """``async_leaf_<kind>[_ccw]_<start|step|done>_<axis>``: the hop it starts (the done:
    the hop it waits for), as ``testing.hlo_schedule`` reads it."""
    _, tr, _ = self.sends or self.waits
    call = "start" if self.waits is None else "done" if self.sends is None else "step"
    ccw = "" if tr.phase.direction == 1 else "_ccw"
    return f"async_leaf_{tr.phase.kind}{ccw}_{call}_{self.chain.axes[tr.phase.axis]}"


def _at(template, k):
  """``(grid, transfer)`` of hop ``k`` (traced) in the phase of ``template``."""
  grid, tr, first = template
  return grid, dataclasses.replace(tr, step=k - first)


def _hop_kernel(coords_ref, hop_ref, *refs, call: _Call, frames, present):
  """One call (module doc, steps 1 to 3). ``refs``: the inputs (the leaves, aliased; the
  receive slots while the reduce-scatter runs; the semaphores of the hop waited for),
  the outputs (the leaves; the slots while hops still fill them; the semaphores of the
  hop started), then the scratch (a VMEM pair per leaf frame and the VMEM copies'
  semaphores, where the call adds). ``present``: whether the slot inputs, the semaphore
  inputs, the slot outputs and the semaphore outputs exist."""
  chain = call.chain
  n = len(chain.reduce.shapes)
  slots_in, sems_in, slots_out, sems_out = present
  it = iter(refs)
  take = lambda m: [next(it) for _ in range(m)]
  take(n)  # the leaves' inputs, aliased to the outputs
  slots = take(n if slots_in else 0)
  waited = take(2 if sems_in else 0)
  leaves = take(n)
  slots = take(n) if slots_out else slots
  started = take(2 if sems_out else 0)
  scratch = list(it)
  k = hop_ref[0]
  topo = Topology(chain.axes, chain.reduce.schedule.torus, chain.mesh_axes, coords_ref)

  def slot_view(leaf, j, rows):
    slot = lax.rem(j, _SLOTS)
    return slot_window(chain.reduce, leaf, slots[leaf], slot, chain.slot_units(leaf), rows)

  def dmas(grid, tr, j, sems, *, sending: bool, action):
    """``action(remote, src, dst)`` for each leaf's DMA of hop ``j`` (``tr``) that this
    device sends (or receives), ``remote()`` its descriptor: the same at both ends."""
    slab = topo.slab(tr.phase, tr.step, sending=sending)
    axis, direction = tr.phase.axis, tr.phase.direction

    def run(leaf, start, rows):
      src = leaf_window(grid, leaf, leaves[leaf], start, rows)
      dst = slot_view(leaf, j, rows) if tr.phase.kind == "reduce_scatter" else src
      action(lambda: topo.remote_copy(src, dst, *sems, axis, direction), src, dst)

    Ranges(grid, topo).each(tr, slab, run)

  if call.sends is not None:
    _, tr = _at(call.sends, k)
    topo.signal_upstream(tr.phase.axis, tr.phase.direction)
  if call.waits is not None:
    grid, tr = _at(call.waits, k - 1)
    send, recv = waited
    if call.sends is not None:
      dmas(grid, tr, k - 1, waited, sending=False, action=lambda c, s, d: c().wait_recv())
      dmas(grid, tr, k - 1, waited, sending=True, action=lambda c, s, d: c().wait_send())
    else:  # a wait only counts bytes off a local semaphore: with no collective id, Mosaic
      # finds no mesh for a remote descriptor, so local ones of the same sizes
      dmas(grid, tr, k - 1, waited, sending=False, action=lambda c, s, d: _wait(d, recv))
      dmas(grid, tr, k - 1, waited, sending=True, action=lambda c, s, d: _wait(s, send))
    if tr.phase.kind == "reduce_scatter":
      *vmem, local_sems = scratch
      vmem_of = {f: (vmem[2 * i], vmem[2 * i + 1]) for i, f in enumerate(frames)}

      def add(leaf, start, rows):
        received = slot_view(leaf, k - 1, rows)
        own = leaf_window(grid, leaf, leaves[leaf], start, rows)
        add_rows(own, received, vmem_of[frame(grid, leaf)], local_sems)

      Ranges(grid, topo).each(tr, topo.slab(tr.phase, tr.step, sending=False), add)
  if call.sends is not None:
    grid, tr = _at(call.sends, k)
    wait_downstream()
    dmas(grid, tr, k, started, sending=True, action=lambda c, s, d: c().start())


def _wait(ref, sem) -> None:
  pltpu.make_async_copy(ref, ref, sem).wait()


def _cost(chain: _Chain, k: int) -> pl.CostEstimate:
  """Call ``k``'s traffic (module doc): its hop's read and remote write, and the adds of
  the reduce-scatter hop it waits for."""
  hops = len(chain.hops)
  sent = chain.hop_bytes(k) if k < hops else 0
  added = chain.hop_bytes(k - 1) if 0 < k <= chain.reduce_hops else 0
  return pl.CostEstimate(
    flops=added // chain.reduce.itemsize,
    transcendentals=0,
    bytes_accessed=2 * sent + 3 * added,
    remote_bytes_transferred=sent,
  )


def _issue(chain: _Chain, k: int, leaves, slots, sems):
  """Issues call ``k`` of ``chain``; returns ``(leaves, slots, sems)`` for the next."""
  hops, reduce_hops = len(chain.hops), chain.reduce_hops
  n = len(leaves)
  call = _Call.of(chain, k)
  slots_in = 0 < k <= reduce_hops
  slots_out = k < reduce_hops
  present = (slots_in, k > 0, slots_out, k < hops)
  # The call that waits for a reduce-scatter hop (it takes the slots) adds what it brought.
  frames, vmem = add_scratch(leaves, chain.reduce) if slots_in else ((), [])
  operands = [*leaves, *(slots if slots_in else []), *(sems if k > 0 else [])]
  in_specs = [_ANY] * (n + (n if slots_in else 0)) + ([_SEM, _SEM] if k > 0 else [])
  out_shape = [hbm_like(leaf, leaf.shape) for leaf in leaves]
  if slots_out:
    out_shape += [
      hbm_like(x, slots_shape(chain.reduce, i, _SLOTS, chain.slot_units(i)))
      for i, x in enumerate(leaves)
    ]
  out_shape += [_DMA_SEM, _DMA_SEM] if k < hops else []
  out_specs = [_ANY] * (n + (n if slots_out else 0)) + ([_SEM, _SEM] if k < hops else [])
  aliases = {2 + i: i for i in range(n)}  # after the coordinates and the hop index
  if slots_in and slots_out:
    aliases.update({2 + n + i: n + i for i in range(n)})
  barrier = None
  if call.sends is not None:
    _, tr, _ = call.sends
    axis = tr.phase.axis
    barrier = _link_id(chain.axes[axis], chain.reduce.schedule.torus[axis], tr.phase.direction)
  outputs = pl.pallas_call(
    functools.partial(_hop_kernel, call=call, frames=frames, present=present),
    out_shape=out_shape,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=[*vmem, pltpu.SemaphoreType.DMA((3,))] if slots_in else [],
    ),
    input_output_aliases=aliases,
    cost_estimate=_cost(chain, k),
    compiler_params=pltpu.CompilerParams(collective_id=barrier, has_side_effects=True),
    name=call.name,
  )(mesh_coordinates(chain.mesh_axes), jnp.array([k], jnp.int32), *operands)
  outputs = list(outputs)
  leaves, outputs = outputs[:n], outputs[n:]
  if slots_out:
    slots, outputs = outputs[:n], outputs[n:]
  return leaves, (slots if slots_out else None), (outputs if k < hops else None)


class SplitLeafAllReduce:
  """The all-reduce of ``leaves`` (arrays the leaf kernels take: ``leaf_grid.kernel_view``
  "as is", one dtype) over the torus ``axes`` of sizes ``torus``, as chains of calls
  issued one hop at a time (module doc).

  ``advance()`` issues the next call of every chain, ``pin(values)`` ties ``values`` to
  where the chains stand (what comes out is ready only after the last calls issued, and
  the next calls wait for it), ``calls_left`` counts the advances left, and
  ``finish_parts()`` issues them and returns ``restore`` of the summed leaves (the
  caller's layout back: ``pallas_backend.split_all_reduce_leaves``; ``parts_like``, arrays
  typed as they are, is ``like``). With several chains each
  one's calls run in a named scope ``stream_<s>`` (how ``testing.hlo_schedule`` tells them
  apart).

  Raises:
    ValueError: leaves the leaf kernels do not take, or an axis that is not a mesh axis.
  """

  def __init__(
    self,
    leaves: Sequence[jax.Array],
    axes: Sequence[str],
    torus,
    mesh_axes,
    *,
    restore: Callable[[list[jax.Array]], list] = list,
    like: Sequence[jax.Array] | None = None,
  ):
    live = [(name, int(n)) for name, n in zip(axes, torus) if int(n) > 1]
    self._like = list(leaves if like is None else like)
    self._restore = restore
    self._leaves = list(leaves)
    self.mesh_axes = tuple(mesh_axes)
    for name, _ in live:
      if name not in self.mesh_axes:
        raise ValueError(f"axis {name!r} is not one of mesh_axes={self.mesh_axes}")
    self._chains: list[_Chain] = []
    if live and leaves:
      sizes = tuple(n for _, n in live)
      shapes = [x.shape for x in leaves]
      reduce, gather = all_reduce_grids(shapes, leaves[0].dtype.itemsize, sizes)
      names = tuple(name for name, _ in live)
      self._chains = [
        _Chain(reduce, gather, s, names, self.mesh_axes) for s in range(reduce.schedule.num_streams)
      ]
    self._slots: list = [None] * len(self._chains)
    self._sems: list = [None] * len(self._chains)
    self._issued = 0

  @property
  def calls_left(self) -> int:
    """Advances not yet issued (each issues one call of every chain); 0 when done."""
    if not self._chains:
      return 0
    return len(self._chains[0].hops) + 1 - self._issued

  @property
  def streams(self) -> int:
    return len(self._chains)

  @property
  def hop_bytes(self) -> list[int]:
    """Bytes each hop moves per device, over all chains: hop ``k`` is started by call
    ``k`` and waited for by call ``k + 1``."""
    if not self._chains:
      return []
    hops = len(self._chains[0].hops)
    return [sum(chain.hop_bytes(k) for chain in self._chains) for k in range(hops)]

  def _scope(self, s: int):
    return jax.named_scope(f"stream_{s}") if len(self._chains) > 1 else contextlib.nullcontext()

  def advance(self) -> None:
    """Issues call ``k`` of every chain, stream after stream (module doc)."""
    if not self.calls_left:
      raise ValueError("the split all-reduce has issued all its calls")
    k = self._issued
    for s, chain in enumerate(self._chains):
      with self._scope(s):
        self._leaves, self._slots[s], self._sems[s] = _issue(
          chain, k, self._leaves, self._slots[s], self._sems[s]
        )
    self._issued += 1

  def pin(self, values):
    """``values`` through one ``lax.optimization_barrier`` with the first leaf, which the
    next call takes: compute on what comes out runs after the last call issued, and the
    next call waits for it. Only that leaf passes the barrier: the next call takes it, so
    that orders the call too."""
    first, values = lax.optimization_barrier((self._leaves[0], values))
    self._leaves[0] = first
    return values

  @property
  def parts_like(self) -> list[jax.Array]:
    """Arrays of the types ``finish_parts`` returns."""
    return list(self._like)

  def finish_parts(self) -> list[jax.Array]:
    """Issues every call left; returns the summed leaves (through ``restore``)."""
    while self.calls_left:
      self.advance()
    return self._restore(list(self._leaves))
