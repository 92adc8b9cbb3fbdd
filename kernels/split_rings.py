"""Split ring collectives over one torus axis: start, steps and done as separate Pallas calls.

The blocking kernels (``torus_kernels``) hold the TensorCore from their first DMA to their
last. Here one ring phase of ``n`` devices (a reduce-scatter or an all-gather along one
axis, ``schedule.build(kind, (n,), "ring")``: one stream, direction +1) runs as ``n``
Pallas calls that return while their DMAs are still on the link, so XLA may schedule
independent compute between them (jax's start/done pattern for asynchronous Pallas calls):

* ``ring_start(kind, x, axis_name, n, mesh_axes)``: syncs with the ring neighbours and
  starts hop 0. It returns a ``RingState``: the buffer the DMAs write (``buffer``), the
  hop's send and receive DMA semaphores, and the static description;
* ``ring_step(state)``: hop ``t`` (1 .. n - 2). It waits for hop ``t - 1``'s receive (from
  the upstream neighbour) and its own send, does the hop's local work, and starts hop
  ``t``'s send to the downstream neighbour. ``buffer`` is aliased through (the same HBM
  buffer the DMAs are writing); the semaphores are fresh ones of this call;
* ``ring_done(state)``: waits for the last hop and returns the result.

A phase may run in either direction (``direction=-1``: every device sends to the previous
coordinate instead, the mirror image of what follows; its own collective-id pattern,
``async_<kind>_ccw``). ``ring_phase`` runs a whole phase, with an optional hook between the
calls;
``split_collectives`` chains phases over the axes of a torus.

The two kinds, for the device at ring position ``p`` (``Phase.send_slab`` /
``recv_slab``; chunk ``c`` of an ``[n * m]`` buffer lies at ``c * m``):

* all-gather of the own chunk ``x`` (``m`` elements): ``buffer`` is the ``[n * m]``
  output. Start copies ``x`` into chunk ``p``. At hop ``t`` the device sends chunk
  ``(p - t) mod n`` from its ``buffer`` into the same place of the neighbour's, and
  receives chunk ``(p - 1 - t) mod n``. Done returns ``buffer``:
  ``lax.all_gather(x, axis_name, tiled=True)``;
* reduce-scatter of the whole ``x`` (``n * m`` elements): ``buffer`` holds ``n`` slots of
  ``m`` elements: slot ``t < n - 1`` for what arrives at hop ``t``, and slot ``n - 1``
  for what hop 0 sends (start copies ``x``'s chunk there: a DMA in flight reads only
  buffers aliased through every call, and XLA may copy ``x`` between the calls and free
  the original). At hop ``t`` the device sends its partial sum of chunk
  ``(p - 1 - t) mod n`` into slot ``t`` of the neighbour's ``buffer``: at hop 0 from slot
  ``n - 1``, later from its own slot ``t - 1``, to which the step has just added ``x``'s
  term of that chunk in place
  (through VMEM, 16-bit floats in float32, rounded once). Done adds ``x``'s chunk ``p``
  to the last slot into a fresh ``[m]`` output: ``lax.psum_scatter(x, axis_name,
  scatter_dimension=0, tiled=True)``. ``x`` is an operand of every call (read at every
  hop) and travels in its own type: bfloat16 on the wire for a bfloat16 gradient.

Synchronisation (both kinds):

* no capacity handshake: every place of ``buffer`` is written exactly once by an incoming
  DMA (and, for the reduce-scatter, once more in place by its own device after waiting
  for that DMA), and read only after that write has been waited for; nothing is reused,
  which is what the slots cost in memory (one ``x`` more);
* entry barrier (the barrier semaphore of ``collective_id("async_<kind>", ...)``, a
  pattern of its own, distinct from the blocking kernels'; the protocol of
  ``remote_dma``, one link at a time): a device signals its upstream neighbour and waits
  for its downstream one before hop 0, so no DMA lands in a device that has not entered
  the start call (whose ``buffer`` would not exist yet);
* the same neighbour barrier at the entry of every step call, on the same barrier
  semaphore. The receive semaphore that hop ``t``'s DMA increments on the downstream
  neighbour is that neighbour's output of *its* step-``t`` call: XLA allocates it for
  that call, so before the neighbour enters the call nothing makes that semaphore hop
  ``t``'s (its memory may hold another call's semaphore; this is the design's
  reasoning, not something observed on a TPU). Devices do not advance in lockstep: a
  device's progress depends only on its upstream chain, so without the barrier it could
  run any number of hops ahead of its downstream neighbour. The barrier semaphore
  counts: the ``k``-th wait returns once the downstream neighbour has entered its
  ``k``-th call of the sequence, so calls are never confused. A step signals on entry,
  before its waits, so the upstream neighbour may start its next hop while this device
  still waits for the previous one. This costs one signal's latency per hop (not
  measured). The done call starts no DMA and uses no barrier; every device signals and
  waits the barrier ``n - 1`` times, leaving it at zero;
* fresh semaphores per call: hop ``t``'s DMA counts on the semaphores its call returns,
  and only the next call of the sequence waits them (with descriptors of the same
  ``m``-element places, so the byte counts match), so a wait never pairs with another
  hop's DMA.

Compiled schedule: between the calls XLA sees only data dependencies (``buffer`` and the
semaphores flow from each call into the next), and it does not keep independent compute
inside the window: compiled ahead of time for v5e:2x4 (the y axis, n = 4), three
independent matmuls written between start, the steps and done were all scheduled after
done, the four calls back to back. So the compute is pinned with
``lax.optimization_barrier`` (``pin``, as the async note does): its operands go through a
barrier with ``buffer`` after a call, its results through another before the next call.
Then the scheduled program runs start, matmul, step, matmul, step, matmul, done, with
``buffer`` handed from call to call in place (each call aliases it; no copy between them);
the barriers themselves are gone from the scheduled program. The tests check this order
on the compiled program.

Assumptions: a 1-D ``x`` of a 32-bit type (float32, int32) or a 16-bit float (bfloat16,
float16) whose chunk length ``m`` is a whole number of 512-byte DMA words (128 or 256
elements: no tail); ``n >= 2`` devices along ``axis_name``; the calls run inside a
``shard_map`` that binds every axis of ``mesh_axes`` (device ids are mesh coordinates over
all of them), in this order; every device issues the calls of one pattern (all phases of
one kind on one axis share its barrier semaphore, whichever collective they belong to) in
the same order, which one program on a TPU does, and which independent sequences get from
data dependencies (``pin``) where a runtime runs independent calls concurrently (the CPU
interpreter does); the caller uses the result only after ``ring_done``. Outputs are typed like
``x`` (its varying axes, so ``shard_map(check_vma=True)`` accepts them). All calls are
marked as having side effects (the barrier signals), like the blocking kernels. The local
loads and stores of the reduce-scatter's adds are synchronous (one ``ADD_BLOCK_BYTES``
block at a time, not double-buffered).

Code: one kernel per call (``_start_kernel``; ``_gather_step_kernel`` and
``_reduce_step_kernel``; ``_gather_done_kernel`` and ``_reduce_done_kernel``), each taking
its refs by name and the phase's statics (``_RingCall``) and hop as keywords; ``_Ring``
holds the ring's addressing. The topology, neighbour barrier, collective ids and remote
copies come from ``remote_dma``, shared with the blocking and block-scaled kernels.

Nothing here has run on a TPU: the calls are verified in TPU interpret mode (with the
split-call extension for tests, ``testing.split_interpret``) and compiled ahead of time
for v5e. What interpret mode cannot show: the interpreter ends every call with a barrier
across all devices (and starts a call without a ``collective_id``, the done call, with
one), so there the devices advance call by call in lockstep, and the per-step neighbour
barrier above, which guards against a device running ahead, is never needed; it is
reasoned, not tested. Timing and the link's actual overlap with compute are not
measured either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels.buffer_layout import at, dma_alignment, for_each
from torus_collectives.kernels.remote_dma import (
  Topology,
  collective_id,
  copy_and_wait,
  hbm_like,
  mesh_coordinates,
  mod,
  wait_downstream,
)
from torus_collectives.kernels.torus_kernels import add_in_vmem

RingKind = Literal["all_gather", "reduce_scatter"]
KINDS: tuple[RingKind, ...] = ("all_gather", "reduce_scatter")
# Bytes of each operand that one local load / add / store of the reduce-scatter moves.
ADD_BLOCK_BYTES = 64 * 1024
_ANY = pl.BlockSpec(memory_space=pl.ANY)
_SEM = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
_DMA_SEM = pltpu.SemaphoreType.DMA(())


def pattern(kind: RingKind, direction: int = 1) -> str:
  """The collective-id pattern of a split ring phase (distinct from the blocking kernels'),
  one per direction: the two directions' barriers signal different neighbours, so they
  must not share a barrier semaphore."""
  return f"async_{kind}" if direction == 1 else f"async_{kind}_ccw"


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["buffer", "source", "send", "recv"],
  meta_fields=["kind", "hop", "axis_name", "n", "mesh_axes", "direction"],
)
@dataclasses.dataclass(frozen=True)
class RingState:
  """What one call of a phase hands to the next: the buffer the DMAs write, the phase's
  input where later calls read it (the reduce-scatter's ``x``; ``None`` for the
  all-gather), the send and receive semaphores of hop ``hop``, and the static description."""

  buffer: jax.Array
  source: jax.Array | None
  send: jax.Array
  recv: jax.Array
  kind: RingKind
  hop: int
  axis_name: str
  n: int
  mesh_axes: tuple[str, ...]
  direction: int = 1

  @property
  def chunk(self) -> int:
    """``m``: the elements of one chunk, the size of every DMA of the phase."""
    return self.buffer.shape[0] // self.n


def _phase(kind: RingKind, n: int, direction: int = 1) -> schedule_lib.Phase:
  """The ring schedule's phase (``build(kind, (n,), "ring")``), in ``direction``."""
  (phases,) = _schedule(kind, n).streams
  (phase,) = phases
  return dataclasses.replace(phase, direction=direction)


def _schedule(kind: RingKind, n: int) -> schedule_lib.Schedule:
  return schedule_lib.build(kind, (n,), "ring")


def chunk_elements(kind: RingKind, x: jax.Array, n: int, axis_name: str, mesh_axes) -> int:
  """``m`` for a phase on ``x``, after checking everything the calls assume (module doc)."""
  if kind not in KINDS:
    raise ValueError(f"a split ring phase is one of {KINDS}, got {kind=}")
  if n < 2:
    raise ValueError(f"a ring {kind} needs n >= 2 devices, got {n=}")
  if axis_name not in mesh_axes:
    raise ValueError(f"{axis_name=} is not one of {mesh_axes=}")
  integer_or_32_bit = x.dtype.itemsize == 4 and x.dtype.kind in "fiu"
  if x.ndim != 1 or not (integer_or_32_bit or x.dtype in (jnp.bfloat16, jnp.float16)):
    raise ValueError(
      f"expected a 1-D array of a 32-bit type or a 16-bit float, got {x.dtype}{list(x.shape)}"
    )
  total = x.shape[0]
  if kind == "reduce_scatter" and total % n:
    raise ValueError(f"a reduce-scatter over {n} devices needs a multiple of {n}: {total}")
  m = total if kind == "all_gather" else total // n
  align = dma_alignment(x.dtype.itemsize)
  if m < 1 or m % align:
    raise ValueError(
      f"each chunk's {m} elements must be a positive multiple of {align} (whole 512-byte "
      "DMA words); pad the buffer"
    )
  return m


class _Ring:
  """This device's place on the ring of one phase, inside a kernel."""

  def __init__(
    self, kind: RingKind, axis_name, n, mesh_axes, coords_ref, m, itemsize=4, direction=1
  ):
    self.topo = Topology((axis_name,), (n,), tuple(mesh_axes), coords_ref)
    self.kind, self.n, self.m, self.phase = kind, n, m, _phase(kind, n, direction)
    self.align = dma_alignment(itemsize)
    self.position = self.topo.coords[0]

  def chunk(self, ref, index):
    """Chunk ``index`` (traced or static) of an ``[n * m]`` ref, or slot ``index`` of the
    reduce-scatter's receive buffer."""
    return at(ref, index * self.m, self.m, self.align)

  def sent(self, hop: int):
    """The chunk this device sends at ``hop`` (``Phase.send_slab``, traced)."""
    shift = hop + 1 if self.kind == "reduce_scatter" else hop
    return mod(self.position - self.phase.direction * shift, self.n)

  def received(self, hop: int):
    """The chunk this device receives at ``hop`` (``Phase.recv_slab``, traced)."""
    shift = hop + 2 if self.kind == "reduce_scatter" else hop + 1
    return mod(self.position - self.phase.direction * shift, self.n)

  def source(self, x_ref, buffer_ref, hop: int):
    """What this device sends at ``hop``: a chunk of its all-gather buffer; the
    reduce-scatter's ``x`` chunk at hop 0, its partial sum in slot ``hop - 1`` after."""
    if self.kind == "all_gather":
      return self.chunk(buffer_ref, self.sent(hop))
    return self.chunk(buffer_ref, self.n - 1 if hop == 0 else hop - 1)

  def destination(self, buffer_ref, hop: int):
    """Where ``hop``'s send lands in the downstream neighbour's buffer."""
    return self.chunk(buffer_ref, self.sent(hop) if self.kind == "all_gather" else hop)

  def landing(self, buffer_ref, hop: int):
    """Where ``hop``'s receive lands in this device's buffer."""
    return self.chunk(buffer_ref, self.received(hop) if self.kind == "all_gather" else hop)

  def dma(self, src, dst, send, recv):
    """A remote DMA from ``src`` here to ``dst``'s place at the downstream neighbour."""
    return self.topo.remote_copy(src, dst, send, recv, 0, self.phase.direction)

  def send(self, x_ref, buffer_ref, hop: int, send, recv):
    """Starts ``hop``'s remote DMA."""
    self.dma(
      self.source(x_ref, buffer_ref, hop), self.destination(buffer_ref, hop), send, recv
    ).start()

  def signal_upstream(self):
    """Tells the upstream neighbour this device has entered the current call."""
    self.topo.signal_upstream(0, self.phase.direction)

  def wait_downstream(self):
    """Waits until the downstream neighbour has entered the current call."""
    wait_downstream()

  def wait_hop(self, x_ref, buffer_ref, hop: int, send, recv, *, remote: bool = True):
    """Waits for ``hop``'s receive and for this device's own send of that hop.

    A wait only counts bytes off a local semaphore, so the done call, which starts no DMA
    and signals nobody, waits with local descriptors of the same places
    (``remote=False``): Mosaic lowers a remote descriptor's device id only in a kernel
    that communicates, and finds no mesh in one that merely waits."""
    landed = self.landing(buffer_ref, hop)
    sent = self.source(x_ref, buffer_ref, hop)
    if remote:
      self.dma(landed, landed, send, recv).wait_recv()
      self.dma(sent, self.destination(buffer_ref, hop), send, recv).wait_send()
    else:
      pltpu.make_async_copy(landed, landed, recv).wait()
      pltpu.make_async_copy(sent, sent, send).wait()


@dataclasses.dataclass(frozen=True)
class _RingCall:
  """The statics every kernel of one phase is built with (bound with ``functools.partial``)."""

  kind: RingKind
  axis_name: str
  n: int
  mesh_axes: tuple[str, ...]
  m: int
  itemsize: int
  direction: int

  def ring(self, coords_ref) -> _Ring:
    """This device's place on the ring, inside a kernel."""
    return _Ring(
      self.kind,
      self.axis_name,
      self.n,
      self.mesh_axes,
      coords_ref,
      self.m,
      self.itemsize,
      self.direction,
    )


def _sum_through_vmem(ring: _Ring, dst, a, b, vmem_a, vmem_b, sems) -> None:
  """``dst = a + b`` for HBM views of ``ring.m`` elements, one VMEM block at a time."""
  block = vmem_a.shape[0]
  whole, rest = divmod(ring.m, block)

  def segment(start, size):
    views = [at(ref, start, size, ring.align) for ref in (a, b, dst)]
    buffers = [vmem.at[pl.ds(0, size)] for vmem in (vmem_a, vmem_b)]
    copy_and_wait(
      pltpu.make_async_copy(v, buf, sems.at[i]) for i, (v, buf) in enumerate(zip(views, buffers))
    )
    add_in_vmem(vmem_a, vmem_b, size)
    copy_and_wait([pltpu.make_async_copy(buffers[0], views[2], sems.at[2])])

  for_each(whole, lambda i: segment(i * block, block))
  if rest:
    segment(whole * block, rest)


def _start_kernel(coords_ref, x_ref, buffer_ref, send, recv, local, *, call: _RingCall):
  """Start: places what hop 0 sends, meets both neighbours, starts hop 0."""
  ring = call.ring(coords_ref)
  if call.kind == "all_gather":  # the own chunk, in its place
    own = pltpu.make_async_copy(x_ref, ring.chunk(buffer_ref, ring.position), local)
  else:  # what hop 0 sends, staged in the last slot
    own = pltpu.make_async_copy(
      ring.chunk(x_ref, ring.sent(0)), ring.source(x_ref, buffer_ref, 0), local
    )
  own.start()
  ring.signal_upstream()
  own.wait()
  ring.wait_downstream()
  ring.send(x_ref, buffer_ref, 0, send, recv)


def _gather_step_kernel(
  coords_ref, buffer_in, send_in, recv_in, buffer_ref, send, recv, *, call: _RingCall, hop: int
):
  """All-gather step: waits for hop ``hop - 1``, starts hop ``hop`` (``buffer_in`` is
  ``buffer_ref``, aliased)."""
  del buffer_in
  ring = call.ring(coords_ref)
  ring.signal_upstream()
  ring.wait_hop(None, buffer_ref, hop - 1, send_in, recv_in)
  ring.wait_downstream()
  ring.send(None, buffer_ref, hop, send, recv)


def _gather_done_kernel(
  coords_ref, buffer_in, send_in, recv_in, buffer_ref, *, call: _RingCall, hop: int
):
  """All-gather done: waits for the last hop, ``hop``."""
  del buffer_in
  ring = call.ring(coords_ref)
  ring.wait_hop(None, buffer_ref, hop, send_in, recv_in, remote=False)


def _reduce_step_kernel(
  coords_ref,
  x_ref,
  buffer_in,
  send_in,
  recv_in,
  buffer_ref,
  send,
  recv,
  vmem_a,
  vmem_b,
  sems,
  *,
  call: _RingCall,
  hop: int,
):
  """Reduce-scatter step: waits for hop ``hop - 1``, adds ``x``'s term to the slot it
  filled, in place, and starts hop ``hop``, which sends that partial sum."""
  del buffer_in
  ring = call.ring(coords_ref)
  ring.signal_upstream()
  ring.wait_hop(x_ref, buffer_ref, hop - 1, send_in, recv_in)
  slot = ring.chunk(buffer_ref, hop - 1)
  own_term = ring.chunk(x_ref, ring.received(hop - 1))
  _sum_through_vmem(ring, slot, slot, own_term, vmem_a, vmem_b, sems)
  ring.wait_downstream()
  ring.send(x_ref, buffer_ref, hop, send, recv)


def _reduce_done_kernel(
  coords_ref,
  x_ref,
  buffer_in,
  send_in,
  recv_in,
  buffer_ref,
  result_ref,
  vmem_a,
  vmem_b,
  sems,
  *,
  call: _RingCall,
  hop: int,
):
  """Reduce-scatter done: waits for the last hop, ``hop``; the last slot plus the own chunk
  is the full sum of chunk ``p``, stored into ``result_ref``."""
  del buffer_in
  ring = call.ring(coords_ref)
  ring.wait_hop(x_ref, buffer_ref, hop, send_in, recv_in, remote=False)
  own = ring.chunk(x_ref, ring.position)
  _sum_through_vmem(ring, result_ref, ring.chunk(buffer_ref, hop), own, vmem_a, vmem_b, sems)


# The kernel of a step (done=False) and of the done call (done=True), per kind.
_CONTINUE_KERNELS = {
  ("all_gather", False): _gather_step_kernel,
  ("all_gather", True): _gather_done_kernel,
  ("reduce_scatter", False): _reduce_step_kernel,
  ("reduce_scatter", True): _reduce_done_kernel,
}


def _params(kind: RingKind, axis_name: str, n: int, direction: int, *, barrier: bool = True):
  """Start and step calls use the pattern's barrier semaphore; the done call uses none
  (Mosaic refuses a ``collective_id`` on a kernel that does not use the barrier)."""
  cid = (
    collective_id(pattern(kind, direction), (axis_name,), _schedule(kind, n)) if barrier else None
  )
  return pltpu.CompilerParams(collective_id=cid, has_side_effects=True)


def _cost(kind: RingKind, m: int, itemsize: int, call: str) -> pl.CostEstimate:
  """The HBM bytes each call's DMAs and local copies move (``call`` in start, step, done):
  a send reads a chunk here and writes one remotely; each start copies one chunk of ``x``
  into the buffer; a reduce-scatter step reads its slot and ``x``'s term and writes the slot, done
  the same into the result."""
  chunk = m * itemsize
  sends = call != "done"
  local = {
    "all_gather": {"start": 2, "step": 0, "done": 0},
    "reduce_scatter": {"start": 2, "step": 3, "done": 3},
  }[kind][call]
  flops = m if kind == "reduce_scatter" and call != "start" else 0
  return pl.CostEstimate(
    flops=flops,
    transcendentals=0,
    bytes_accessed=chunk * (2 * int(sends) + local),
    remote_bytes_transferred=chunk if sends else 0,
  )


def _vmem_scratch(m: int, dtype) -> list:
  block = min(m, ADD_BLOCK_BYTES // jnp.dtype(dtype).itemsize)
  return [pltpu.VMEM((block,), dtype), pltpu.VMEM((block,), dtype), pltpu.SemaphoreType.DMA((3,))]


def ring_start(
  kind: RingKind,
  x: jax.Array,
  axis_name: str,
  n: int,
  mesh_axes: Sequence[str],
  direction: int = 1,
) -> RingState:
  """Syncs with the ring neighbours and starts hop 0 of a ``kind`` phase on ``x`` (module
  doc). ``n`` is the size of ``axis_name``; ``direction`` the ring's (+1: towards the next
  coordinate, as the module doc describes; -1: the mirror image, sending to the previous)."""
  mesh_axes = tuple(mesh_axes)
  m = chunk_elements(kind, x, n, axis_name, mesh_axes)
  if direction not in (1, -1):
    raise ValueError(f"a ring's direction is +1 or -1, got {direction=}")
  itemsize = x.dtype.itemsize
  call = _RingCall(kind, axis_name, n, mesh_axes, m, itemsize, direction)
  kernel = functools.partial(_start_kernel, call=call)
  buffer, send, recv = pl.pallas_call(
    kernel,
    out_shape=(hbm_like(x, (n * m,)), _DMA_SEM, _DMA_SEM),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[_ANY],
      out_specs=(_ANY, _SEM, _SEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    ),
    cost_estimate=_cost(kind, m, itemsize, "start"),
    compiler_params=_params(kind, axis_name, n, direction),
    name=f"{pattern(kind, direction)}_start_{axis_name}",
  )(mesh_coordinates(mesh_axes), x)
  source = x if kind == "reduce_scatter" else None
  return RingState(buffer, source, send, recv, kind, 0, axis_name, n, mesh_axes, direction)


def _continue(state: RingState, *, done: bool):
  kind, n, axis_name, mesh_axes = state.kind, state.n, state.axis_name, state.mesh_axes
  m, dtype = state.chunk, state.buffer.dtype
  hop = state.hop if done else state.hop + 1
  reduce = kind == "reduce_scatter"
  direction = state.direction
  call = _RingCall(kind, axis_name, n, mesh_axes, m, dtype.itemsize, direction)
  kernel = functools.partial(_CONTINUE_KERNELS[kind, done], call=call, hop=hop)
  buffer_type = hbm_like(state.buffer, state.buffer.shape)
  outputs = [buffer_type]
  out_specs = [_ANY]
  if done and reduce:
    outputs.append(hbm_like(state.buffer, (m,)))
    out_specs.append(_ANY)
  if not done:
    outputs += [_DMA_SEM, _DMA_SEM]
    out_specs += [_SEM, _SEM]
  operands = ([state.source] if reduce else []) + [state.buffer, state.send, state.recv]
  result = pl.pallas_call(
    kernel,
    out_shape=tuple(outputs),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[_ANY] * (len(operands) - 2) + [_SEM, _SEM],
      out_specs=tuple(out_specs),
      scratch_shapes=_vmem_scratch(m, dtype) if reduce else [],
    ),
    # Operand 0 is the coordinates; the buffer follows the reduce-scatter's x.
    input_output_aliases={2 if reduce else 1: 0},
    cost_estimate=_cost(kind, m, dtype.itemsize, "done" if done else "step"),
    compiler_params=_params(kind, axis_name, n, direction, barrier=not done),
    name=f"{pattern(kind, direction)}_{'done' if done else 'step'}_{axis_name}",
  )(mesh_coordinates(mesh_axes), *operands)
  if done:
    return result[1] if reduce else result[0]
  buffer, send, recv = result
  return dataclasses.replace(state, buffer=buffer, send=send, recv=recv, hop=hop)


def ring_step(state: RingState) -> RingState:
  """Waits for hop ``state.hop`` and starts the next hop (module doc)."""
  if state.hop + 1 > state.n - 2:
    raise ValueError(f"hop {state.hop} is the last of {state.n} devices: call ring_done")
  return _continue(state, done=False)


def ring_done(state: RingState) -> jax.Array:
  """Waits for the last hop; returns the gathered ``[n * m]`` buffer or the reduced
  ``[m]`` chunk."""
  if state.hop != state.n - 2:
    raise ValueError(f"hop {state.hop} of {state.n - 1}: {state.n - 2 - state.hop} steps remain")
  return _continue(state, done=True)


def pin(state, values):
  """``(state, values)`` through one ``lax.optimization_barrier``: what comes out of it is
  ready only once the state's buffer (the last call's output; or the array a done call
  returned) and every one of ``values`` are. XLA orders the calls and other compute by
  data dependencies alone; compute whose operands come out of a ``pin`` with the state
  runs after the call that produced the state, and a call that takes the state out of a
  ``pin`` with the compute's results runs after that compute (the async note's remedy).
  Only the buffer goes through the barrier: the next call takes it, so that orders the
  call too."""
  buffer, values = lax.optimization_barrier((buffer_of(state), values))
  return with_buffer(state, buffer), values


def buffer_of(state) -> jax.Array:
  """The array a sequence's next call takes: the state's buffer, or the array a done call
  returned (between phases)."""
  return state.buffer if isinstance(state, RingState) else state


def with_buffer(state, buffer: jax.Array):
  """``state`` with ``buffer`` in place of ``buffer_of(state)``."""
  return dataclasses.replace(state, buffer=buffer) if isinstance(state, RingState) else buffer


def ring_phase(
  kind: RingKind,
  x: jax.Array,
  axis_name: str,
  n: int,
  mesh_axes: Sequence[str],
  between: Callable[..., object] | None = None,
  operands=(),
  direction: int = 1,
):
  """One ``kind`` phase as start, ``n - 2`` steps and done, in ``direction``.

  ``between(i, *operands)``, if given, runs after the ``i``-th call (``i`` in
  ``0 .. n - 2``) and before the next one, while hop ``i`` is on the link: ``operands`` go
  through a ``pin`` with the state after the call, and the hook's result through a ``pin``
  with the state before the next, so XLA cannot move the compute out of the window.
  Returns the result, or ``(result, results)`` with the hook's ``n - 1`` results when
  ``between`` is given.
  """
  state = ring_start(kind, x, axis_name, n, mesh_axes, direction)
  results = []
  for i in range(n - 1):
    if between is not None:
      state, ready = pin(state, tuple(operands))
      state, result = pin(state, between(i, *ready))
      results.append(result)
    if i < n - 2:
      state = ring_step(state)
  out = ring_done(state)
  return out if between is None else (out, tuple(results))
