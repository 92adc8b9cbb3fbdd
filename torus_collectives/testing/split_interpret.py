"""Split (start / step / done) Pallas TPU calls in TPU interpret mode: an extension for tests.

On a TPU a start ``pallas_call`` may return DMA semaphores (``pltpu.SemaphoreType.DMA``
outputs in ``pltpu.SEMAPHORE``) and the buffers its DMAs are still writing; a later call
takes both, aliases the buffers through ``input_output_aliases`` and waits. jax's TPU
interpret mode (pinned here: ``SUPPORTED_JAX_VERSION``) cannot run that:

* it allocates every output as an HBM array of the output's dtype, which fails for a
  semaphore dtype (``get_uninitialized_array``: ``nan + dma_sem``);
* it copies each call's inputs into fresh buffers and reads each output back into an XLA
  array when the call ends, so a DMA that lands after its call wrote into a buffer that
  no later call sees;
* every call builds its shared memory (buffers, semaphores with their counts and pending
  DMAs, vector clocks, race records) on entry and drops it on exit (the clean-up
  barrier's action, ``_clear_shared_memory``), so no semaphore outlives its call.

``async_interpret_mode(dma_execution_mode)`` is a context manager that runs the Pallas TPU
kernels traced inside it in interpret mode (race detector on by default) with one shared
memory for the whole block, and wraps a few interpreter internals for its duration:

* ``_clear_shared_memory``: a no-op, so buffers, semaphores, pending DMAs, vector clocks
  and race records persist from one call to the next (the block resets them on exit);
* ``interpret_pallas_call``: a call with semaphore inputs or outputs is rewritten before
  the stock interpreter runs it. Its semaphore operands become the first scratch
  semaphores of the kernel; the semaphore values that XLA carries between calls are
  int32 arrays of interpreter semaphore ids (a semaphore's physical type is int32). A
  callback before the call tells the wrapped ``_allocate_semaphores`` to hand the kernel
  the ids of its semaphore inputs instead of fresh ones, and to record the fresh ids of
  its semaphore outputs, which a callback after the call returns. A call with semaphore
  inputs or outputs gets its other outputs as inputs instead (the interpreter never reads
  an input back when the call ends); an output aliased to an input is that input. After
  the call, each such buffer that a DMA counted on a *live* semaphore writes into is *in
  flight*: live, one that a call of this device returned and no later call of it has
  taken (and so waited); a DMA into the buffer on any device counts (``dma_start`` is
  wrapped to record destinations; buffer ids are allocated in one order on every device,
  and a buffer that receives nothing on one device, a window of zero rows there, must stay
  the same buffer there too). So a buffer stays in flight through calls that pass it on
  while other calls' DMAs still land in it (several chains over one buffer). XLA gets a
  placeholder for it (a header naming the interpreter buffer, the rest uninitialized
  memory: NaN, or the maximum for integers), not its contents. The others are read
  back as the interpreter reads outputs (with the race check);
* ``_allocate_buffer``: a buffer allocated from a placeholder is the buffer the
  placeholder names, not a copy, so the call that aliases an in-flight buffer through
  and waits works on the buffer its DMAs land in, and its reads are checked against
  those DMAs' writes by the race detector;
* ``Semaphore.wait``: waits are timed; one that blocks longer than
  ``deadlock_timeout_s`` fails the computation with a ``DeadlockError`` instead of hanging;
* ``_initialize_shared_memory``: the shared memory's two barriers (the global one before a
  kernel without a barrier semaphore, and the clean-up one that every device meets at the
  end of each call) are replaced by bounded ones. A wait on either ends with a
  ``DeadlockError`` after ``deadlock_timeout_s``, and as soon as the computation has
  failed: the stock barriers count every device's arrival, and a device that fails in a
  call (a race it reports, say) while the others already wait at that call's end meets
  the clean-up barrier once where the others meet it again in their next callback, which
  left them blocked forever, and the next block's computation queued behind them.

The rewrite relies on the order in which jax 0.12's interpreter allocates (the inputs'
HBM buffers first, in operand order; then the kernel's semaphores in operand order); the
callback after each call checks that every planned allocation happened.

On leaving the block without an error, every semaphore a call returned must have been
waited back to zero with no DMA pending on it (``NeverWaitedError`` otherwise), and the
race detector must have found nothing. A failed computation is re-raised as the
interpreter's original failure (``KernelFailure``: a race, say; ``DeadlockError`` for a
timed-out wait), not as whichever device's secondary error XLA happened to report; jax's
ordered-effects tokens are drained so the failure does not resurface in the next
computation, and the block waits (at most ``deadlock_timeout_s`` and a few seconds) until
no thread runs interpreter code any more, so that the next block starts on fresh shared
memory, barriers and semaphores with no straggler of the failed computation left.

Where it stops (what it cannot model):

* XLA between the calls is not interpreted: compute that reads an in-flight buffer sees
  the placeholder (garbage, as on a TPU it would see a buffer being written), and is not
  reported as a race; a kernel that reads it before waiting is. Compute that writes a
  DMA's source between start and done is not seen either: each call snapshots its
  inputs, and a DMA reads the snapshot the start call took. Buffer lifetimes, XLA's
  defensive copies, donation and the order XLA schedules the calls in (the async note's
  problems) are the compiler's, and are checked on compiled HLO, not here.
* Semaphore values are the interpreter's ids: arithmetic on them, or passing one to
  another device, is meaningless. Semaphore outputs cannot be aliased to inputs; the
  buffers a call with semaphore operands gives back must live in HBM / ``pl.ANY``; in-flight
  buffers must hold at least 20 bytes (the placeholder's header).
* One shared memory per block: buffers are never freed inside it, and ids are int16 in
  the interpreter, so a block runs some thousands of calls, not millions. Every call in
  the block must use its interpret params; nested blocks are refused. Executables
  lowered inside a block call back into it, so jax's caches are cleared on entry and exit.
* The simulated devices share XLA's CPU pool (``cpu_pool_threads``): a block refuses to
  start with fewer than ``CPU_POOL_THREADS_PER_DEVICE`` threads a device, since a kernel
  call that waits at a barrier beside a collective of the same device can otherwise take
  the last threads and stall the step (set ``NPROC`` before jax starts; the suite's
  conftest does).
* The deadlock check is a timeout, not a proof: a wait (on a semaphore or on one of the
  interpreter's barriers) that is merely slow for longer than ``deadlock_timeout_s`` fails
  too. After a failure the devices leave the barriers without all having arrived: the
  failed block's shared memory is only fit for inspection, never for another call.
* The interpreter's exit check (``_validate``) still prints a line for every semaphore
  that counts something when a call ends: expected for a start call's semaphores in
  eager mode, where its DMAs have already landed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import struct
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from torus_collectives import _jax_internals as jax_internals

SUPPORTED_JAX_VERSION = "0.12.0.1"

# The interpreter internals this extension replaces for the duration of a block, by
# module of jax (``jax._src.pallas.mosaic.interpret``), and the behaviour it relies on
# without replacing it. ``check_jax_version`` names them all.
_INTERPRETER = "jax._src.pallas.mosaic.interpret"
PATCHED_FUNCTIONS = (
  "_clear_shared_memory",
  "interpret_pallas_call",
  "_allocate_buffer",
  "_allocate_semaphores",
  "dma_start",
  "_initialize_shared_memory",
)
PATCHED_INTERNALS = (
  *(f"{_INTERPRETER}.interpret_pallas_call.{name}" for name in PATCHED_FUNCTIONS),
  f"{_INTERPRETER}.shared_memory.Semaphore.wait",
)
RELIED_ON = (
  "interpret_pallas_call's order of allocation (the inputs' HBM buffers first, in operand "
  "order, then the kernel's semaphores in operand order)",
  "the arguments of dma_start, _allocate_buffer, _allocate_semaphores and Semaphore.wait",
  "what it reads of interpret_pallas_call: _shared_memory, _get_shared_memory, "
  "_shared_memory_init_lock, _update_clocks_for_global_barrier, _forward_any_to_hbm, _HBM, "
  "fail_on_exception, get, races, DMA.execute_read, DmaState, TOKEN_SHAPE_DTYPE, "
  "TOP_LEVEL_TOKEN_VALUE, TPU_MEMORY_SPACE_IDXS, TPU_MEMORY_SPACE_NAMES",
  "what it reads of the shared memory: mem, sem, lock, barrier, clean_up_barrier, "
  "num_devices, num_cores_per_device, _failure, set_failed, check_failed",
  "what it reads of utils: get_uninitialized_value, get_uninitialized_array, "
  "device_coords_to_logical_id",
)

# The placeholder of an in-flight buffer: MAGIC, the block's nonce, device, buffer id.
_MAGIC = b"TCINFLT\x00"
_HEADER = struct.Struct("<8sIii")


class AsyncInterpretError(RuntimeError):
  """A split collective misbehaved in interpret mode."""


class NeverWaitedError(AsyncInterpretError):
  """A semaphore returned by a call still counts DMAs (or has some pending) at the end."""


class DeadlockError(AsyncInterpretError):
  """A semaphore wait blocked for longer than the block's ``deadlock_timeout_s``."""


