"""The split ring phases (``kernels/split_rings.py``): start, steps and done as separate
Pallas calls, for the all-gather and the reduce-scatter along one axis.

* In TPU interpret mode through the split-call extension (``testing.split_interpret``), race
  detector on, both DMA execution modes: exact against ``lax.all_gather(tiled=True)`` and
  ``lax.psum_scatter(tiled=True)`` on small integers (int32, float32 and bfloat16 holding
  small integers) on an 8-device ring, on the y axis (4) and the x axis (2: start and done,
  no step) of a 2x4 mesh, with a matmul on unrelated data between every two calls, whose
  results are checked too; a sequence that skips a wait is reported, not passed.
* Ahead of time for v5e:2x4 (needs libtpu): in the scheduled program the start call
  precedes the first matmul, each matmul sits between two consecutive calls, the done
  follows the last, and the buffer goes from call to call in place (aliased, never
  copied), for both kinds.
"""

import dataclasses

import aot_skip
import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import remote_dma, split_rings
from torus_collectives.testing.split_interpret import NeverWaitedError, async_interpret_mode

pytestmark = pytest.mark.timeout(300, method="thread")

# (mesh shape, mesh axes, ring axis): the ring's size is that axis's.
MESHES = {
  "1d-x8": ((8,), ("x",), "x"),
  "2x4-y": ((2, 4), ("x", "y"), "y"),
  "2x4-x": ((2, 4), ("x", "y"), "x"),
}
DEVICES = 8
SIDE = 128  # the matmul's operand, per device: [SIDE, SIDE]


def _phase_and_compute(kind, mesh_shape, mesh_axes, axis, x, w, mode, direction=1):
  """The split ``kind`` phase of each device's row of ``x`` with ``w_d @ w_d.T + i``
  between calls ``i`` and ``i + 1``, in ``async_interpret_mode(mode)``, and the ``lax``
  reference in a program of its own (a lax collective in the same program may run
  concurrently with a split call on the CPU and deadlock against the interpreter's
  waits)."""
  mesh = harness.mesh(mesh_shape, mesh_axes)
  n = mesh.shape[axis]
  reference = {
    "all_gather": lambda v: lax.all_gather(v, axis, tiled=True),
    "reduce_scatter": lambda v: lax.psum_scatter(v, axis, tiled=True),
  }[kind]

  def body(v, w):
    out, products = split_rings.ring_phase(
      kind,
      v,
      axis,
      n,
      mesh_axes,
      between=lambda i, w: w @ w.T + i,
      operands=(w,),
      direction=direction,
    )
    return out, jnp.stack(products)

  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    out, products = jax.block_until_ready(harness.per_device(body, mesh, x, w))
  return out, products, harness.per_device(reference, mesh, x)


def _expected_gather(x, mesh_shape, mesh_axes, axis):
  """Each device's gathered buffer, in numpy: the rows of the devices on its ring, in
  ring order."""
  grid = np.asarray(x).reshape(*mesh_shape, -1)
  a = mesh_axes.index(axis)
  rings = np.moveaxis(grid, a, -2)  # [..., n, m]: the ring's rows in order
  gathered = rings.reshape(*rings.shape[:-2], -1)  # [..., n * m]
  gathered = np.broadcast_to(np.expand_dims(gathered, a), (*mesh_shape, gathered.shape[-1]))
  return gathered.reshape(DEVICES, -1)


def _expected_scatter(x, mesh_shape, mesh_axes, axis):
  """Each device's reduced chunk, in numpy: the sum over its ring of chunk ``p``, ``p``
  its position on the ring."""
  n = mesh_shape[mesh_axes.index(axis)]
  grid = np.asarray(x, np.float64).reshape(*mesh_shape, n, -1)
  a = mesh_axes.index(axis)
  total = grid.sum(axis=a, keepdims=True)  # [..., 1, ..., n, m]
  total = np.broadcast_to(total, grid.shape)
  position = np.arange(n).reshape([n if i == a else 1 for i in range(len(mesh_shape))])
  chunks = np.take_along_axis(total, position[..., None, None], axis=-2)[..., 0, :]
  return chunks.reshape(DEVICES, -1)


