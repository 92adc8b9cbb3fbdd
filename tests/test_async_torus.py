"""The split ring all-gather (``kernels/async_torus.py``): start, steps and done as separate
Pallas calls.

* In TPU interpret mode through the split-call extension (``async_interpret``), race
  detector on, both DMA execution modes: exact against ``lax.all_gather(tiled=True)`` on
  small integers (int32, and float32 holding small integers) on an 8-device ring, on the
  y axis (4) and the x axis (2: start and done, no step) of a 2x4 mesh, with a matmul on
  unrelated data between every two calls, whose results are checked too; a sequence that
  skips a wait is reported, not passed.
* Ahead of time for v5e:2x4 (needs libtpu): in the scheduled program the start call
  precedes the first matmul, each matmul sits between two consecutive calls, the done
  follows the last, and ``out`` goes from call to call in place (aliased, never copied).
"""

import aot_skip
import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from async_interpret import NeverWaitedError, async_interpret_mode
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import async_torus, torus_kernels

pytestmark = pytest.mark.timeout(300, method="thread")

# (mesh shape, mesh axes, ring axis): the ring's size is that axis's.
MESHES = {
  "1d-x8": ((8,), ("x",), "x"),
  "2x4-y": ((2, 4), ("x", "y"), "y"),
  "2x4-x": ((2, 4), ("x", "y"), "x"),
}
DEVICES = 8
SIDE = 128  # the matmul's operand, per device: [SIDE, SIDE]


def _gather_and_compute(mesh_shape, mesh_axes, axis, x, w, mode):
  """The split all-gather of each device's row of ``x`` with ``w_d @ w_d.T + i`` between
  calls ``i`` and ``i + 1``, and ``lax.all_gather``, in ``async_interpret_mode(mode)``."""
  mesh = harness.mesh(mesh_shape, mesh_axes)
  n = mesh.shape[axis]

  def body(v, w):
    out, products = async_torus.ring_all_gather(
      v, axis, n, mesh_axes, between=lambda i, w: w @ w.T + i, operands=(w,)
    )
    return out, jnp.stack(products), lax.all_gather(v, axis, tiled=True)

  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    return jax.block_until_ready(harness.per_device(body, mesh, x, w))


def _expected_gather(x, mesh_shape, mesh_axes, axis):
  """Each device's gathered buffer, in numpy: the rows of the devices on its ring, in
  ring order."""
  grid = np.asarray(x).reshape(*mesh_shape, -1)
  a = mesh_axes.index(axis)
  rings = np.moveaxis(grid, a, -2)  # [..., n, m]: the ring's rows in order
  gathered = rings.reshape(*rings.shape[:-2], -1)  # [..., n * m]
  gathered = np.broadcast_to(np.expand_dims(gathered, a), (*mesh_shape, gathered.shape[-1]))
  return gathered.reshape(DEVICES, -1)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [np.int32, np.float32], ids=["int32", "float32"])
@pytest.mark.parametrize("case", list(MESHES))
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_split_all_gather_matches_lax(mode, case, dtype):
  """Exact against ``lax.all_gather(tiled=True)`` and numpy; the matmuls between the calls
  are exact too (small integers in float32)."""
  mesh_shape, mesh_axes, axis = MESHES[case]
  m = 256 if case == "1d-x8" else 128
  x = harness.small_integers((DEVICES, m), dtype, seed=3)
  w = harness.small_integers((DEVICES, SIDE, SIDE), np.float32, seed=4)
  out, products, reference = _gather_and_compute(mesh_shape, mesh_axes, axis, x, w, mode)
  n = harness.mesh(mesh_shape, mesh_axes).shape[axis]
  assert out.shape == (DEVICES, n * m) and out.dtype == dtype
  np.testing.assert_array_equal(out, reference)
  np.testing.assert_array_equal(out, _expected_gather(x, mesh_shape, mesh_axes, axis))
  w = np.asarray(w, np.float64)
  expected_products = np.stack(
    [w @ np.swapaxes(w, 1, 2) + i for i in range(n - 1)], axis=1
  )  # [devices, n - 1, SIDE, SIDE]
  np.testing.assert_array_equal(products, expected_products)