class KernelFailure(AsyncInterpretError):
  """An interpreted kernel failed (a detected race, an out-of-bounds access, ...): the
  interpreter's original exception, whichever device's failure XLA reported."""


def check_jax_version(version: str | None = None) -> None:
  """Raises unless ``version`` (default: the installed jax) is the one this extension
  wraps: it patches interpreter internals that change between jax releases. Every
  ``async_interpret_mode`` block calls it first, so on another jax each test that runs
  split calls in interpret mode fails with this message, which says what to do."""
  version = jax.__version__ if version is None else version
  if version != SUPPORTED_JAX_VERSION:
    raise RuntimeError(
      f"torus_collectives.testing.split_interpret patches TPU interpret-mode internals of "
      f"jax {SUPPORTED_JAX_VERSION} only; this is jax {version}. Every test that enters "
      "async_interpret_mode (grep -l async_interpret_mode tests/) fails with this error; "
      "the other tests do not use the extension. To support this jax, re-check each "
      "patched internal against its source in this version: "
      + ", ".join(PATCHED_INTERNALS)
      + "; and what the extension relies on without patching: "
      + "; ".join(RELIED_ON)
      + ". Adapt the wrappers, run tests/test_async_interpret.py, then the other tests "
      "that enter async_interpret_mode, and set SUPPORTED_JAX_VERSION (in "
      "torus_collectives/testing/split_interpret.py) to this version."
    )


