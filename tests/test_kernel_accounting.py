"""What the kernels move and signal, counted in TPU interpret mode, against what they declare.

Each kernel's ``pl.CostEstimate`` is what XLA's cost analysis reports for it (XLA cannot
see inside a Mosaic kernel), so a declaration priced with the formula a test compares it
with proves nothing. Here ``interpret_accounting`` counts the bytes each kernel's DMAs and
``BlockSpec`` pipeline actually move, per device, while it runs in TPU interpret mode, and
the tests assert:

* counted HBM bytes accessed (and, for the torus kernels, remote bytes) equal the declared
  ``bytes_accessed`` (``remote_bytes_transferred``). The torus kernels declare the mean
  over the devices, rounded up (which device moves the buffer's partial last chunk changes
  with the step, so devices differ); the batch-norm kernels declare their own device's
  bytes, in whole (8, 128) tiles of the arrays' last two dimensions;
* the wire bytes per device, averaged over the devices, equal the bound: 2(p-1)/p S for
  the all-reduce, (p-1)/p S for a reduce-scatter or all-gather of S bytes (S the buffer
  the kernels move: a chunk off the 512-byte DMA words is padded to whole words first),
  and the all-reduce's HBM bytes the ideal 7(p-1)/p S (each element a device sends is read
  once and written once where it lands, and every hop's sum reads two terms and writes
  one);
* every semaphore's signals and waits balance on every device, every DMA started
  completes, and each device's entry barrier is waited on once, for exactly the number of
  signals its neighbours address to it. Interpret mode does not model barrier timing, so
  a barrier that waits for too few signals passes every value check; only the counts
  show it (``test_barrier_that_waits_for_one_signal_is_caught``).

Sizes are ragged (no whole number of words, chunks or blocks), so the branches for the
buffer's partial last chunk and its tail, and the batch-norm kernels' ragged last row
block, run; the all-reduce sizes are large enough to run every stream of the split
schedule (4 on 2x4, 6 on 2x2x2).
"""

import math
from fractions import Fraction

import harness
import interpret_accounting
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from torus_collectives.kernels import batch_norm as kbn
from torus_collectives.kernels import buffer_layout, remote_dma, torus_kernels
from torus_collectives.kernels import pallas_backend as kernels
from torus_collectives.norm.block_sizes import BlockSizes

pytestmark = pytest.mark.interpret


