"""The split-call extension of TPU interpret mode (``split_interpret``) on 8 simulated CPU
devices: a remote DMA started by one ``pallas_call``, XLA compute in between, and waited by
a later call, exact against ``lax.ppermute``; and the mistakes it must report instead of
returning wrong data or hanging (a missing wait, a wait on the wrong semaphore, a read of
the in-flight buffer before the wait, XLA compute on it), in both DMA execution modes with
the race detector on.
"""

import os
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives.testing import split_interpret
from torus_collectives.testing.split_interpret import (
  CPU_POOL_THREADS_PER_DEVICE,
  SUPPORTED_JAX_VERSION,
  AsyncInterpretError,
  DeadlockError,
  KernelFailure,
  NeverWaitedError,
  async_interpret_mode,
  check_jax_version,
  cpu_pool_problem,
  cpu_pool_threads,
)

# A hang must fail the test, not the run: the extension's own deadlock check fires first.
pytestmark = [pytest.mark.interpret, pytest.mark.timeout(300, method="thread")]

AXIS = "x"
DEVICES = 8
SHAPE = (8, 128)  # one native int32 tile per device
ANY = pl.BlockSpec(memory_space=pl.ANY)
SEM = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
DMA_SEM = pltpu.SemaphoreType.DMA(())


def _right_neighbour():
  return (lax.rem(lax.axis_index(AXIS) + 1, DEVICES),)


def _start_kernel(x_ref, send, recv, *outs):
  """Sends ``x`` to the right neighbour's ``out`` (the last output); returns at once."""
  pltpu.make_async_remote_copy(x_ref, outs[-1], send, recv, device_id=_right_neighbour()).start()


def start(x, *, keep_source=False):
  """``(send, recv, out)``, or ``(send, recv, x, out)`` with ``keep_source``: ``x``
  aliased through, as jax's async note keeps a DMA's source alive until the done call."""
  buffers = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * (2 if keep_source else 1)
  return pl.pallas_call(
    _start_kernel,
    out_shape=(DMA_SEM, DMA_SEM, *buffers),
    in_specs=[ANY],
    out_specs=(SEM, SEM, *(ANY,) * len(buffers)),
    input_output_aliases={0: 2} if keep_source else {},
    name="ppermute_start",
  )(x)


def _done_kernel(out_ref, send, recv, _):
  pltpu.make_async_copy(out_ref, out_ref, send).wait()
  pltpu.make_async_copy(out_ref, out_ref, recv).wait()


def done(out, send, recv, kernel=_done_kernel, extra_outputs=0):
  """Waits for ``start``'s DMA; ``out`` aliased through (the in-flight buffer)."""
  shape = jax.ShapeDtypeStruct(out.shape, out.dtype)
  result = pl.pallas_call(
    kernel,
    out_shape=(shape,) * (1 + extra_outputs),
    in_specs=[ANY, SEM, SEM],
    out_specs=(ANY,) * (1 + extra_outputs),
    input_output_aliases={0: 0},
    name="ppermute_done",
  )(out, send, recv)
  return result if extra_outputs else result[0]


def _run(body, x, mode, **kwargs):
  """``body`` on each device's row of ``x``, in ``async_interpret_mode(mode)``."""
  mesh = harness.mesh((DEVICES,), (AXIS,))
  with async_interpret_mode(mode, **kwargs):
    return jax.block_until_ready(harness.per_device(body, mesh, x, check_vma=False))


def _inputs(seed=0):
  return harness.small_integers((DEVICES, *SHAPE), np.int32, seed)


def _ppermuted(x, shift=1):
  return np.roll(np.asarray(x), shift, axis=0)


@pytest.mark.parametrize("keep_source", [False, True], ids=["fresh", "source_aliased"])
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_split_ppermute_matches_lax(mode, keep_source):
  """start, then compute that XLA may overlap, then done: the received rows are
  ``lax.ppermute``'s, and the compute in between is untouched by the DMA."""
  perm = [(i, (i + 1) % DEVICES) for i in range(DEVICES)]

  def body(v):
    send, recv, *buffers = start(v, keep_source=keep_source)
    source = buffers[0] if keep_source else v  # the aliased source reads back unchanged
    between = source * 3 + 1
    received = done(buffers[-1], send, recv)
    return received, between, lax.ppermute(v, AXIS, perm)

  x = _inputs()
  received, between, expected = _run(body, x, mode)
  np.testing.assert_array_equal(received, expected)
  np.testing.assert_array_equal(received, _ppermuted(x))
  np.testing.assert_array_equal(between, np.asarray(x) * 3 + 1)


