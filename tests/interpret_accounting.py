"""Counts what Pallas TPU kernels move and signal while they run in TPU interpret mode.

A test utility, never imported by the package: ``counting()`` patches jax's TPU interpreter
(``jax._src.pallas.mosaic.interpret``, jax 0.12) for the duration of a ``with`` block, and
returns an ``Accounting`` that holds one ``CallRecord`` per ``pallas_call`` run inside the
block, in the order they ran. Trace and run the kernels inside the block (the interpreter
binds some of its callbacks when a kernel is traced).

What it counts, per call and per device:

* every DMA the kernel body starts (``make_async_copy``, ``make_async_remote_copy``), at
  the moment the interpreter reads its source: its bytes, source and destination memory
  space, source and destination device. HBM bytes read are those of DMAs whose source is
  in HBM, HBM bytes written those whose destination is; remote bytes those of DMAs whose
  destination is another device. A DMA is charged to the device that started it (for a
  remote DMA, both the read of its source and the write into the other device's HBM).
* the block copies of the ``BlockSpec`` pipeline, which the interpreter runs between grid
  iterations as Mosaic's pipeline does (an input block is fetched only when its block
  index changes, an output block written back only when it changes or the grid ends):
  their in-bounds bytes (a ragged last block moves only the rows that exist).
  ``tiled`` counts also round the last two dimensions of each block of an array of rank
  two or more up to whole (8, 128) tiles, the layout the arrays have in HBM.
* loads and stores of the kernel body on HBM refs (the interpreter refuses those, so
  any count here would be a change in jax).
* semaphores: every signal (its increment and the device it is addressed to) and every
  completed wait (its value), per semaphore and device, including the DMA semaphores'
  signals by the DMA engine (bytes) and the barrier semaphore's. ``CallRecord.check()``
  asserts, when the call ends and every device has left the kernel, that each semaphore's
  signals and waits balance on every device (the count is back to zero), and that every
  DMA started has completed (in ``on_wait`` mode a DMA no one waits for never runs).

What it cannot see: it checks the paths the run took, not every path of the kernel (a
branch that no device takes at the sizes run is not checked; choose sizes whose ragged
ends take the branches); it checks counts, not timing (a wait that is satisfied early
because signals arrived in a lucky order is invisible; the interpreter does not model
hardware timing); and it counts what the interpreter moves, which is what the kernel
asks for, not what the hardware's DMA engines would move in bursts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import threading

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
from jax._src.pallas.mosaic.interpret import shared_memory as memory
from jax._src.pallas.mosaic.interpret import utils as interpret_utils

_HBM = ("hbm", "any")
_TILE = (8, 128)


def _space(index) -> str:
  return ipc.TPU_MEMORY_SPACE_NAMES[int(index)]


def _tiled(shape, itemsize: int) -> int:
  """Bytes of a block of ``shape`` with its last two dimensions in whole (8, 128) tiles."""
  if len(shape) < 2:
    return math.prod(shape) * itemsize
  *major, sub, lanes = shape
  padded = -(-sub // _TILE[0]) * _TILE[0] * (-(-lanes // _TILE[1]) * _TILE[1])
  return math.prod(major) * padded * itemsize


def _in_bounds_shape(transforms, shape) -> tuple[int, ...]:
  """The shape of the part of the block ``transforms`` selects that lies inside ``shape``."""
  rng = interpret_utils.to_range(transforms)
  out = []
  for dim, r in zip(shape, tuple(rng) + (None,) * (len(shape) - len(rng))):
    if r is None:
      out.append(dim)
    elif isinstance(r, slice):
      step = r.step or 1
      out.append(max(0, -(-(min(r.stop, dim) - r.start) // step)))
    # an integer index squeezes its dimension
  return tuple(out)


@dataclasses.dataclass
class Traffic:
  """Bytes one device's kernel moved."""

  hbm_read: int = 0  # DMA sources in HBM
  hbm_write: int = 0  # DMA destinations in HBM (on whichever device)
  remote: int = 0  # DMAs into another device
  dma_count: int = 0
  pipeline_in: int = 0  # BlockSpec input blocks fetched from HBM (in-bounds bytes)
  pipeline_out: int = 0  # BlockSpec output blocks written to HBM (in-bounds bytes)
  pipeline_in_tiled: int = 0
  pipeline_out_tiled: int = 0
  body_hbm: int = 0  # kernel-body loads and stores on HBM refs

  @property
  def bytes_accessed(self) -> int:
    """HBM bytes read plus written, DMAs and pipeline block copies (logical bytes)."""
    return self.hbm_read + self.hbm_write + self.pipeline_in + self.pipeline_out + self.body_hbm

  @property
  def bytes_accessed_tiled(self) -> int:
    """As ``bytes_accessed``, with pipeline blocks counted in whole (8, 128) tiles."""
    return (
      self.hbm_read
      + self.hbm_write
      + self.pipeline_in_tiled
      + self.pipeline_out_tiled
      + self.body_hbm
    )