# ----------------------------------------------------------------- semaphore <-> int32


# XLA's CPU runtime (jax 0.12) runs every simulated device's independent operations at
# once on one Eigen pool, max(NPROC or the core count, device count) threads named
# "tf_XLAEigen". A thread that reaches an all-reduce or an interpreted kernel's barrier
# blocks until every device arrives there, and one device can block two threads at once
# (a kernel's callbacks beside a collective of its own). With one thread per device the
# pool can run out while another device's next operation waits in its queue: the step
# stalls, the devices split between a kernel call and a collective. Three threads per
# device leave every device one to progress on.
CPU_POOL_THREAD_NAME = "tf_XLAEigen"
CPU_POOL_THREADS_PER_DEVICE = 3


def cpu_pool_threads() -> int | None:
  """How many threads XLA's CPU pool has in this process (None where ``/proc`` cannot
  tell): the threads named ``CPU_POOL_THREAD_NAME``, which the CPU client starts when it
  is created."""
  jax.devices("cpu")  # creates the client, and its pool
  try:
    tasks = os.listdir("/proc/self/task")
  except OSError:
    return None
  count = 0
  for task in tasks:
    try:
      with open(f"/proc/self/task/{task}/comm") as comm:
        count += comm.read().strip() == CPU_POOL_THREAD_NAME
    except OSError:
      continue  # the thread ended
  return count


def cpu_pool_problem(threads: int | None, devices: int) -> str | None:
  """Why a CPU pool of ``threads`` cannot run ``devices`` simulated devices' split calls
  and collectives without stalling, or None."""
  needed = CPU_POOL_THREADS_PER_DEVICE * devices
  if threads is None or threads >= needed:
    return None
  return (
    f"XLA's CPU pool has {threads} threads for {devices} devices; interpret-mode kernels "
    f"beside collectives need {needed} ({CPU_POOL_THREADS_PER_DEVICE} a device) or the "
    f"step can stall. Set the environment variable NPROC={needed} (or more) before jax "
    "starts: XLA sizes the pool from it."
  )


def _conversion_primitives():
  """Two primitives that view a semaphore array as its physical int32 array and back;
  both lower to nothing (the physical types are the same)."""
  from jax.extend import core as jex_core
  from jax.interpreters import mlir

  to_i32 = jex_core.Primitive("async_interpret_semaphore_to_int32")
  to_i32.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, jnp.int32))
  from_i32 = jex_core.Primitive("async_interpret_int32_to_semaphore")
  from_i32.def_abstract_eval(lambda x, *, dtype: jax.core.ShapedArray(x.shape, dtype))
  for p in (to_i32, from_i32):
    mlir.register_lowering(p, lambda ctx, x, **_: [x])
  return to_i32, from_i32


_TO_I32 = _FROM_I32 = None


def _semaphore_to_i32(x):
  return _TO_I32.bind(x)


def _i32_to_semaphore(x, dtype):
  return _FROM_I32.bind(x, dtype=dtype)


# ----------------------------------------------------------------------------- session


@dataclasses.dataclass
class _Plan:
  """What one device's next interpreted call must allocate differently (set by the
  callback before the call, consumed by the wrapped allocators, read after it)."""

  name: str
  semaphores: list  # per leading scratch semaphore: ("bind", ids) or ("fresh", k)
  num_inputs: int  # the call's HBM input allocations, recorded in order
  input_ids: list = dataclasses.field(default_factory=list)
  bound: dict = dataclasses.field(default_factory=dict)  # input position -> placeholder
  fresh_ids: dict = dataclasses.field(default_factory=dict)  # k -> ids
  consumed: set = dataclasses.field(default_factory=set)  # the semaphore inputs' ids


@dataclasses.dataclass
class Session:
  """The state of one ``async_interpret_mode`` block."""

  params: object
  deadlock_timeout_s: float
  nonce: int
  plans: dict = dataclasses.field(default_factory=dict)  # device -> _Plan
  exported: dict = dataclasses.field(default_factory=dict)  # semaphore id -> call name
  dma_targets: dict = dataclasses.field(default_factory=dict)  # buffer id -> sems
  # device -> the semaphores its calls returned and no later call of it took (waited).
  live: dict = dataclasses.field(default_factory=dict)
  waits: dict = dataclasses.field(default_factory=dict)  # thread -> (sem, core, value, t0)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  deadlock: str | None = None
  calls: int = 0


_ACTIVE: Session | None = None


def _session() -> Session:
  if _ACTIVE is None:
    raise AsyncInterpretError("an executable lowered inside async_interpret_mode ran outside of it")
  return _ACTIVE


def _internals():
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  from jax._src.pallas.mosaic.interpret import shared_memory

  return ipc, shared_memory


# --------------------------------------------------------------------------- placeholders