def _step_kernel(in_ref, send_in, recv_in, send, recv, out_ref):
  """Waits for the previous hop into ``in_ref``, then forwards it to the right."""
  pltpu.make_async_copy(in_ref, in_ref, send_in).wait()
  pltpu.make_async_copy(in_ref, in_ref, recv_in).wait()
  pltpu.make_async_remote_copy(in_ref, out_ref, send, recv, device_id=_right_neighbour()).start()


def step(buffer, send, recv):
  """One more hop: ``(send, recv, buffer)`` of the next hop, the previous buffer aliased
  (its DMA source until the next done call)."""
  shape = jax.ShapeDtypeStruct(buffer.shape, buffer.dtype)
  return pl.pallas_call(
    _step_kernel,
    out_shape=(DMA_SEM, DMA_SEM, shape),
    in_specs=[ANY, SEM, SEM],
    out_specs=(SEM, SEM, ANY),
    name="ppermute_step",
  )(buffer, send, recv)


@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_chained_hops_match_lax(mode):
  """start, step, done: semaphores returned by one call are waited in the next, which
  returns fresh ones; two hops move every row two devices to the right."""

  def body(v):
    send, recv, first = start(v)
    between = jnp.sum(v) + 1
    send, recv, second = step(first, send, recv)
    return done(second, send, recv), between

  x = _inputs(1)
  received, between = _run(body, x, mode)
  np.testing.assert_array_equal(received, _ppermuted(x, 2))
  np.testing.assert_array_equal(between, np.asarray(x).sum(axis=(1, 2)) + 1)


def _waits_send_only(out_ref, send, recv, _):
  del recv
  pltpu.make_async_copy(out_ref, out_ref, send).wait()


def _waits_send_twice(out_ref, send, recv, _):
  del recv
  pltpu.make_async_copy(out_ref, out_ref, send).wait()
  pltpu.make_async_copy(out_ref, out_ref, send).wait()  # the receive's wait, wrong semaphore


def test_missing_wait_is_reported_on_exit():
  """A done call that never waits for the receive: the DMA is still pending on its
  semaphore when the block ends (on_wait: it never ran)."""

  def body(v):
    send, recv, out = start(v)
    return done(out, send, recv, kernel=_waits_send_only)

  with pytest.raises(NeverWaitedError, match="ppermute_start"):
    _run(body, _inputs(), "on_wait")


def test_missing_wait_reads_race_with_landed_dma():
  """Eagerly the DMA has landed when the done call reads the buffer back without waiting:
  the race detector reports the read."""

  def body(v):
    send, recv, out = start(v)
    return done(out, send, recv, kernel=_waits_send_only)

  with pytest.raises(KernelFailure, match="RACE DETECTED"):
    _run(body, _inputs(), "eager")


@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_wait_on_wrong_semaphore_is_a_deadlock_error(mode):
  """Waiting on the send semaphore twice instead of send and receive would block forever:
  the block fails with a DeadlockError naming the semaphore instead."""

  def body(v):
    send, recv, out = start(v)
    return done(out, send, recv, kernel=_waits_send_twice)

  with pytest.raises(DeadlockError, match="semaphore"):
    _run(body, _inputs(), mode, deadlock_timeout_s=3.0)


def _reads_before_waiting(out_ref, send, recv, out, copy_ref):
  del out
  local = pltpu.make_async_copy(out_ref, copy_ref, send)  # reads the in-flight buffer
  local.start()
  local.wait()
  pltpu.make_async_copy(out_ref, out_ref, send).wait()
  pltpu.make_async_copy(out_ref, out_ref, recv).wait()


@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_read_of_in_flight_buffer_before_wait_is_a_race(mode):
  """A done kernel that copies the buffer before waiting for the receive races with the
  remote DMA writing it (whichever of the two the interpreter runs first)."""

  def body(v):
    send, recv, out = start(v)
    return done(out, send, recv, kernel=_reads_before_waiting, extra_outputs=1)

  with pytest.raises(KernelFailure, match="RACE DETECTED"):
    _run(body, _inputs(), mode)