@dataclasses.dataclass
class CallRecord:
  """What one ``pallas_call`` did, per device (interpreter device ids)."""

  traffic: dict[int, Traffic] = dataclasses.field(
    default_factory=lambda: collections.defaultdict(Traffic)
  )
  # (semaphore kind, semaphore id, device) -> total increments / total waited values.
  signalled: dict[tuple, int] = dataclasses.field(default_factory=collections.Counter)
  waited: dict[tuple, int] = dataclasses.field(default_factory=collections.Counter)
  # (kind, id, device) -> the values of the completed waits, in order.
  waits: dict[tuple, list[int]] = dataclasses.field(
    default_factory=lambda: collections.defaultdict(list)
  )
  # (kind, id, device) -> the increments signalled, in order.
  signals: dict[tuple, list[int]] = dataclasses.field(
    default_factory=lambda: collections.defaultdict(list)
  )
  unfinished_dmas: int = 0
  nonzero_at_exit: list[tuple] = dataclasses.field(default_factory=list)

  def barrier(self, device: int) -> tuple[list[int], list[int]]:
    """(signals addressed to, waits of) ``device``'s barrier semaphore(s)."""
    sig = [v for k, vs in self.signals.items() if k[0] == "barrier" and k[2] == device for v in vs]
    wait = [v for k, vs in self.waits.items() if k[0] == "barrier" and k[2] == device for v in vs]
    return sig, wait

  def imbalances(self) -> dict[tuple, tuple[int, int]]:
    """(kind, id, device) -> (signalled, waited) where the two differ."""
    keys = set(self.signalled) | set(self.waited)
    return {
      k: (self.signalled[k], self.waited[k]) for k in keys if self.signalled[k] != self.waited[k]
    }

  def check(self) -> None:
    """Asserts every semaphore balanced on every device and every DMA completed."""
    bad = self.imbalances()
    assert not bad, f"semaphores left signalled or over-waited (signalled, waited): {bad}"
    assert not self.nonzero_at_exit, f"semaphores nonzero at kernel exit: {self.nonzero_at_exit}"
    assert self.unfinished_dmas == 0, f"{self.unfinished_dmas} DMAs never completed"

  def total(self, field: str) -> int:
    return sum(getattr(t, field) for t in self.traffic.values())


class Accounting:
  """The records of the ``pallas_call``s run while ``counting()`` was active."""

  def __init__(self):
    self.calls: list[CallRecord] = []
    self._current = CallRecord()
    self._dmas: list = []
    self.lock = threading.Lock()

  @property
  def current(self) -> CallRecord:
    return self._current

  def _kind(self, sem) -> str:
    fixed = sem.shared_memory.fixed_id_sem
    return "barrier" if fixed.get(sem.id) is sem else "allocated"

  def signal(self, sem, inc, global_core_id) -> None:
    key = (self._kind(sem), sem.id, int(global_core_id))
    with self.lock:
      self._current.signalled[key] += int(inc)
      self._current.signals[key].append(int(inc))

  def wait(self, sem, value, global_core_id) -> None:
    key = (self._kind(sem), sem.id, int(global_core_id))
    with self.lock:
      self._current.waited[key] += int(value)
      self._current.waits[key].append(int(value))

  def dma_started(self, dma) -> None:
    with self.lock:
      self._dmas.append(dma)

  def dma_read(self, dma, nbytes: int) -> None:
    with self.lock:
      t = self._current.traffic[dma.src_device_id]
      t.dma_count += 1
      if _space(dma.src_memory_space) in _HBM:
        t.hbm_read += nbytes
      if _space(dma.dst_memory_space) in _HBM:
        t.hbm_write += nbytes
      if dma.dst_device_id != dma.src_device_id:
        t.remote += nbytes

  def block(self, device, direction: str, shape, itemsize: int) -> None:
    with self.lock:
      t = self._current.traffic[int(device)]
      nbytes = math.prod(shape) * itemsize
      if direction == "in":
        t.pipeline_in += nbytes
        t.pipeline_in_tiled += _tiled(shape, itemsize)
      else:
        t.pipeline_out += nbytes
        t.pipeline_out_tiled += _tiled(shape, itemsize)

  def body_hbm(self, device, nbytes: int) -> None:
    with self.lock:
      self._current.traffic[int(device)].body_hbm += nbytes

  def end_call(self, shared_memory) -> None:
    """Closes the current call: every device has left its kernel (the interpreter's
    clean-up barrier), so the semaphores' final counts are known."""
    with self.lock:
      record = self._current
      record.unfinished_dmas = sum(d.state != ipc.DmaState.COMPLETED for d in self._dmas)
      if shared_memory is not None:
        for device in range(shared_memory.num_devices):
          for sem, core in shared_memory.get_sempahores_with_nonzero_count(device):
            record.nonzero_at_exit.append((sem.id, core, int(sem.count_by_core[core])))
      self.calls.append(record)
      self._current, self._dmas = CallRecord(), []


_active: Accounting | None = None


