"""A split ring all-gather over one torus axis: start, steps and done as separate Pallas calls.

The blocking all-gather (``torus_kernels.all_gather_call``) holds the TensorCore from its
first DMA to its last. Here the same ring runs as ``n`` Pallas calls that return while
their DMAs are still on the link, so XLA may schedule independent compute between them
(jax's start/done pattern for asynchronous Pallas calls):

* ``all_gather_start(x, axis_name, n, mesh_axes)``: copies the own chunk ``x`` (``m``
  elements) into its place of the output buffer ``out`` (``n * m`` elements, chunk ``c``
  of the ring at ``c * m``), runs the entry barrier, and starts hop 0: a remote DMA of the
  own chunk into the same place of the ring neighbour's ``out``. It returns ``out`` and
  the hop's send and receive DMA semaphores (``AllGatherState``);
* ``all_gather_step(state)``: hop ``t`` (1 .. n - 2). It waits for hop ``t - 1``'s receive
  (the chunk the upstream neighbour sent) and its own send, then forwards the chunk just
  received to the downstream neighbour. ``out`` is aliased through (the same HBM buffer
  the DMAs are writing), the semaphores are fresh ones of this call;
* ``all_gather_done(state)``: waits for the last hop and returns ``out``.

``ring_all_gather`` runs the whole sequence, with an optional hook between the calls.

Algorithm: the schedule is ``schedule.build("all_gather", (n,), "ring")`` (one stream,
direction +1). At hop ``t`` the device at ring position ``p`` sends chunk
``(p - t) mod n`` (``Phase.send_slab``) to ``p + 1`` and receives chunk
``(p - 1 - t) mod n`` (``Phase.recv_slab``) from ``p - 1``, each DMA from a place of the
sender's ``out`` to the same place of the receiver's. After ``n - 1`` hops every device
holds all ``n`` chunks: ``lax.all_gather(x, axis_name, tiled=True)``.

Synchronisation:

* no capacity handshake: every place of ``out`` is written exactly once (by the own copy
  or by one incoming DMA) and read only after the write has been waited for (a chunk is
  forwarded at hop ``t + 1`` only after hop ``t``'s receive wait), so nothing is reused;
* entry barrier (the barrier semaphore of ``collective_id("async_all_gather", ...)``, a
  pattern of its own, distinct from the blocking kernels'): a device signals its upstream
  neighbour and waits for its downstream one before hop 0, so no DMA lands in a device
  that has not entered the start call (whose ``out`` would not exist yet);
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
  and only the next call of the sequence waits them (with descriptors of the same chunk,
  so the byte counts match), so a wait never pairs with another hop's DMA.

Compiled schedule: between the calls XLA sees only data dependencies (``out`` and the
semaphores flow from each call into the next), and it does not keep independent compute
inside the window: compiled ahead of time for v5e:2x4 (the y axis, n = 4), three
independent matmuls written between start, the steps and done were all scheduled after
done, the four calls back to back. So the compute is pinned with
``lax.optimization_barrier`` (``pin``, as the async note does): its operands go through a
barrier with ``out`` after a call, its results through another before the next call.
Then the scheduled program runs start, matmul, step, matmul, step, matmul, done, with
``out`` handed from call to call in place (each call aliases it; no copy between them);
the barriers themselves are gone from the scheduled program. The tests check this
order on the compiled program. XLA copies the result once after done only where it is
the program's output.

Assumptions: a 1-D chunk ``x`` of a 32-bit type (float32, int32) whose length ``m`` is a
multiple of 128 elements (whole DMA words: no tail); ``n >= 2`` devices along
``axis_name``; the calls run inside a ``shard_map`` that binds every axis of
``mesh_axes`` (device ids are mesh coordinates over all of them), in this order, with no
other kernel of the same pattern interleaved on the same devices; the caller uses
``out`` only after ``all_gather_done`` (between the calls it is being written). ``out``
is typed like ``x`` (its varying axes, so ``shard_map(check_vma=True)`` accepts it). All
calls are marked as having side effects (the barrier signals), like the blocking kernels.

Nothing here has run on a TPU: the calls are verified in TPU interpret mode (with the
test-side split-call extension, ``tests/async_interpret.py``) and compiled ahead of time
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

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import torus_kernels
from torus_collectives.kernels.buffer_layout import at, dma_alignment

KIND = "async_all_gather"
_ANY = pl.BlockSpec(memory_space=pl.ANY)
_SEM = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
_DMA_SEM = pltpu.SemaphoreType.DMA(())


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["out", "send", "recv"],
  meta_fields=["hop", "axis_name", "n", "mesh_axes"],
)
@dataclasses.dataclass(frozen=True)
class AllGatherState:
  """What one call of the sequence hands to the next: the output buffer (being written),
  the send and receive semaphores of hop ``hop``'s DMA, and the static description."""

  out: jax.Array
  send: jax.Array
  recv: jax.Array
  hop: int
  axis_name: str
  n: int
  mesh_axes: tuple[str, ...]

  @property
  def chunk(self) -> int:
    return self.out.shape[0] // self.n