def _placeholder(session: Session, device: int, buffer_id: int, shape, dtype) -> np.ndarray:
  from jax._src.pallas.mosaic.interpret import utils

  dtype = np.dtype(dtype)
  value = np.full(shape, utils.get_uninitialized_value(dtype, session.params.uninitialized_memory))
  value = np.ascontiguousarray(value.astype(dtype))
  raw = value.reshape(-1).view(np.uint8)
  if raw.size < _HEADER.size:
    raise NotImplementedError(
      f"an in-flight buffer of {raw.size} bytes: the placeholder needs {_HEADER.size}"
    )
  raw[: _HEADER.size] = np.frombuffer(
    _HEADER.pack(_MAGIC, session.nonce, device, buffer_id), np.uint8
  )
  return value


def _read_placeholder(session: Session, value) -> tuple[int, int] | None:
  """(device, buffer id) if ``value`` is a placeholder of this block, else None."""
  raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
  if raw.size < _HEADER.size:
    return None
  magic, nonce, device, buffer_id = _HEADER.unpack(raw[: _HEADER.size].tobytes())
  if magic != _MAGIC or nonce != session.nonce:
    return None
  return device, buffer_id


# --------------------------------------------------------------------- wrapped internals


def _wrapped_allocate_buffer(original):
  ipc, _ = _internals()

  @ipc.fail_on_exception
  def allocate(token, device_id, local_core_id, memory_space, val, *args, **kwargs):
    session = _session()
    device = int(device_id)
    space = ipc.TPU_MEMORY_SPACE_NAMES[int(memory_space)]
    plan = session.plans.get(device)
    recording = plan is not None and len(plan.input_ids) < plan.num_inputs
    if recording and space not in ("hbm", "any"):
      raise AsyncInterpretError(f"expected the inputs' HBM allocations first, got {space}")
    tagged = _read_placeholder(session, np.asarray(val)) if space in ("hbm", "any") else None
    if tagged is None:
      token, buffer_id = original(
        token, device_id, local_core_id, memory_space, val, *args, **kwargs
      )
    else:
      owner, buffer_id = tagged
      if owner != device:
        raise AsyncInterpretError(
          f"device {device} got the in-flight buffer {buffer_id} of device {owner}"
        )
      buffer = ipc._get_shared_memory().mem.get(("hbm", buffer_id, device, 0))
      if buffer is None or buffer.shape != np.shape(val) or buffer.dtype != np.asarray(val).dtype:
        raise AsyncInterpretError(
          f"device {device}: the placeholder of in-flight buffer {buffer_id} does not match "
          "a live buffer of its shape and dtype"
        )
      buffer_id = np.int16(buffer_id)
    if recording:
      if tagged is not None:
        plan.bound[len(plan.input_ids)] = tagged
      plan.input_ids.append(int(buffer_id))
    return token, buffer_id

  return allocate


def _wrapped_allocate_semaphores(original):
  ipc, _ = _internals()

  @ipc.fail_on_exception
  def allocate(token, device_id, local_core_id, shape):
    session = _session()
    plan = session.plans.get(int(device_id))
    if plan is None or not plan.semaphores:
      return original(token, device_id, local_core_id, shape)
    action, arg = plan.semaphores.pop(0)
    shape = tuple(int(s) for s in shape)
    if action == "fresh":
      token, ids = original(token, device_id, local_core_id, shape)
      plan.fresh_ids[arg] = np.asarray(ids)
      return token, ids
    ids = np.asarray(arg)
    if ids.shape != shape:
      raise AsyncInterpretError(f"semaphore input of shape {ids.shape} bound to {shape}")
    live = ipc._get_shared_memory()
    with live.lock:
      missing = [int(i) for i in ids.reshape(-1) if int(i) not in live.sem]
    if missing:
      raise AsyncInterpretError(
        f"{plan.name}: semaphore input names no live semaphore ({missing}); semaphore "
        "values are only meaningful as returned by a call inside the same block"
      )
    return token, ids.astype(np.int16)

  return allocate


def _wrapped_dma_start(original):
  def dma_start(token, device_id, *args, **kwargs):
    # (src core, src space, src id, src transforms, dst space, dst id, dst transforms,
    # dst sem, src sem, dst device, ...)
    # Keyed by the buffer id alone: ids are allocated in one order on every device, so a
    # buffer some device's DMAs land in stays in flight on every device (one whose window
    # of it is empty too), and the devices' ids stay in step.
    dst_id, dst_sem_id = args[5], args[7]
    session = _session()
    with session.lock:
      session.dma_targets.setdefault(int(dst_id), set()).add(int(dst_sem_id))
    return original(token, device_id, *args, **kwargs)

  return dma_start


def _wrapped_wait(original):
  def wait(sem, value, global_core_id, *args, **kwargs):
    session = _ACTIVE
    if session is None:
      return original(sem, value, global_core_id, *args, **kwargs)
    me = threading.get_ident()
    with session.lock:
      session.waits[me] = (sem, int(global_core_id), int(value), time.monotonic())
    try:
      return original(sem, value, global_core_id, *args, **kwargs)
    finally:
      with session.lock:
        session.waits.pop(me, None)

  return wait


