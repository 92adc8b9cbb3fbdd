"""The remote-DMA protocol that every torus kernel family shares.

The blocking kernels (``torus_kernels``), the leaf kernels (``leaf_kernels``), their split
calls (``split_leaf_kernels``) and the block-scaled kernels (``quantized_kernels``) all run
inside a ``shard_map`` that binds every axis of its mesh, address their neighbours by mesh
coordinates, meet at an entry barrier before the first DMA, and stay within one semaphore
budget. This module holds those parts, so that each family states only its own algorithm:

* where a kernel runs: ``mesh_target`` (the mesh axes and device kind of the ``shard_map``
  being traced, after checking that the kernels can run there);
* where a device sits: ``mesh_coordinates``, the kernels' first operand (scalar-prefetched
  into SMEM), which ``Topology`` reads inside a kernel to name ring neighbours as DMA
  targets (``Topology.neighbour``, with ``mod`` for ring arithmetic on traced indices);
* who may write into whom: the barrier semaphore of each kernel is picked by
  ``collective_id``, one per (kind, axes, torus, links) pattern, and ``Topology.barrier``
  is the entry barrier over the ``links`` of a schedule: a device signals each upstream
  neighbour, then waits for as many signals, so no DMA lands in a device that has not
  entered the kernel. The split calls signal and wait one link at a time
  (``Topology.signal_upstream``, ``wait_downstream``);
* the DMAs: ``Topology.remote_copy`` to a neighbour, ``copy_and_wait`` for local copies a
  kernel runs synchronously;
* the budget: ``MAX_SEMAPHORES`` per kernel, and ``hbm_like`` for the HBM outputs (the
  buffers DMAs write) typed like the kernel's input.

Assumptions: device ids are mesh coordinates over all the mesh's axes; every device traces
the same kernels in the same order (one program under ``shard_map``), so a pattern's
barrier semaphore pairs the same calls on every device.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import schedule as schedule_lib
from torus_collectives import target
from torus_collectives.kernels.buffer_layout import Slab

# Semaphores live in a small scoped memory (2 KiB, 512 of them, on v5e, where 840 did not
# compile); leave room for the kernel's other scratch.
MAX_SEMAPHORES = 400
"""The most semaphores (DMA, regular and barrier together) one kernel may allocate."""

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


def mesh_target() -> tuple[tuple[str, ...], str]:
  """(mesh axis names, device kind) of the ``shard_map`` being traced.

  Raises:
    NotImplementedError: on a TPU the remote-DMA kernels do not compile for (v2, v3).
    ValueError: off TPU, unless TPU interpret mode is active.
  """
  device = target.target_device()
  kind = device.device_kind
  if device.platform == "tpu":
    if not target.pallas_compiles_for(kind):
      raise NotImplementedError(
        f"Pallas remote-DMA kernels do not compile for {kind!r}; use "
        "implementation='shard_map' (or 'auto', which picks it) on TPU v2/v3."
      )
  elif not target.interpret_mode_active():
    raise ValueError(
      f"implementation='pallas' needs a TPU, but this computation targets {device.platform!r}. "
      "To run the kernels on CPU in TPU interpret mode, trace the call inside "
      "`with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):`, or use "
      "implementation='auto'."
    )
  return tuple(jax.sharding.get_abstract_mesh().axis_names), kind


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


def mod(x, n: int):
  """``x mod n`` for a traced (or static) ``x >= -n``: ring arithmetic inside a kernel."""
  return lax.rem(x + n, n)


def mesh_coordinates(mesh_axes: Sequence[str]) -> jax.Array:
  """This device's coordinates over all ``mesh_axes``, the kernels' first (SMEM) operand.

  The kernels read their position from this operand rather than calling ``axis_index``
  themselves, which keeps their bodies free of varying-axes types under ``check_vma``.
  """
  return jnp.stack([lax.axis_index(a) for a in mesh_axes]).astype(jnp.int32)


def hbm_like(x: jax.Array, shape):
  """An output type of ``shape`` in HBM, varying over the same mesh axes as ``x``. Left
  free, XLA may place a small output in another memory space and copy it out again."""
  return pltpu.HBM.from_type(jax.typeof(x).update(shape=tuple(shape), weak_type=False))


def copy_and_wait(copies) -> None:
  """Starts every one of the local ``copies``, then waits for every one."""
  copies = list(copies)
  for copy in copies:
    copy.start()
  for copy in copies:
    copy.wait()


def wait_downstream(count: int = 1) -> None:
  """Waits on the barrier semaphore until ``count`` downstream neighbours have entered."""
  pl.semaphore_wait(pltpu.get_barrier_semaphore(), count)


class Topology:
  """Where this device sits on the torus, and how to name its neighbours as DMA targets.

  ``axes`` and ``torus`` are the torus axes (mesh axis names) and their sizes;
  ``mesh_axes`` all axes of the mesh, in the order of ``coords_ref`` (the kernel's
  ``mesh_coordinates`` operand).
  """

  def __init__(
    self, axes: Sequence[str], torus: Sequence[int], mesh_axes: Sequence[str], coords_ref
  ):
    self.axes, self.torus, self.mesh_axes = tuple(axes), tuple(torus), tuple(mesh_axes)
    self.mesh_coords = tuple(coords_ref[i] for i in range(len(self.mesh_axes)))
    self.coords = tuple(self.mesh_coords[self.mesh_axes.index(a)] for a in self.axes)

  def neighbour(self, axis: int, direction: int) -> tuple:
    """Mesh coordinates of the device ``direction`` steps away along torus axis ``axis``."""
    moved = list(self.mesh_coords)
    moved[self.mesh_axes.index(self.axes[axis])] = mod(
      self.coords[axis] + direction, self.torus[axis]
    )
    return tuple(moved)

  def remote_copy(self, src, dst, send_sem, recv_sem, axis: int, direction: int):
    """A DMA from ``src`` here to ``dst`` at the neighbour ``direction`` steps along
    ``axis``, counted on ``send_sem`` here and ``recv_sem`` there."""
    return pltpu.make_async_remote_copy(
      src, dst, send_sem, recv_sem, device_id=self.neighbour(axis, direction)
    )

  def slab(self, phase: schedule_lib.Phase, step: int, *, sending: bool):
    """Grid index along ``phase.axis`` this device sends (or receives) at ``step``."""
    slab = phase.send_slab if sending else phase.recv_slab
    return slab(self.coords[phase.axis], step, self.torus[phase.axis])

  def slab_chunks(self, transfer: schedule_lib.Transfer, slab) -> Slab:
    """The chunks of ``transfer``'s slab ``slab`` on this device (see ``Slab``)."""
    return Slab(transfer, self.torus, self.coords, slab)

  def signal_upstream(self, axis: int, direction: int) -> None:
    """Tells the neighbour that sends to this device along ``(axis, direction)`` that this
    device has entered the current kernel."""
    pl.semaphore_signal(
      pltpu.get_barrier_semaphore(), 1, device_id=self.neighbour(axis, -direction)
    )

  def barrier(self, schedule: schedule_lib.Schedule) -> None:
    """Tells every upstream neighbour we are here; waits until every downstream one is."""
    used = links(schedule)
    for axis, direction in used:
      self.signal_upstream(axis, direction)
    wait_downstream(len(used))