def _schedule(n: int) -> schedule_lib.Schedule:
  return schedule_lib.build("all_gather", (n,), "ring")


def _phase(n: int) -> schedule_lib.Phase:
  (phases,) = _schedule(n).streams
  (phase,) = phases
  return phase


def _check(x: jax.Array, n: int, axis_name: str, mesh_axes: Sequence[str]) -> int:
  if n < 2:
    raise ValueError(f"a ring all-gather needs n >= 2 devices, got {n=}")
  if axis_name not in mesh_axes:
    raise ValueError(f"{axis_name=} is not one of {mesh_axes=}")
  if x.ndim != 1 or x.dtype.itemsize != 4:
    raise ValueError(f"expected a 1-D chunk of a 32-bit type, got {x.dtype}{list(x.shape)}")
  m = x.shape[0]
  if m < 1 or m % dma_alignment(4):
    raise ValueError(f"the chunk's {m} elements must be a positive multiple of 128")
  return m


class _Ring:
  """This device's place on the ring, inside a kernel."""

  def __init__(self, axis_name, n, mesh_axes, coords_ref, m):
    self.topo = torus_kernels._Topology((axis_name,), (n,), tuple(mesh_axes), coords_ref)
    self.n, self.m, self.phase = n, m, _phase(n)
    self.position = self.topo.coords[0]

  def chunk(self, ref, index):
    return at(ref, index * self.m, self.m, dma_alignment(4))

  def sent(self, hop: int):
    """The chunk this device sends at ``hop`` (``Phase.send_slab``, traced)."""
    return torus_kernels._mod(self.position - self.phase.direction * hop, self.n)

  def received(self, hop: int):
    """The chunk this device receives at ``hop`` (``Phase.recv_slab``, traced)."""
    return torus_kernels._mod(self.position - self.phase.direction * (hop + 1), self.n)

  def dma(self, out_ref, index, send, recv):
    """The remote DMA of chunk ``index`` to the same place of the downstream neighbour."""
    view = self.chunk(out_ref, index)
    return pltpu.make_async_remote_copy(
      view, view, send, recv, device_id=self.topo.neighbour(0, self.phase.direction)
    )

  def signal_upstream(self):
    """Tells the upstream neighbour this device has entered the current call."""
    upstream = self.topo.neighbour(0, -self.phase.direction)
    pl.semaphore_signal(pltpu.get_barrier_semaphore(), 1, device_id=upstream)

  def wait_downstream(self):
    """Waits until the downstream neighbour has entered the current call."""
    pl.semaphore_wait(pltpu.get_barrier_semaphore(), 1)

  def wait_hop(self, out_ref, hop: int, send, recv):
    """Waits for ``hop``'s receive and for this device's own send of that hop."""
    self.dma(out_ref, self.received(hop), send, recv).wait_recv()
    self.dma(out_ref, self.sent(hop), send, recv).wait_send()


def _start_kernel(axis_name, n, mesh_axes, m, coords_ref, x_ref, out_ref, send, recv, local):
  ring = _Ring(axis_name, n, mesh_axes, coords_ref, m)
  own = pltpu.make_async_copy(x_ref, ring.chunk(out_ref, ring.position), local)
  own.start()
  ring.signal_upstream()
  own.wait()
  ring.wait_downstream()
  ring.dma(out_ref, ring.sent(0), send, recv).start()


def _step_kernel(
  axis_name, n, mesh_axes, m, hop, coords_ref, out_in, send_in, recv_in, out_ref, send, recv
):
  del out_in  # aliased: the same buffer as out_ref
  ring = _Ring(axis_name, n, mesh_axes, coords_ref, m)
  ring.signal_upstream()
  ring.wait_hop(out_ref, hop - 1, send_in, recv_in)
  ring.wait_downstream()
  # The chunk received at hop - 1 is the one sent at hop.
  ring.dma(out_ref, ring.sent(hop), send, recv).start()


def _done_kernel(axis_name, n, mesh_axes, m, hop, coords_ref, out_in, send_in, recv_in, out_ref):
  del out_in
  ring = _Ring(axis_name, n, mesh_axes, coords_ref, m)
  ring.wait_hop(out_ref, hop, send_in, recv_in)


def _params(axis_name: str, n: int, *, barrier: bool = True) -> pltpu.CompilerParams:
  """The start and step calls use the pattern's barrier semaphore; the done call uses none
  (Mosaic refuses a ``collective_id`` on a kernel that does not use the barrier)."""
  cid = torus_kernels.collective_id(KIND, (axis_name,), _schedule(n)) if barrier else None
  return pltpu.CompilerParams(collective_id=cid, has_side_effects=True)