class _BoundedBarrier:
  """Stands in for the interpreter's ``threading.Barrier`` objects inside a block: a wait
  ends when all devices arrive, when the computation has failed (the clean-up barrier
  returns, the global one raises ``BrokenBarrierError``: nobody waits on a failed call's
  barrier, so no device is left in it), or after ``deadlock_timeout_s`` with a
  ``DeadlockError`` that fails the computation."""

  def __init__(self, session, memory, parties, action, name, raise_on_failure):
    self.session, self.memory, self.parties = session, memory, parties
    self.action, self.name, self.raise_on_failure = action, name, raise_on_failure
    self.cv = threading.Condition()
    self.count = self.generation = 0
    self.broken = False

  @property
  def n_waiting(self):
    return self.count

  def _ended(self):
    if self.raise_on_failure:
      raise threading.BrokenBarrierError
    return 0

  def abort(self):
    with self.cv:
      self.broken = True
      self.cv.notify_all()

  def reset(self):
    with self.cv:
      self.broken, self.count = False, 0
      self.cv.notify_all()

  def wait(self, timeout=None):
    del timeout
    t0 = time.monotonic()
    with self.cv:
      if self.broken or self.memory._failure is not None:
        return self._ended()
      generation = self.generation
      self.count += 1
      if self.count == self.parties:
        self.count = 0
        self.generation += 1
        self.cv.notify_all()
        if self.action is not None:
          self.action()
        return 0
      while self.generation == generation:
        if self.broken or self.memory._failure is not None:
          self.count -= 1
          return self._ended()
        if time.monotonic() - t0 > self.session.deadlock_timeout_s:
          self.count -= 1
          break
        self.cv.wait(0.05)
      else:
        return 0
    message = (
      f"deadlock: a device has waited more than {self.session.deadlock_timeout_s:g} s on "
      f"the interpreter's {self.name} barrier ({self.count} of {self.parties} devices there)"
    )
    with self.session.lock:
      if self.session.deadlock is None:
        self.session.deadlock = message
    error = DeadlockError(message)
    self.memory.set_failed(error, top_level=False)
    raise error


def _wrapped_initialize_shared_memory(original):
  ipc, _ = _internals()

  def initialize(*args, **kwargs):
    token = original(*args, **kwargs)
    session = _session()
    memory = ipc._get_shared_memory()
    with ipc._shared_memory_init_lock:
      if not isinstance(memory.barrier, _BoundedBarrier):
        n = memory.num_devices
        memory.barrier = _BoundedBarrier(
          session, memory, n, ipc._update_clocks_for_global_barrier, "global", True
        )
        # Inside the block the shared memory outlives the call: no clean-up action.
        memory.clean_up_barrier = _BoundedBarrier(session, memory, n, None, "clean-up", False)
    return token

  return initialize


def _watchdog(session: Session, stop: threading.Event) -> None:
  """Fails the computation when a semaphore wait has blocked for too long."""
  ipc, _ = _internals()
  while not stop.wait(0.05):
    now = time.monotonic()
    with session.lock:
      stuck = [w for w in session.waits.values() if now - w[3] > session.deadlock_timeout_s]
    if not stuck or session.deadlock is not None:
      continue
    sem, core, value, _ = stuck[0]
    with sem.cv:
      count, pending = int(sem.count_by_core[core]), _outstanding(sem.tasks[core])
    memory = ipc._shared_memory
    per_device = memory.num_cores_per_device if memory is not None else 1
    session.deadlock = (
      f"deadlock: device {core // per_device} (core {core}) has waited more than "
      f"{session.deadlock_timeout_s:g} s on semaphore {sem.id} for {value} "
      f"(count {count}, {pending} DMAs pending on it); {len(stuck)} wait(s) stuck"
    )
    if memory is not None:
      memory.set_failed(DeadlockError(session.deadlock), top_level=False)


# ------------------------------------------------------------------ the call rewrite


def _is_semaphore(aval) -> bool:
  from jax._src.pallas import core as pallas_core

  return isinstance(getattr(aval, "dtype", None), pallas_core.AbstractSemaphoreTy)


def _device_id():
  """This device's logical id, as the interpreter computes it."""
  from jax import lax
  from jax._src import core as jax_core
  from jax._src.pallas.mosaic.interpret import utils

  axis_sizes = jax_core.get_axis_env().axis_sizes
  axis_indices = {k: lax.axis_index(k) for k in axis_sizes}
  return utils.device_coords_to_logical_id(tuple(axis_indices.values()), axis_sizes, axis_indices)


def _substitute(jaxpr, mapping):
  """``jaxpr`` with its top-level uses of the vars in ``mapping`` renamed."""
  if not mapping:
    return jaxpr
  from jax._src import core as jax_core

  sub = lambda v: v if isinstance(v, jax_core.Literal) else mapping.get(v, v)
  eqns = [e.replace(invars=[sub(v) for v in e.invars]) for e in jaxpr.eqns]
  return jaxpr.replace(eqns=eqns, outvars=[sub(v) for v in jaxpr.outvars])