DTYPES = {"int32": np.int32, "float32": np.float32, "bfloat16": jnp.bfloat16}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(MESHES))
@pytest.mark.parametrize("kind", split_rings.KINDS)
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_split_phase_matches_lax(mode, kind, case, dtype):
  """Exact against ``lax`` and numpy (bfloat16 on the wire, sums of small integers are
  exact in it); the matmuls between the calls are exact too (small integers in float32)."""
  mesh_shape, mesh_axes, axis = MESHES[case]
  n = harness.mesh(mesh_shape, mesh_axes).shape[axis]
  m = 256 if case == "1d-x8" else 512  # whole DMA words for 16-bit types too
  length = m if kind == "all_gather" else n * m
  x = harness.small_integers((DEVICES, length), np.float32, seed=3).astype(DTYPES[dtype])
  w = harness.small_integers((DEVICES, SIDE, SIDE), np.float32, seed=4)
  out, products, reference = _phase_and_compute(kind, mesh_shape, mesh_axes, axis, x, w, mode)
  expected = {"all_gather": _expected_gather, "reduce_scatter": _expected_scatter}[kind]
  assert out.shape == (DEVICES, n * m if kind == "all_gather" else m)
  assert out.dtype == x.dtype
  np.testing.assert_array_equal(out, reference)
  np.testing.assert_array_equal(
    np.asarray(out, np.float64), expected(x, mesh_shape, mesh_axes, axis)
  )
  w = np.asarray(w, np.float64)
  expected_products = np.stack(
    [w @ np.swapaxes(w, 1, 2) + i for i in range(n - 1)], axis=1
  )  # [devices, n - 1, SIDE, SIDE]
  np.testing.assert_array_equal(products, expected_products)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", split_rings.KINDS)
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_counter_clockwise_phase_matches_lax(mode, kind):
  """``direction=-1``: every device sends to the previous coordinate; the same result."""
  n, m = 8, 128
  x = harness.small_integers((DEVICES, m if kind == "all_gather" else n * m), np.int32, seed=9)
  w = harness.small_integers((DEVICES, SIDE, SIDE), np.float32, seed=4)
  out, _, reference = _phase_and_compute(kind, (8,), ("x",), "x", x, w, mode, direction=-1)
  np.testing.assert_array_equal(out, reference)


def _waits_receive_only(self, x_ref, buffer_ref, hop, send, recv, *, remote=True):
  landed = self.landing(buffer_ref, hop)
  if remote:
    self.dma(landed, landed, send, recv).wait_recv()
  else:
    pltpu.make_async_copy(landed, landed, recv).wait()


@pytest.mark.interpret
@pytest.mark.parametrize("kind", split_rings.KINDS)
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_skipped_send_wait_is_reported(mode, kind, monkeypatch):
  """Calls that never wait for their own sends leave the semaphores the previous call
  returned counting: the block reports it instead of returning the (correct) data."""
  monkeypatch.setattr(split_rings._Ring, "wait_hop", _waits_receive_only)
  x = harness.small_integers((DEVICES, 8 * 128 if kind == "reduce_scatter" else 128), np.int32)
  w = harness.small_integers((DEVICES, SIDE, SIDE), np.float32)
  with pytest.raises(NeverWaitedError, match=f"async_{kind}_(start|step)"):
    _phase_and_compute(kind, (8,), ("x",), "x", x, w, mode)


@pytest.mark.parametrize("direction", [1, -1])
@pytest.mark.parametrize("kind", split_rings.KINDS)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_chunks_follow_the_ring_schedule(n, kind, direction):
  """The chunk each position sends and receives at each hop is the schedule's
  (``Phase.send_slab`` / ``recv_slab`` of ``build(kind, (n,), "ring")``), each hop
  forwards what the last one brought, and over the hops a position receives every chunk
  but one exactly once: all but its own for the all-gather, all but the one it sends
  first for the reduce-scatter (it ends holding its own)."""
  (phases,) = schedule_lib.build(kind, (n,), "ring").streams
  phase = dataclasses.replace(phases[0], direction=direction)
  for p in range(n):
    coords = np.array([p], np.int32)
    ring = split_rings._Ring(kind, "x", n, ("x",), coords, 128, direction=direction)
    sent = [int(ring.sent(t)) for t in range(n - 1)]
    received = [int(ring.received(t)) for t in range(n - 1)]
    assert sent == [phase.send_slab(p, t, n) for t in range(n - 1)]
    assert received == [phase.recv_slab(p, t, n) for t in range(n - 1)]
    assert sent[1:] == received[:-1]  # each hop forwards what the last one brought
    missing = p if kind == "all_gather" else sent[0]
    assert sorted(received) == sorted(set(range(n)) - {missing})
    if kind == "reduce_scatter":
      assert received[-1] == p