def _cost(m: int, itemsize: int, *, sends: bool, own_copy: bool = False) -> pl.CostEstimate:
  """One chunk read and written by this call's DMA (if it starts one), and the own copy."""
  chunk = m * itemsize
  return pl.CostEstimate(
    flops=0,
    transcendentals=0,
    bytes_accessed=2 * chunk * (int(sends) + int(own_copy)),
    remote_bytes_transferred=chunk if sends else 0,
  )


def all_gather_start(
  x: jax.Array, axis_name: str, n: int, mesh_axes: Sequence[str]
) -> AllGatherState:
  """Places the own chunk ``x`` in ``out``, syncs with the ring neighbours and starts hop 0
  (module doc). ``n`` is the size of ``axis_name``."""
  mesh_axes = tuple(mesh_axes)
  m = _check(x, n, axis_name, mesh_axes)
  kernel = functools.partial(_start_kernel, axis_name, n, mesh_axes, m)
  out, send, recv = pl.pallas_call(
    kernel,
    out_shape=(torus_kernels._hbm_like(x, (n * m,)), _DMA_SEM, _DMA_SEM),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[_ANY],
      out_specs=(_ANY, _SEM, _SEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    ),
    cost_estimate=_cost(m, x.dtype.itemsize, sends=True, own_copy=True),
    compiler_params=_params(axis_name, n),
    name=f"async_all_gather_start_{axis_name}",
  )(torus_kernels.mesh_coordinates(mesh_axes), x)
  return AllGatherState(out, send, recv, 0, axis_name, n, mesh_axes)


def _continue(state: AllGatherState, *, done: bool):
  n, axis_name, mesh_axes = state.n, state.axis_name, state.mesh_axes
  hop = state.hop if done else state.hop + 1
  kernel = functools.partial(
    _done_kernel if done else _step_kernel, axis_name, n, mesh_axes, state.chunk, hop
  )
  out_type = torus_kernels._hbm_like(state.out, state.out.shape)
  return pl.pallas_call(
    kernel,
    out_shape=out_type if done else (out_type, _DMA_SEM, _DMA_SEM),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[_ANY, _SEM, _SEM],
      out_specs=_ANY if done else (_ANY, _SEM, _SEM),
    ),
    input_output_aliases={1: 0},
    cost_estimate=_cost(state.chunk, state.out.dtype.itemsize, sends=not done),
    compiler_params=_params(axis_name, n, barrier=not done),
    name=f"async_all_gather_{'done' if done else 'step'}_{axis_name}",
  )(torus_kernels.mesh_coordinates(mesh_axes), state.out, state.send, state.recv)


def all_gather_step(state: AllGatherState) -> AllGatherState:
  """Waits for hop ``state.hop`` and starts the next hop (module doc)."""
  if state.hop + 1 > state.n - 2:
    raise ValueError(f"hop {state.hop} is the last of {state.n} devices: call all_gather_done")
  out, send, recv = _continue(state, done=False)
  return dataclasses.replace(state, out=out, send=send, recv=recv, hop=state.hop + 1)


def all_gather_done(state: AllGatherState) -> jax.Array:
  """Waits for the last hop; returns the gathered ``[n * m]`` buffer."""
  if state.hop != state.n - 2:
    raise ValueError(f"hop {state.hop} of {state.n - 1}: {state.n - 2 - state.hop} steps remain")
  return _continue(state, done=True)


def pin(state: AllGatherState, values):
  """``(state, values)`` through one ``lax.optimization_barrier``: what comes out of it is
  ready only once ``state.out`` (the last call's output) and every one of ``values`` are.
  XLA orders the calls and other compute by data dependencies alone; compute whose
  operands come out of a ``pin`` with the state runs after the call that produced the
  state, and a call that takes the state out of a ``pin`` with the compute's results runs
  after that compute (the async note's remedy). Only the buffer goes through the barrier:
  the next call takes it, so that orders the call too."""
  out, values = lax.optimization_barrier((state.out, values))
  return dataclasses.replace(state, out=out), values


def ring_all_gather(
  x: jax.Array,
  axis_name: str,
  n: int,
  mesh_axes: Sequence[str],
  between: Callable[..., object] | None = None,
  operands=(),
):
  """``lax.all_gather(x, axis_name, tiled=True)`` as start, ``n - 2`` steps and done.

  ``between(i, *operands)``, if given, runs after the ``i``-th call (``i`` in
  ``0 .. n - 2``) and before the next one, while hop ``i`` is on the link: ``operands`` go
  through a ``pin`` with the state after the call, and the hook's result through a ``pin``
  with the state before the next, so XLA cannot move the compute out of the window.
  Returns the gathered buffer, or ``(buffer, results)`` with the hook's ``n - 1`` results
  when ``between`` is given.
  """
  state = all_gather_start(x, axis_name, n, mesh_axes)
  results = []
  for i in range(n - 1):
    if between is not None:
      state, ready = pin(state, tuple(operands))
      state, result = pin(state, between(i, *ready))
      results.append(result)
    if i < n - 2:
      state = all_gather_step(state)
  out = all_gather_done(state)
  return out if between is None else (out, tuple(results))