class _SplitCall:
  """The rewrite of one call with semaphore inputs or outputs into one the stock
  interpreter runs, and the callbacks on each device before and after it."""

  def __init__(self, jaxpr, gm, input_output_aliases, label, uninitialized_memory):
    ipc, _ = _internals()
    n_idx, ni, no = gm.num_index_operands, gm.num_inputs, gm.num_outputs
    self.n_dyn, self.n_idx, self.num_outputs = gm.num_dynamic_grid_bounds, n_idx, no
    self.in_bms, self.out_bms = gm.block_mappings[:ni], gm.block_mappings[ni:]
    self.sem_in = [i for i in range(ni) if _is_semaphore(self.in_bms[i].array_aval)]
    self.sem_out = [j for j in range(no) if _is_semaphore(self.out_bms[j].array_aval)]
    aliases = {k - n_idx: v for k, v in input_output_aliases}  # input -> output
    if any(i in self.sem_in or j in self.sem_out for i, j in aliases.items()):
      raise NotImplementedError(f"{label}: aliased semaphores are not supported")
    of_output = {j: i for i, j in aliases.items()}
    plain_out = [j for j in range(no) if j not in self.sem_out]
    # A call with semaphores gets its buffers as inputs (the interpreter reads no input
    # back when the call ends): an aliased one is its input, a fresh one a new input of
    # uninitialized memory.
    self.returned = plain_out if self.sem_out or self.sem_in else []
    for j in self.returned:
      space = ipc._forward_any_to_hbm(self.out_bms[j].transformed_block_aval.memory_space)
      if space is not ipc._HBM:
        raise NotImplementedError(
          f"{label}: a call with semaphore operands must return its buffers in HBM "
          f"(pl.ANY), not {space}"
        )
    self.kept_in = [i for i in range(ni) if i not in self.sem_in]
    self.fresh = [j for j in self.returned if j not in of_output]
    self.kept_out = [] if self.returned else plain_out
    new_pos = {i: p for p, i in enumerate(self.kept_in)}
    # Where each returned buffer lives among the new inputs.
    self.buffer_pos = {
      j: new_pos[of_output[j]] if j in of_output else len(self.kept_in) + self.fresh.index(j)
      for j in self.returned
    }
    v = jaxpr.invars
    idx_vars, in_vars = v[:n_idx], v[n_idx : n_idx + ni]
    out_vars, scratch_vars = v[n_idx + ni : n_idx + ni + no], v[n_idx + ni + no :]
    mapping = {out_vars[j]: in_vars[of_output[j]] for j in self.returned if j in of_output}
    new_in_vars = [in_vars[i] for i in self.kept_in] + [out_vars[j] for j in self.fresh]
    self.num_inputs = len(new_in_vars)
    self.jaxpr = _substitute(jaxpr, mapping).replace(
      invars=[
        *idx_vars,
        *new_in_vars,
        *[out_vars[j] for j in self.kept_out],
        *[in_vars[i] for i in self.sem_in],
        *[out_vars[j] for j in self.sem_out],
        *scratch_vars,
      ]
    )
    self.grid_mapping = gm.replace(
      block_mappings=(
        *[self.in_bms[i] for i in self.kept_in],
        *[self.out_bms[j] for j in self.fresh],
        *[self.out_bms[j] for j in self.kept_out],
      ),
      num_inputs=self.num_inputs,
      num_outputs=len(self.kept_out),
      scratch_avals=(
        *[in_vars[i].aval for i in self.sem_in],
        *[out_vars[j].aval for j in self.sem_out],
        *gm.scratch_avals,
      ),
    )
    self.aliases = tuple(
      (n_idx + new_pos[i], self.kept_out.index(j)) for i, j in aliases.items() if j in self.kept_out
    )
    self.uninitialized_memory = uninitialized_memory
    self.name = label

  def args(self, args):
    """The rewritten call's operands: semaphores dropped, fresh buffers added."""
    from jax._src.pallas.mosaic.interpret import utils

    cut = self.n_dyn + self.n_idx
    inputs = args[cut:]
    fresh = [
      utils.get_uninitialized_array(
        self.out_bms[j].array_aval.shape,
        self.out_bms[j].array_aval.dtype,
        self.uninitialized_memory,
      )
      for j in self.fresh
    ]
    return [*args[:cut], *[inputs[i] for i in self.kept_in], *fresh]

  def before(self, device_id, *sem_ids):
    """On each device before the call: what the wrapped allocators must do."""
    ipc, _ = _internals()
    memory = ipc._shared_memory
    if memory is not None:
      memory.check_failed()  # a failed computation starts no more calls
    _session().plans[int(device_id)] = _Plan(
      name=self.name,
      semaphores=[("bind", np.array(ids)) for ids in sem_ids]
      + [("fresh", j) for j in self.sem_out],
      num_inputs=self.num_inputs,
      consumed={int(i) for ids in sem_ids for i in np.asarray(ids).reshape(-1)},
    )
    return np.int32(0)

  def after(self, device_id):
    """On each device after the call: the semaphore outputs' ids, the returned buffers
    (placeholders where a DMA counted on a live semaphore writes them: one a call of this
    device returned and no later call of it has taken)."""
    ipc, _ = _internals()
    s = _session()
    device = int(device_id)
    plan = s.plans.pop(device)
    if plan.semaphores or len(plan.input_ids) != plan.num_inputs:
      raise AsyncInterpretError(f"{self.name}: the interpreter allocated in an unexpected order")
    sems = [
      plan.fresh_ids[j].astype(np.int32).reshape(self.out_bms[j].array_aval.shape)
      for j in self.sem_out
    ]
    exported = {int(i) for ids in sems for i in ids.reshape(-1)}
    with s.lock:
      s.exported.update(dict.fromkeys(exported, self.name))
      live = s.live[device] = (s.live.get(device, set()) - plan.consumed) | exported
    buffers = []
    for j in self.returned:
      buffer_id = plan.input_ids[self.buffer_pos[j]]
      aval = self.out_bms[j].array_aval
      with s.lock:
        counted_on = s.dma_targets.get(buffer_id, set())
      if counted_on & live:
        buffers.append(_placeholder(s, device, buffer_id, aval.shape, aval.dtype))
      else:  # no DMA of this call lands in it: read it back as an output is read
        hbm = ipc.TPU_MEMORY_SPACE_IDXS[ipc._HBM]
        _, value = ipc.get(ipc.TOP_LEVEL_TOKEN_VALUE, device, 0, hbm, buffer_id, ())
        buffers.append(np.asarray(value).reshape(aval.shape).astype(aval.dtype))
    return (np.int32(0), *sems, *buffers)

  def result_avals(self):
    return [
      jax.ShapeDtypeStruct((), jnp.int32),
      *[jax.ShapeDtypeStruct(self.out_bms[j].array_aval.shape, jnp.int32) for j in self.sem_out],
      *[
        jax.ShapeDtypeStruct(self.out_bms[j].array_aval.shape, self.out_bms[j].array_aval.dtype)
        for j in self.returned
      ],
    ]

  def outputs(self, kept, returned):
    """The call's outputs in their original order."""
    sems = dict(zip(self.sem_out, returned[: len(self.sem_out)]))
    buffers = dict(zip(self.returned, returned[len(self.sem_out) :]))
    kept = dict(zip(self.kept_out, kept))
    outs = []
    for j in range(self.num_outputs):
      if j in sems:
        outs.append(_i32_to_semaphore(sems[j], self.out_bms[j].array_aval.dtype))
      else:
        outs.append(buffers[j] if j in buffers else kept[j])
    return outs