class _CountedDMA(ipc.DMA):
  """The interpreter's DMA, reporting its start and the bytes it reads."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.counted = False
    if _active is not None:
      _active.dma_started(self)

  def execute_read(self):
    super().execute_read()
    if _active is None:
      return
    # In on_wait mode the read may run in two threads (the sender's and the receiver's);
    # the first to see the data counts it. Read ``data`` once: another thread's write may
    # drop it at any time.
    data = self.data
    with _active.lock:
      first = not self.counted and data is not None
      self.counted = self.counted or first
    if first:
      _active.dma_read(self, int(data.nbytes))


def _wrap_get(original, input_shapes):
  """``get`` that counts the pipeline's input blocks, clipped to ``input_shapes[name]``:
  the interpreter pads each operand to whole blocks, but of a ragged last block only the
  part inside the array is moved."""

  @functools.wraps(original)
  def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kw):
    out = original(
      token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kw
    )
    if _active is not None and kw.get("input_name") is not None:
      shape = _in_bounds_shape(jax.tree.map(int, transforms), input_shapes[kw["input_name"]])
      _active.block(device_id, "in", shape, out[1].dtype.itemsize)
    elif _active is not None and _space(memory_space) in _HBM and "source_info" in kw:
      _active.body_hbm(device_id, int(np.asarray(out[1]).nbytes))
    return out

  get.__wrapped__ = original.__wrapped__  # what the interpreter's DMAs call directly
  return get


def _wrap_store(original, output_shapes):
  @functools.wraps(original)
  def store(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *a, **kw):
    out = original(
      token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *a, **kw
    )
    if _active is not None and kw.get("output_name") is not None:
      shape = _in_bounds_shape(jax.tree.map(int, transforms), output_shapes[kw["output_name"]])
      _active.block(device_id, "out", shape, np.asarray(val).dtype.itemsize)
    return out

  store.__wrapped__ = original.__wrapped__
  return store


def _operand_shapes(jaxpr, grid_mapping) -> tuple[dict, dict]:
  """(input name -> shape, output name -> shape) of a pallas_call's blocked operands, by
  the names the interpreter passes to its block copies."""
  mappings = grid_mapping.block_mappings
  names = jaxpr.debug_info.arg_names
  if names is None:
    names = ("unknown",) * len(mappings)
  else:
    names = names[grid_mapping.slice_block_ops]
  tables = ({}, {})
  for i, (name, bm) in enumerate(zip(names, mappings)):
    table = tables[i >= grid_mapping.num_inputs]
    shape = tuple(int(d) for d in bm.array_aval.shape)
    if table.setdefault(name, shape) != shape:
      raise ValueError(f"two operands named {name!r} with different shapes: cannot count")
  return tables


def _counted_pallas_call(original):
  """The interpreter's ``pallas_call`` lowering, run with ``get`` and ``store`` that know
  this call's operand shapes (they are bound into the interpreted program here)."""

  @functools.wraps(original)
  def interpret_pallas_call(*args, jaxpr, grid_mapping, **kw):
    inputs, outputs = _operand_shapes(jaxpr, grid_mapping)
    get, store = ipc.get, ipc.store
    ipc.get, ipc.store = _wrap_get(get, inputs), _wrap_store(store, outputs)
    try:
      return original(*args, jaxpr=jaxpr, grid_mapping=grid_mapping, **kw)
    finally:
      ipc.get, ipc.store = get, store

  return interpret_pallas_call


def _wrap_swap(original):
  @functools.wraps(original)
  def swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *a, **kw):
    out = original(
      token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *a, **kw
    )
    if _active is not None and _space(memory_space) in _HBM:
      _active.body_hbm(device_id, 2 * int(np.asarray(val).nbytes))
    return out

  return swap


def _counted_signal(original):
  @functools.wraps(original)
  def signal(self, inc, global_core_id, clock, logging_info=None):
    original(self, inc, global_core_id, clock, logging_info=logging_info)
    if _active is not None:
      _active.signal(self, inc, global_core_id)

  return signal


def _counted_wait(original):
  @functools.wraps(original)
  def wait(self, value, global_core_id, **kw):
    original(self, value, global_core_id, **kw)
    if _active is not None:
      _active.wait(self, value, global_core_id)

  return wait


def _counted_clear(original):
  @functools.wraps(original)
  def clear():
    if _active is not None:
      _active.end_call(ipc._shared_memory)
    original()

  return clear


@contextlib.contextmanager
def counting():
  """Patches the TPU interpreter to count into a fresh ``Accounting`` (see the module
  docstring); the interpreter is restored on exit. Not reentrant."""
  global _active
  if _active is not None:
    raise RuntimeError("counting() is already active")
  patches = [
    (ipc, "DMA", _CountedDMA),
    (ipc, "interpret_pallas_call", _counted_pallas_call(ipc.interpret_pallas_call)),
    (ipc, "swap", _wrap_swap(ipc.swap)),
    (ipc, "_clear_shared_memory", _counted_clear(ipc._clear_shared_memory)),
    (memory.Semaphore, "signal", _counted_signal(memory.Semaphore.signal)),
    (memory.Semaphore, "wait", _counted_wait(memory.Semaphore.wait)),
  ]
  saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
  accounting = Accounting()
  for owner, name, value in patches:
    setattr(owner, name, value)
  _active = accounting
  try:
    yield accounting
  finally:
    _active = None
    for owner, name, value in saved:
      setattr(owner, name, value)