def _waits_receive_only(self, out_ref, hop, send, recv):
  self.dma(out_ref, self.received(hop), send, recv).wait_recv()


@pytest.mark.interpret
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_skipped_send_wait_is_reported(mode, monkeypatch):
  """Calls that never wait for their own sends leave the semaphores the previous call
  returned counting: the block reports it instead of returning the (correct) data."""
  monkeypatch.setattr(async_torus._Ring, "wait_hop", _waits_receive_only)
  x = harness.small_integers((DEVICES, 128), np.int32)
  w = harness.small_integers((DEVICES, SIDE, SIDE), np.float32)
  with pytest.raises(NeverWaitedError, match="async_all_gather_(start|step)"):
    _gather_and_compute((8,), ("x",), "x", x, w, mode)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_chunks_follow_the_ring_schedule(n):
  """The chunk each position sends and receives at each hop is the schedule's
  (``Phase.send_slab`` / ``recv_slab`` of ``build("all_gather", (n,), "ring")``), and
  over the hops a position receives every chunk but its own exactly once."""
  (phases,) = schedule_lib.build("all_gather", (n,), "ring").streams
  (phase,) = phases
  for p in range(n):
    ring = async_torus._Ring("x", n, ("x",), np.array([p], np.int32), 128)
    sent = [int(ring.sent(t)) for t in range(n - 1)]
    received = [int(ring.received(t)) for t in range(n - 1)]
    assert sent == [phase.send_slab(p, t, n) for t in range(n - 1)]
    assert received == [phase.recv_slab(p, t, n) for t in range(n - 1)]
    assert sent[1:] == received[:-1]  # each hop forwards what the last one brought
    assert sorted(received) == sorted(set(range(n)) - {p})


def test_collective_id_is_its_own():
  """The calls' barrier uses the async pattern's collective id, not the blocking
  all-gather's; done uses none."""
  schedule = schedule_lib.build("all_gather", (4,), "ring")
  cid = torus_kernels.collective_id("async_all_gather", ("y",), schedule)
  assert cid != torus_kernels.collective_id("all_gather", ("y",), schedule)
  mesh = harness.mesh((2, 4), ("x", "y"))
  spec = P(("x", "y"))
  fn = jax.shard_map(
    lambda v: async_torus.ring_all_gather(v[0], "y", 4, ("x", "y"))[None],
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
    check_vma=False,
  )
  jaxpr = jax.make_jaxpr(fn)(jnp.zeros((DEVICES, 128), jnp.int32))
  calls = list(_pallas_calls(jaxpr.jaxpr))
  ids = [(c.params["name"], _mosaic_params(c).collective_id) for c in calls]
  assert [name for name, _ in ids] == [
    "async_all_gather_start_y",
    "async_all_gather_step_y",
    "async_all_gather_step_y",
    "async_all_gather_done_y",
  ]
  assert [i for _, i in ids] == [cid, cid, cid, None]


def _mosaic_params(eqn):
  params = eqn.params["compiler_params"]
  return params["mosaic_tpu"] if isinstance(params, dict) else params