def _interpret_split_call(original, *args, jaxpr, grid_mapping, **params):
  """``interpret_pallas_call`` for a call with semaphore inputs or outputs (see the module
  docstring); any other call goes to the stock interpreter unchanged."""
  ipc, _ = _internals()
  from jax._src import callback

  session = _session()
  interpret_params = params["interpret_params"]
  if interpret_params != session.params:
    raise AsyncInterpretError(
      f"a kernel in async_interpret_mode runs with other interpret params: {interpret_params}"
    )
  bms = grid_mapping.block_mappings
  if not any(_is_semaphore(bm.array_aval) for bm in bms):
    return original(*args, jaxpr=jaxpr, grid_mapping=grid_mapping, **params)
  session.calls += 1
  label = f"{params.get('name') or 'pallas_call'}#{session.calls}"
  split = _SplitCall(
    jaxpr,
    grid_mapping,
    params["input_output_aliases"],
    label,
    interpret_params.uninitialized_memory,
  )
  device_id = _device_id()
  inputs = args[split.n_dyn + split.n_idx :]
  token = jnp.int32(ipc.TOP_LEVEL_TOKEN_VALUE)
  # ``before`` may run before the block's first call has built the shared memory, so it
  # is not wrapped in the interpreter's failure handling; ``after`` is.
  callback.io_callback(
    functools.partial(_with_token, split.before),
    (ipc.TOKEN_SHAPE_DTYPE, jax.ShapeDtypeStruct((), jnp.int32)),
    token,
    device_id,
    *[_semaphore_to_i32(inputs[i]) for i in split.sem_in],
    ordered=True,
  )
  kept = original(
    *split.args(args),
    jaxpr=split.jaxpr,
    grid_mapping=split.grid_mapping,
    **{**params, "input_output_aliases": split.aliases},
  )
  _, _, *returned = callback.io_callback(
    ipc.fail_on_exception(functools.partial(_with_token, split.after)),
    (ipc.TOKEN_SHAPE_DTYPE, *split.result_avals()),
    token,
    device_id,
    ordered=True,
  )
  return split.outputs(kept, returned)


def _with_token(fn, token, *args):
  """``fn(*args)``, its results after ``token`` (the interpreter's callback convention)."""
  out = fn(*args)
  return (token, *out) if isinstance(out, tuple) else (token, out)


# -------------------------------------------------------------------------- the block


def _outstanding(tasks) -> int:
  """How many of a semaphore's queued tasks still have work to do. A DMA queues a read
  task on its send semaphore and a read-and-write task on its receive semaphore; the one
  that runs first may do the other's part, leaving the other queued with nothing to do."""
  ipc, _ = _internals()
  left = 0
  for task in tasks:
    dma = getattr(task, "__self__", None)
    if not isinstance(dma, ipc.DMA):
      left += 1
    elif task.__func__ is ipc.DMA.execute_read:
      left += dma.state == ipc.DmaState.STARTED
    else:
      left += dma.state != ipc.DmaState.COMPLETED
  return left


def _check_end(session: Session) -> None:
  ipc, _ = _internals()
  races = ipc.races
  if races is not None and races.races_found:
    raise AsyncInterpretError("the interpreter detected a data race")
  memory = ipc._shared_memory
  if memory is None:
    return
  problems = []
  for sem_id, call_name in sorted(session.exported.items()):
    sem = memory.sem.get(sem_id)
    if sem is None:
      continue
    with sem.cv:
      counts = {c: int(n) for c, n in enumerate(sem.count_by_core) if n}
      pending = {c: n for c, t in enumerate(sem.tasks) if (n := _outstanding(t))}
    if counts or pending:
      problems.append(
        f"semaphore {sem_id} returned by {call_name}: counts by core {counts}, "
        f"DMAs pending by core {pending}"
      )
  if problems:
    raise NeverWaitedError(
      "DMAs counted on semaphores that no call waited for:\n  " + "\n  ".join(problems)
    )