def declared(fn, *args) -> list[tuple[str, pl.CostEstimate]]:
  """(name, cost estimate) of every pallas_call ``fn`` traces, in program order."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [(e.params["name"], e.params["cost_estimate"]) for e in harness.pallas_calls(jaxpr)]


def counted(mode: str, fn, *args):
  """(declared costs, accounting, result) of ``fn(*args)`` traced and run in TPU interpret
  mode under ``interpret_accounting.counting()``, checked for races."""
  with interpret_accounting.counting() as accounting, harness.interpret_mode(mode):
    costs = declared(fn, *args)
    out = jax.block_until_ready(fn(*args))
  assert len(accounting.calls) == len(costs), (len(accounting.calls), costs)
  return costs, accounting, out


def check_barrier(call, devices: int, links: int) -> None:
  """Each device's barrier: one signal from each of its ``links`` neighbours, and one wait,
  for exactly the signals addressed to it."""
  for device in range(devices):
    signals, waits = call.barrier(device)
    assert signals == [1] * links, f"device {device}: signals {signals} over {links} links"
    assert waits == [len(signals)], f"device {device}: waits {waits} for {len(signals)} signals"


def _record_schedules(monkeypatch) -> list:
  """The schedule of every torus kernel traced from now on, in order."""
  schedules = []
  for name in ("reduce_scatter_call", "all_gather_call"):
    original = getattr(torus_kernels, name)

    def recording(x, schedule, *args, original=original, **kwargs):
      schedules.append(schedule)
      return original(x, schedule, *args, **kwargs)

    monkeypatch.setattr(torus_kernels, name, recording)
  return schedules


def _per_device(fn, mesh, names):
  return jax.jit(
    jax.shard_map(
      lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(names), out_specs=P(names), check_vma=False
    )
  )


LAX = {
  "all_reduce": lambda axes: lambda v: lax.psum(v, axes),
  "reduce_scatter": lambda axes: lambda v: lax.psum_scatter(v, axes, tiled=True),
  "all_gather": lambda axes: lambda v: lax.all_gather(v, axes, tiled=True),
}
# Of the S bytes of the buffer the kernels move, each device sends this share on average.
WIRE_SHARE = {
  "all_reduce": lambda p: Fraction(2 * (p - 1), p),
  "reduce_scatter": lambda p: Fraction(p - 1, p),
  "all_gather": lambda p: Fraction(p - 1, p),
}

# (collective, mesh, elements per device of the input, DMA mode). All-reduce sizes run all
# streams of the split schedule (4 on 2x4, 6 on 2x2x2) with a partial last chunk and a
# tail shorter than a word; the reduce-scatter and all-gather chunks (4133, 301 elements)
# are off the words, so the kernels move padded chunks.
TORUS_CASES = [
  ("all_reduce", (2, 4), 33_001, "eager"),
  ("all_reduce", (2, 4), 33_001, "on_wait"),
  ("reduce_scatter", (2, 4), 8 * 4_133, "on_wait"),
  ("all_gather", (2, 4), 4_133, "eager"),
  ("all_reduce", (2, 2, 2), 50_003, "on_wait"),
  ("reduce_scatter", (2, 2, 2), 8 * 301, "eager"),
  ("all_gather", (2, 2, 2), 301, "on_wait"),
]


def _kernel_buffer_bytes(collective: str, n: int, p: int) -> int:
  """S: the bytes of the (float32) buffer the kernels move for an input of ``n`` elements."""
  if collective == "all_reduce":
    return 4 * n
  m = n // p if collective == "reduce_scatter" else n
  word = buffer_layout.dma_alignment(4)
  return 4 * p * (-(-m // word) * word)


@pytest.mark.parametrize(
  "collective,shape,n,mode",
  TORUS_CASES,
  ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}-{c[3]}" for c in TORUS_CASES],
)
def test_torus_kernels_move_what_they_declare(monkeypatch, collective, shape, n, mode):
  mesh = harness.mesh(shape)
  names = mesh.axis_names
  p = mesh.size
  x = jnp.asarray(np.random.default_rng(n).integers(-8, 8, size=(p, n)), jnp.float32)
  ours = getattr(kernels, collective)
  schedules = _record_schedules(monkeypatch)
  costs, accounting, got = counted(
    mode, _per_device(lambda v: ours(v, names, shape), mesh, names), x
  )
  assert len(schedules) == len(costs)
  if collective == "all_reduce":  # every stream: both directions of every axis
    assert [len(remote_dma.links(s)) for s in schedules] == [2 * len(shape)] * 2
  want = _per_device(LAX[collective](names), mesh, names)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert [name.split("_x")[0] for name, _ in costs] == {
    "all_reduce": ["torus_reduce_scatter", "torus_all_gather"],
    "reduce_scatter": ["torus_reduce_scatter"],
    "all_gather": ["torus_all_gather"],
  }[collective]
  wire = accessed = 0
  for (name, cost), call, schedule in zip(costs, accounting.calls, schedules, strict=True):
    call.check()
    check_barrier(call, p, len(remote_dma.links(schedule)))
    assert call.total("pipeline_in") == call.total("pipeline_out") == call.total("body_hbm") == 0
    assert call.total("dma_count") > 0
    mean_bytes = Fraction(call.total("bytes_accessed"), p)
    mean_remote = Fraction(call.total("remote"), p)
    assert (math.ceil(mean_bytes), math.ceil(mean_remote)) == (
      cost.bytes_accessed,
      cost.remote_bytes_transferred,
    ), f"{name}: counted mean {float(mean_bytes)}, {float(mean_remote)}; declared {cost}"
    wire += call.total("remote")
    accessed += call.total("bytes_accessed")
  size = _kernel_buffer_bytes(collective, n, p)
  assert Fraction(wire, p) == WIRE_SHARE[collective](p) * size
  if collective == "all_reduce":  # the ideal HBM traffic of a ring reduce-scatter + gather
    assert Fraction(accessed, p) == Fraction(7 * (p - 1), p) * size


def test_barrier_that_waits_for_one_signal_is_caught(monkeypatch):
  """The planted bug of the issue: an entry barrier that signals every upstream neighbour
  but waits for one signal, not one per link. The kernels still compute the right sums in
  interpret mode; the accounting must reject it. Run with ``on_wait`` DMAs, which land
  only when the receiver waits for them, inside its kernel: run eagerly, a DMA may now
  reach a device that has not yet entered the kernel, which the interpreter reports (a
  missing buffer) only at random, and only when the process ends."""

  def barrier(self, schedule):
    sem = pltpu.get_barrier_semaphore()
    for axis, direction in remote_dma.links(schedule):
      pl.semaphore_signal(sem, 1, device_id=self.neighbour(axis, -direction))
    pl.semaphore_wait(sem, 1)

  monkeypatch.setattr(remote_dma.Topology, "barrier", barrier)
  schedules = _record_schedules(monkeypatch)
  mesh = harness.mesh((2, 4))
  names = mesh.axis_names
  x = jnp.asarray(np.random.default_rng(1).integers(-8, 8, size=(8, 3_001)), jnp.float32)
  _, accounting, got = counted(
    "on_wait", _per_device(lambda v: kernels.all_reduce(v, names, (2, 4)), mesh, names), x
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.sum(x, 0, keepdims=True) + 0 * x))
  for call, schedule in zip(accounting.calls, schedules, strict=True):
    links = len(remote_dma.links(schedule))
    with pytest.raises(AssertionError, match="semaphores left signalled"):
      call.check()
    with pytest.raises(AssertionError, match=f"waits \\[1\\] for {links} signals"):
      check_barrier(call, 8, links)


# Batch norm, NHWC with N = 8, on views [H*W, N, C] with a ragged last row block: [25, 8,
# 256] in blocks of 8 rows (the last holds 1) and two channel blocks of 128, so the
# elementwise passes re-read their coefficients; [9, 8, 128] in blocks of 4 rows (the
# last holds 1) and one channel block, so they read them once.
BN_CASES = [
  ((2, 4), (8, 5, 5, 256), BlockSizes(block_rows=8, block_channels=128)),
  ((2, 2, 2), (8, 3, 3, 128), BlockSizes(block_rows=4, block_channels=128)),
]


def _bn_passes(bs: BlockSizes):
  return {
    "stats": lambda x, dy, c: kbn.stats(x, block_sizes=bs),
    "normalize": lambda x, dy, c: kbn.normalize(x, c[:3], relu=True, block_sizes=bs),
    "backward_sums": lambda x, dy, c: kbn.backward_sums(x, dy, c[:3], relu=True, block_sizes=bs),
    "backward_dx": lambda x, dy, c: kbn.backward_dx(x, dy, c, relu=True, block_sizes=bs),
    "local_forward": lambda x, dy, c: kbn.local_forward(
      x, c[0], c[1], epsilon=1e-5, relu=True, block_sizes=bs
    ),
    "local_backward": lambda x, dy, c: kbn.local_backward(x, dy, c, relu=True, block_sizes=bs),
  }


def _bn_operands(shape, devices: int):
  kx, kd = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (devices, *shape), jnp.float32)
  dy = jax.random.normal(kd, (devices, *shape), jnp.float32)
  c = jnp.stack([jnp.zeros(shape[-1]), jnp.ones(shape[-1]), jnp.zeros(shape[-1])] * 2)[:5]
  return x, dy, jnp.broadcast_to(c, (devices, *c.shape))


@pytest.mark.parametrize(
  "mesh_shape,shape,block_sizes", BN_CASES, ids=["2x4-two-channel-blocks", "2x2x2-one"]
)
def test_batch_norm_kernels_move_what_they_declare(mesh_shape, shape, block_sizes):
  """Every pass on every device of the mesh (each replica runs its own kernels), in whole
  (8, 128) tiles as declared. The kernels start no DMA of their own (the pipeline moves
  their blocks), so one DMA execution mode suffices."""
  mesh = harness.mesh(mesh_shape)
  names = mesh.axis_names
  x, dy, coef = _bn_operands(shape, mesh.size)
  for name, fn in _bn_passes(block_sizes).items():
    sharded = jax.jit(
      jax.shard_map(
        lambda x, dy, c, fn=fn: jax.tree.map(lambda a: a[None], fn(x[0], dy[0], c[0])),
        mesh=mesh,
        in_specs=P(names),
        out_specs=P(names),
        check_vma=False,
      )
    )
    costs, accounting, _ = counted("eager", sharded, x, dy, coef)
    ((_, cost),) = costs
    (call,) = accounting.calls
    call.check()
    assert call.total("dma_count") == call.total("body_hbm") == 0
    per_device = {d: t.bytes_accessed_tiled for d, t in call.traffic.items()}
    assert per_device == dict.fromkeys(range(mesh.size), cost.bytes_accessed), name


def test_dma_semaphore_left_signalled_is_caught(monkeypatch):
  """A kernel that never waits for its sends leaves each send semaphore holding the bytes
  its DMAs signalled; the results are still right, and the accounting must reject it."""

  class _NoSendWait:
    def __init__(self, copy):
      self._copy = copy

    def __getattr__(self, name):
      return getattr(self._copy, name)

    def wait_send(self):
      pass

  class _Pltpu:
    def __getattr__(self, name):
      return getattr(pltpu, name)

    def make_async_remote_copy(self, *args, **kwargs):
      return _NoSendWait(pltpu.make_async_remote_copy(*args, **kwargs))

  monkeypatch.setattr(torus_kernels, "pltpu", _Pltpu())
  schedules = _record_schedules(monkeypatch)
  mesh = harness.mesh((2, 4))
  names = mesh.axis_names
  x = jnp.asarray(np.random.default_rng(2).integers(-8, 8, size=(8, 301)), jnp.float32)
  _, accounting, got = counted(
    "eager", _per_device(lambda v: kernels.all_gather(v, names, (2, 4)), mesh, names), x
  )
  want = _per_device(LAX["all_gather"](names), mesh, names)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  (call,), (schedule,) = accounting.calls, schedules
  with pytest.raises(AssertionError, match="semaphores left signalled"):
    call.check()
  left = call.imbalances()
  assert {kind for kind, _, _ in left} == {"allocated"}  # DMA semaphores, not the barrier
  assert {device for _, _, device in left} == set(range(8))
  check_barrier(call, 8, len(remote_dma.links(schedule)))


# (collective, mesh, elements per device, piece_rows, DMA mode) of the int8 kernels: one
# short piece per stream slice (2x4), whole pieces and a short one (the ring: 32 + 1
# rows), and a three-phase gather (2x2x2).
QUANTIZED_CASES = [
  ("all_reduce", (2, 4), 5000, 256, "eager", jnp.float32),
  ("all_reduce", (8,), 8 * 2 * 128 * 33 - 77, 32, "on_wait", jnp.float32),
  ("all_reduce", (2, 4), 20_400, 256, "on_wait", jnp.bfloat16),  # read in place, 2-row tail
  ("reduce_scatter", (2, 4), 8 * 700, 32, "on_wait", jnp.float32),
  ("all_gather", (2, 2, 2), 3000, 32, "eager", jnp.float32),
]


@pytest.mark.parametrize(
  "collective,shape,n,piece_rows,mode,dtype",
  QUANTIZED_CASES,
  ids=[
    f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}-{c[4]}-{jnp.dtype(c[5]).name}"
    for c in QUANTIZED_CASES
  ],
)
def test_quantized_kernels_move_what_they_declare(collective, shape, n, piece_rows, mode, dtype):
  """The int8 kernels' declared HBM and remote bytes are what their DMAs move, counted
  (every device moves the same, so the mean is each device's), and they move no HBM bytes
  for the wire: the remote DMAs go from VMEM to the neighbour's VMEM."""
  from torus_collectives.kernels import quantized_kernels as qk

  mesh = harness.mesh(shape)
  names, p = mesh.axis_names, mesh.size
  x = jnp.asarray(np.random.default_rng(n).standard_normal((p, n)), dtype)
  ours = {
    "all_reduce": qk.quantized_all_reduce,
    "reduce_scatter": qk.quantized_reduce_scatter,
    "all_gather": qk.quantized_all_gather,
  }[collective]
  fn = _per_device(lambda v: ours(v, names, shape, piece_rows=piece_rows), mesh, names)
  costs, accounting, _ = counted(mode, fn, x)
  ((name, cost),), (call,) = costs, accounting.calls
  call.check()
  assert call.total("pipeline_in") == call.total("pipeline_out") == call.total("body_hbm") == 0
  assert call.total("dma_count") > 0
  for device in range(p):  # the same traffic on every device
    traffic = call.traffic[device]
    assert traffic.bytes_accessed == cost.bytes_accessed, (name, device, traffic)
    assert traffic.remote == cost.remote_bytes_transferred, (name, device, traffic)