def _device_0_reads_before_waiting(out_ref, send, recv, out, copy_ref):
  """Only device 0 copies the in-flight buffer before waiting; the others wait first."""
  del out

  @pl.when(lax.axis_index(AXIS) == 0)
  def _():
    local = pltpu.make_async_copy(out_ref, copy_ref, send)
    local.start()
    local.wait()

  pltpu.make_async_copy(out_ref, out_ref, send).wait()
  pltpu.make_async_copy(out_ref, out_ref, recv).wait()


@pytest.mark.timeout(120, method="thread")
def test_failed_blocks_leave_the_interpreter_clean(monkeypatch):
  """A race that device 0 reports late, once the other devices have finished the call and
  wait in the interpreter's end-of-call barrier (the race report is delayed here): the
  block raises the race, twice in a row, and leaves no thread behind in a barrier; a
  correct block after them passes."""
  from jax._src.pallas.mosaic.interpret import race_detection_state

  check_read = race_detection_state.RaceDetectionState.check_read

  def late_check_read(self, *args, **kwargs):
    try:
      return check_read(self, *args, **kwargs)
    except Exception:
      time.sleep(1.0)  # the other devices reach the end-of-call barrier meanwhile
      raise

  monkeypatch.setattr(race_detection_state.RaceDetectionState, "check_read", late_check_read)

  def racy(v):
    send, recv, out = start(v)
    return done(out, send, recv, kernel=_device_0_reads_before_waiting, extra_outputs=1)

  for _ in range(2):
    with pytest.raises(KernelFailure, match="RACE DETECTED"):
      _run(racy, _inputs(), "eager", deadlock_timeout_s=10.0)
  monkeypatch.undo()

  def body(v):
    send, recv, out = start(v)
    return done(out, send, recv)

  x = _inputs(2)
  np.testing.assert_array_equal(_run(body, x, "eager"), _ppermuted(x))


def test_compute_on_in_flight_buffer_sees_a_placeholder():
  """XLA between start and done sees no data in the in-flight buffer (on a TPU it would
  read a buffer being written): uninitialized memory behind a header, never the values."""

  def body(v):
    send, recv, out = start(v)
    peeked = out + 0
    return done(out, send, recv), peeked

  x = _inputs()
  received, peeked = _run(body, x, "eager")
  np.testing.assert_array_equal(received, _ppermuted(x))
  flat = np.asarray(peeked).reshape(DEVICES, -1)
  assert (flat[:, 5:] == np.iinfo(np.int32).max).all()  # past the 20-byte header
  assert not (flat == _ppermuted(x).reshape(DEVICES, -1)).all(axis=1).any()


def test_version_pin():
  check_jax_version()  # the installed jax is the pinned one
  assert jax.__version__ == SUPPORTED_JAX_VERSION
  with pytest.raises(RuntimeError, match=SUPPORTED_JAX_VERSION.replace(".", r"\.")):
    check_jax_version("0.12.1")


def test_block_refuses_other_jax(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.13.0")
  with pytest.raises(RuntimeError, match="jax 0.13.0"):
    with async_interpret_mode("on_wait"):
      pass


def test_cpu_pool_is_counted_and_large_enough_here():
  """The suite's NPROC sizes XLA's CPU pool (tests/conftest.py), and the count reads it."""
  assert cpu_pool_threads() == max(int(os.environ["NPROC"]), jax.device_count())
  assert cpu_pool_problem(cpu_pool_threads(), jax.device_count()) is None


def test_cpu_pool_problem_names_the_fix():
  needed = CPU_POOL_THREADS_PER_DEVICE * 8
  assert cpu_pool_problem(needed, 8) is None
  assert cpu_pool_problem(None, 8) is None  # nothing to count with: no claim
  problem = cpu_pool_problem(8, 8)
  assert f"NPROC={needed}" in problem and "8 threads for 8 devices" in problem


def test_block_refuses_a_small_cpu_pool(monkeypatch):
  monkeypatch.setattr(split_interpret, "cpu_pool_threads", lambda: 8)
  with pytest.raises(AsyncInterpretError, match="Set the environment variable NPROC"):
    with async_interpret_mode("on_wait"):
      pass