def _wait_for_interpreter_threads(session: Session) -> None:
  """After a failure, waits (at most the deadlock timeout, plus a margin) until no other
  thread runs interpreter code, so that no straggler of the failed computation touches the
  next block's shared memory."""
  import sys

  me = threading.get_ident()
  deadline = time.monotonic() + session.deadlock_timeout_s + 5.0
  marks = ("pallas/mosaic/interpret", __file__)
  while time.monotonic() < deadline:
    busy = False
    for ident, frame in sys._current_frames().items():
      if ident == me:
        continue
      f = frame
      while f is not None and not busy:
        name = f.f_code.co_filename.replace("\\", "/")
        busy = any(m in name for m in marks) and f.f_code.co_name != "_watchdog"
        f = f.f_back
      if busy:
        break
    if not busy:
      return
    time.sleep(0.05)


@contextlib.contextmanager
def async_interpret_mode(
  dma_execution_mode: str = "on_wait",
  *,
  detect_races: bool = True,
  uninitialized_memory: str = "nan",
  deadlock_timeout_s: float = 60.0,
):
  """Pallas TPU kernels traced in the block run in TPU interpret mode with one shared
  memory for the whole block, so semaphores and buffers returned by one call can be
  waited on in a later one (see the module docstring). Run everything to completion
  inside the block (``jax.block_until_ready``): the checks on leaving it see only what
  has run. Yields the ``Session``."""
  global _ACTIVE, _TO_I32, _FROM_I32
  check_jax_version()
  from jax.experimental.pallas import tpu as pltpu

  if _ACTIVE is not None:
    raise AsyncInterpretError("async_interpret_mode blocks do not nest")
  if _TO_I32 is None:
    _TO_I32, _FROM_I32 = _conversion_primitives()
  if jax.default_backend() == "cpu":
    problem = cpu_pool_problem(cpu_pool_threads(), jax.device_count())
    if problem:
      raise AsyncInterpretError(problem)
  ipc, shared_memory = _internals()
  params = pltpu.InterpretParams(
    dma_execution_mode=dma_execution_mode,
    detect_races=detect_races,
    uninitialized_memory=uninitialized_memory,
  )
  nonce = zlib.crc32(f"{time.time_ns()}-{id(params)}".encode()) or 1
  session = Session(params=params, deadlock_timeout_s=deadlock_timeout_s, nonce=nonce)
  originals = {name: getattr(ipc, name) for name in PATCHED_FUNCTIONS}
  original_wait = shared_memory.Semaphore.wait
  replacements = {
    "_clear_shared_memory": lambda: None,
    "interpret_pallas_call": functools.partial(
      _interpret_split_call, originals["interpret_pallas_call"]
    ),
    "_allocate_buffer": _wrapped_allocate_buffer(originals["_allocate_buffer"]),
    "_allocate_semaphores": _wrapped_allocate_semaphores(originals["_allocate_semaphores"]),
    "dma_start": _wrapped_dma_start(originals["dma_start"]),
    "_initialize_shared_memory": _wrapped_initialize_shared_memory(
      originals["_initialize_shared_memory"]
    ),
  }
  stop = threading.Event()
  watchdog = threading.Thread(target=_watchdog, args=(session, stop), daemon=True)
  pltpu.reset_tpu_interpret_mode_state()
  jax.clear_caches()
  _ACTIVE = session
  for attr, value in replacements.items():
    setattr(ipc, attr, value)
  shared_memory.Semaphore.wait = _wrapped_wait(original_wait)
  watchdog.start()
  try:
    with (
      pltpu.force_tpu_interpret_mode(params),
      jax_internals.interpreter_callbacks_on_host_arrays(),
    ):
      try:
        yield session
        jax.effects_barrier()  # everything dispatched has run (or raises its failure)
      except Exception as error:
        # A failed computation leaves its failure in jax's ordered-effects tokens, where
        # the next effectful computation (the next test's) would raise it again.
        with contextlib.suppress(Exception):
          jax.effects_barrier()
        _wait_for_interpreter_threads(session)
        # XLA reports whichever device's callback failed first, often one that only saw
        # another's failure (a broken barrier); the interpreter keeps the original.
        memory = ipc._shared_memory
        original = getattr(memory, "_failure", None)
        if isinstance(original, DeadlockError) or (original is None and session.deadlock):
          raise DeadlockError(session.deadlock or str(original)) from error
        if original is not None and original is not error:
          raise KernelFailure(f"{type(original).__name__}: {original}") from error
        raise
    _check_end(session)
  finally:
    stop.set()
    watchdog.join()
    shared_memory.Semaphore.wait = original_wait
    for attr, value in originals.items():
      setattr(ipc, attr, value)
    _ACTIVE = None
    pltpu.reset_tpu_interpret_mode_state()
    jax.clear_caches()