@pytest.mark.parametrize("kind", split_rings.KINDS)
def test_collective_id_is_its_own(kind):
  """The calls' barrier uses the split pattern's collective id, not the blocking kernel's;
  done uses none."""
  schedule = schedule_lib.build(kind, (4,), "ring")
  cid = remote_dma.collective_id(f"async_{kind}", ("y",), schedule)
  assert cid != remote_dma.collective_id(kind, ("y",), schedule)
  # The other direction signals the other neighbours: a barrier semaphore of its own.
  assert cid != remote_dma.collective_id(split_rings.pattern(kind, -1), ("y",), schedule)
  mesh = harness.mesh((2, 4), ("x", "y"))
  spec = P(("x", "y"))
  fn = jax.shard_map(
    lambda v: split_rings.ring_phase(kind, v[0], "y", 4, ("x", "y"))[None],
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
    check_vma=False,
  )
  jaxpr = jax.make_jaxpr(fn)(jnp.zeros((DEVICES, 512), jnp.int32))
  calls = list(harness.pallas_calls(jaxpr.jaxpr))
  ids = [(c.params["name"], _mosaic_params(c).collective_id) for c in calls]
  prefix = f"async_{kind}"
  assert [name for name, _ in ids] == [
    f"{prefix}_start_y",
    f"{prefix}_step_y",
    f"{prefix}_step_y",
    f"{prefix}_done_y",
  ]
  assert [i for _, i in ids] == [cid, cid, cid, None]


def _mosaic_params(eqn):
  params = eqn.params["compiler_params"]
  return params["mosaic_tpu"] if isinstance(params, dict) else params


def test_refuses_what_it_does_not_handle():
  x = jnp.zeros((100,), jnp.float32)
  with pytest.raises(ValueError, match="multiple of 128"):
    split_rings.ring_start("all_gather", x, "x", 4, ("x",))
  with pytest.raises(ValueError, match="multiple of 256"):
    split_rings.ring_start("all_gather", jnp.zeros((128,), jnp.bfloat16), "x", 4, ("x",))
  with pytest.raises(ValueError, match="32-bit type or a 16-bit float"):
    split_rings.ring_start("all_gather", jnp.zeros((512,), jnp.int16), "x", 4, ("x",))
  with pytest.raises(ValueError, match="n >= 2"):
    split_rings.ring_start("all_gather", jnp.zeros((128,), jnp.int32), "x", 1, ("x",))
  with pytest.raises(ValueError, match="multiple of 4"):
    split_rings.ring_start("reduce_scatter", jnp.zeros((514,), jnp.int32), "x", 4, ("x",))
  with pytest.raises(ValueError, match="pad the buffer"):
    split_rings.ring_start("reduce_scatter", jnp.zeros((4 * 64,), jnp.int32), "x", 4, ("x",))
  with pytest.raises(ValueError, match="not one of"):
    split_rings.ring_start("all_gather", jnp.zeros((128,), jnp.int32), "y", 4, ("x",))
  with pytest.raises(ValueError, match="one of"):
    split_rings.ring_start("all_reduce", jnp.zeros((128,), jnp.int32), "x", 4, ("x",))


# ------------------------------------------------------------------ ahead of time (TPU)

AOT_M = 4096  # elements per chunk
AOT_SIDE = 512