def _pallas_calls(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for value in eqn.params.values():
      sub = getattr(value, "jaxpr", None)
      if sub is not None:
        yield from _pallas_calls(getattr(sub, "jaxpr", sub))


def test_refuses_what_it_does_not_handle():
  x = jnp.zeros((100,), jnp.float32)
  with pytest.raises(ValueError, match="multiple of 128"):
    async_torus.all_gather_start(x, "x", 4, ("x",))
  with pytest.raises(ValueError, match="32-bit"):
    async_torus.all_gather_start(jnp.zeros((128,), jnp.bfloat16), "x", 4, ("x",))
  with pytest.raises(ValueError, match="n >= 2"):
    async_torus.all_gather_start(jnp.zeros((128,), jnp.int32), "x", 1, ("x",))


# ------------------------------------------------------------------ ahead of time (TPU)

AOT_M = 4096  # elements per chunk
AOT_SIDE = 512


def _compiled_schedule():
  """The y-axis split all-gather on v5e:2x4 with one independent matmul per gap, compiled;
  the entry computation's ops in schedule order."""
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from bench import aot_report, hlo_schedule

  mesh = aot_report.topology_mesh("v5e:2x4")
  assert dict(mesh.shape) == {"x": 2, "y": 4}
  spec = P(mesh.axis_names)

  def body(v, a, b):
    out, products = async_torus.ring_all_gather(
      v, "y", 4, ("x", "y"), between=lambda i, a, b: a[i] @ b, operands=(a, b)
    )
    return out, jnp.stack(products)

  fn = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P()), check_vma=False
    )
  )
  replicated = NamedSharding(mesh, P())
  args = (
    jax.ShapeDtypeStruct((DEVICES * AOT_M,), jnp.float32, sharding=NamedSharding(mesh, spec)),
    jax.ShapeDtypeStruct((3, AOT_SIDE, AOT_SIDE), jnp.float32, sharding=replicated),
    jax.ShapeDtypeStruct((AOT_SIDE, AOT_SIDE), jnp.float32, sharding=replicated),
  )
  text = fn.lower(*args).compile().as_text()
  return hlo_schedule.entry_ops(text), text


@pytest.mark.aot
@pytest.mark.timeout(600, method="thread")
def test_compiled_schedule_overlaps_matmuls_in_place():
  ops, text = _compiled_schedule()
  names = [op.name for op in ops]
  by_name = {op.name: op for op in ops}
  calls = [i for i, op in enumerate(ops) if op.kind == "pallas"]
  kinds = [ops[i].op_name.split("/")[-2] for i in calls]
  assert kinds == [
    "async_all_gather_start_y",
    "async_all_gather_step_y",
    "async_all_gather_step_y",
    "async_all_gather_done_y",
  ], kinds
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

  # out goes from each call to the next through get-tuple-element only (in place)...
  out_shape = f"f32[{4 * AOT_M}]"
  for before, after in zip(calls, calls[1:]):
    operand = ops[after].operands[1]
    while by_name[operand].opcode in ("get-tuple-element", "bitcast"):
      operand = by_name[operand].operands[0]
    assert operand == ops[before].name, (ops[after].name, operand)
  # ... each later call aliases it (output 0 is operand 1, the buffer)...
  entry = text[text.index("\nENTRY") :]
  for i in calls[1:]:
    line = next(ln for ln in entry.splitlines() if f"%{ops[i].name} = " in ln)
    assert "output_to_operand_aliasing={{0}: (1, {})}" in line or (
      "output_to_operand_aliasing={{}: (1, {})}" in line
    ), line
  # ... and nothing copies it while the DMAs are writing it.
  copies = [
    op.name
    for op in ops[start : done + 1]
    if op.opcode in ("copy", "copy-start", "copy-done") and out_shape in op.result
  ]
  assert copies == [], copies


@pytest.mark.aot
@pytest.mark.timeout(600, method="thread")
def test_without_pins_xla_moves_the_matmuls_after_done(monkeypatch):
  """Why ``pin`` exists: with the hook's compute tied to nothing, XLA schedules every
  matmul after the done call, the four calls back to back (no overlap at all). If this
  starts failing, XLA keeps the compute in the window by itself."""
  monkeypatch.setattr(async_torus, "pin", lambda state, values: (state, values))
  ops, _ = _compiled_schedule()
  done = max(i for i, op in enumerate(ops) if op.kind == "pallas")
  matmuls = [i for i, op in enumerate(ops) if "dot_general" in op.op_name]
  assert matmuls and min(matmuls) > done