def _compiled_schedule(kind):
  """The y-axis split ``kind`` phase on v5e:2x4 with one independent matmul per gap,
  compiled; the entry computation's ops in schedule order."""
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from torus_collectives.testing import aot, hlo_schedule

  mesh = aot.topology_mesh("v5e:2x4")
  assert dict(mesh.shape) == {"x": 2, "y": 4}
  spec = P(mesh.axis_names)

  def body(v, a, b):
    out, products = split_rings.ring_phase(
      kind, v, "y", 4, ("x", "y"), between=lambda i, a, b: a[i] @ b, operands=(a, b)
    )
    return out, jnp.stack(products)

  fn = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P()), check_vma=False
    )
  )
  replicated = NamedSharding(mesh, P())
  per_device = AOT_M if kind == "all_gather" else 4 * AOT_M
  args = (
    jax.ShapeDtypeStruct((DEVICES * per_device,), jnp.float32, sharding=NamedSharding(mesh, spec)),
    jax.ShapeDtypeStruct((3, AOT_SIDE, AOT_SIDE), jnp.float32, sharding=replicated),
    jax.ShapeDtypeStruct((AOT_SIDE, AOT_SIDE), jnp.float32, sharding=replicated),
  )
  text = fn.lower(*args).compile().as_text()
  return hlo_schedule.entry_ops(text), text


@pytest.mark.aot
@pytest.mark.timeout(600, method="thread")
@pytest.mark.parametrize("kind", split_rings.KINDS)
def test_compiled_schedule_overlaps_matmuls_in_place(kind):
  ops, text = _compiled_schedule(kind)
  names = [op.name for op in ops]
  by_name = {op.name: op for op in ops}
  calls = [i for i, op in enumerate(ops) if op.kind == "pallas"]
  kinds = [ops[i].op_name.split("/")[-2] for i in calls]
  prefix = f"async_{kind}"
  assert kinds == [f"{prefix}_start_y", f"{prefix}_step_y", f"{prefix}_step_y", f"{prefix}_done_y"]
  matmuls = [
    i
    for i, op in enumerate(ops)
    if op.opcode in ("fusion", "convolution") and "dot_general" in op.op_name
  ]
  assert len(matmuls) == 3, [ops[i].name for i in matmuls]
  start, done = calls[0], calls[-1]
  assert start < matmuls[0] and matmuls[-1] < done, names
  for k, matmul in enumerate(matmuls):  # one matmul in each gap between two calls
    assert calls[k] < matmul < calls[k + 1], (k, names)

  # The buffer goes from each call to the next through get-tuple-element only (in place)...
  buffer_operand = 1 if kind == "all_gather" else 2  # after the coordinates (and x)
  for before, after in zip(calls, calls[1:]):
    operand = ops[after].operands[buffer_operand]
    while by_name[operand].opcode in ("get-tuple-element", "bitcast"):
      operand = by_name[operand].operands[0]
    assert operand == ops[before].name, (ops[after].name, operand)
  # ... each later call aliases it (output 0 is the buffer operand)...
  entry = text[text.index("\nENTRY") :]
  for i in calls[1:]:
    line = next(ln for ln in entry.splitlines() if f"%{ops[i].name} = " in ln)
    assert f"output_to_operand_aliasing={{{{0}}: ({buffer_operand}, {{}})}}" in line or (
      f"output_to_operand_aliasing={{{{}}: ({buffer_operand}, {{}})}}" in line
    ), line
  # ... and nothing copies it while the DMAs are writing it (XLA may copy x, which the
  # calls only read synchronously: no DMA in flight reads it).
  produced_by_a_call = {ops[i].name for i in calls}

  def source(name):
    while by_name[name].opcode in ("get-tuple-element", "bitcast", "copy-start"):
      name = by_name[name].operands[0]
    return name

  copies = [
    op.name
    for op in ops[start : done + 1]
    if op.opcode in ("copy", "copy-start") and source(op.operands[0]) in produced_by_a_call
  ]
  assert copies == [], copies


@pytest.mark.aot
@pytest.mark.timeout(600, method="thread")
def test_without_pins_xla_moves_the_matmuls_after_done(monkeypatch):
  """Why ``pin`` exists: with the hook's compute tied to nothing, XLA schedules every
  matmul after the done call, the four calls back to back (no overlap at all). If this
  starts failing, XLA keeps the compute in the window by itself."""
  monkeypatch.setattr(split_rings, "pin", lambda state, values: (state, values))
  ops, _ = _compiled_schedule("all_gather")
  done = max(i for i, op in enumerate(ops) if op.kind == "pallas")
  matmuls = [i for i, op in enumerate(ops) if "dot_general" in op.op_name]
  assert matmuls and min(matmuls) > done
