"""The int8 block-scaled torus kernels (``kernels/quantized_kernels.py``): the in-kernel
vector math against ``quantization.quantize_np`` bit for bit (plain jnp on CPU); the
kernels in TPU interpret mode on 8 simulated CPU devices (race detector on, memory
NaN-poisoned, both DMA execution modes) against ``quantization.simulate`` and the
``shard_map`` implementation, bitwise (their layouts agree at every size: the kernels
lay the grid out as ``backends.shard_map`` does); and ahead-of-time compiles for TPUs
(skipped without libtpu).

Interpret mode takes 10-25 s per kernel run here, so each case is small. Multiple pieces
per stream slice are reached with ``piece_rows=32`` on the ring.
"""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from torus_collectives import quantization
from torus_collectives import schedule as schedule_lib
from torus_collectives.backends import shard_map as backend
from torus_collectives.kernels import quantized_kernels as qk
from torus_collectives.kernels import remote_dma
from torus_collectives.tiling import ceil_div

INT8 = quantization.BlockScaled("int8")
KERNELS = {
  "all_reduce": qk.quantized_all_reduce,
  "reduce_scatter": qk.quantized_reduce_scatter,
  "all_gather": qk.quantized_all_gather,
}


# ---------------------------------------------------------------------- the vector math


def _blocks_with_edge_cases(rows: int, seed: int = 0) -> np.ndarray:
  """[rows, 128] float32: normal rows, then an all-zero row, rows holding inf, -inf,
  NaN, a subnormal block, a block of one nonzero value, huge and tiny magnitudes."""
  x = np.random.default_rng(seed).standard_normal((rows, 128)).astype(np.float32)
  x[1] = 0
  x[2, 7] = np.inf
  x[3, 100] = -np.inf
  x[4, 0] = np.nan
  x[5] = np.float32(1e-41) * np.sign(x[5])  # subnormal: the scale underflows to 0
  x[6] = 0
  x[6, 64] = -3.0
  x[7] *= np.float32(3e37)
  x[8] *= np.float32(1e-30)
  x[9] = np.float32(-0.0)
  return x


@pytest.mark.parametrize("rows", [128, 96, 32])
def test_quantize_matches_the_format_bitwise(rows):
  """Bitwise ``quantization.quantize`` (the jnp function the portable implementation
  runs) and ``quantize_np`` on every block, the subnormal one included: XLA on CPU (and a
  TPU) flushes subnormals to zero, and the format does so explicitly, so that block gets
  scale 0 and arrives as zeros everywhere."""
  x = _blocks_with_edge_cases(rows)
  q, words = jax.jit(qk._quantize)(x)
  q, bits = np.asarray(q), np.asarray(words)[0, :rows]
  assert not np.any(np.asarray(words)[0, rows:])
  portable_q, portable_scales = jax.jit(lambda v: quantization.quantize(v, INT8))(x)
  np.testing.assert_array_equal(q, np.asarray(portable_q))
  np.testing.assert_array_equal(bits, np.asarray(portable_scales).reshape(-1).view(np.uint16))
  want_q, want_scales = quantization.quantize_np(x, INT8)
  want_bits = want_scales.reshape(-1).view(np.uint16).astype(np.int32)
  np.testing.assert_array_equal(q, want_q)
  np.testing.assert_array_equal(bits, want_bits)
  assert bits[5] == 0 and not q[5].any()


def test_scale_rows_pack_and_unpack_both_halves():
  """A 256-row piece: lane l carries row l in its low half and row l + 128 in its high
  half; unpacking gives each row its scale back, NaN scales included."""
  x = _blocks_with_edge_cases(256, seed=1)
  x[200, 3] = np.nan
  _, low = qk._quantize(x[:128])
  _, high = qk._quantize(x[128:])
  words = low | jax.lax.shift_left(high, 16)
  _, scales = jax.jit(lambda v: quantization.quantize(v, INT8))(x)
  want = np.asarray(scales.astype(jnp.float32)).reshape(-1)
  for half in (0, 1):
    got = np.asarray(qk._unpack(words, 128, half))[:, 0]
    np.testing.assert_array_equal(got, want[half * 128 : (half + 1) * 128])


def test_sub_blocks_cover_a_piece_in_whole_int8_tiles():
  assert qk._sub_blocks(256) == [(0, 0, 128), (1, 128, 128)]
  assert qk._sub_blocks(33) == [(0, 0, 64)]
  assert qk._sub_blocks(150) == [(0, 0, 128), (1, 128, 32)]


# ---------------------------------------------------------------------- cost and ids


@pytest.mark.parametrize("torus", [(8,), (2, 4), (4, 4), (2, 2, 2)])
@pytest.mark.parametrize("rows", [1, 25, 300])
def test_declared_wire_bytes_are_the_schedules_at_int8_plus_scales(torus, rows):
  """The kernel's remote bytes: the schedule's own count (``bytes_sent_per_device``) of a
  buffer whose stream slices each take ``ceil4(R)`` int8 rows and a 512-byte scale row
  per piece; about 0.51-0.53 of bfloat16's for large slices."""
  schedule = schedule_lib.build("all_reduce", torus, schedule_lib.default_variant(torus))
  lay = qk.QLayout(schedule, rows)
  slices = schedule.num_devices * schedule.num_streams
  wire = rows and ceil_div(rows, 4) * 4 * 128 + len(lay.pieces) * 512
  est = qk.cost(schedule, lay, "all_reduce")
  assert est.remote_bytes_transferred == schedule.bytes_sent_per_device(slices * wire)
  bf16 = schedule.bytes_sent_per_device(slices * rows * 128 * 2)
  if rows == 300:  # two pieces (256 + 44 rows): 2 scale rows
    assert 0.5 < est.remote_bytes_transferred / bf16 < 0.53


def test_collective_ids_differ_from_the_blocking_kernels():
  schedule = schedule_lib.build("all_reduce", (2, 4), "torus_split")
  rs = schedule_lib.build("reduce_scatter", (2, 4), "torus_split")
  ours = remote_dma.collective_id("quantized_all_reduce", ("x", "y"), schedule)
  theirs = {
    remote_dma.collective_id(kind, ("x", "y"), rs) for kind in ("reduce_scatter", "all_gather")
  }
  assert ours not in theirs


def test_piece_rows_must_be_whole_int8_tiles():
  schedule = schedule_lib.build("all_reduce", (8,), "bidirectional_ring")
  with pytest.raises(ValueError, match="piece_rows"):
    qk.QLayout(schedule, 10, piece_rows=48 + 1)
  with pytest.raises(ValueError, match="piece_rows"):
    qk.QLayout(schedule, 10, piece_rows=512)


# ---------------------------------------------------------------------- interpret mode


def _inputs(p: int, n: int, seed: int) -> np.ndarray:
  """Random normal floats per device, with an all-zero block on every device, and one
  device's block holding inf and another's NaN (those blocks arrive as NaN)."""
  x = np.array(harness.random_floats((p, n), seed=seed))
  x[:, 128:256] = 0
  x[2, min(5, n - 1)] = np.inf
  x[5, n // 2] = np.nan
  x[6, n - 1] = -np.inf
  return x


def _model(collective: str, torus, x: np.ndarray) -> np.ndarray:
  """``quantization.simulate`` on ``x`` ([p, n]) laid out as the kernels lay it out
  (``backends.shard_map``'s chunk grid); what each device ends with, [p, n_out]."""
  p, n = x.shape
  streams = schedule_lib.build(collective, torus, schedule_lib.default_variant(torus)).num_streams
  m = {"all_reduce": ceil_div(n, p), "reduce_scatter": n // p, "all_gather": n}[collective]
  width = qk._width(m, streams)
  if collective == "all_reduce":  # whole chunks back to back, the padding at the end
    m = width
  buffers = np.zeros((p, p, width), np.float32)
  if collective == "all_gather":
    for d in range(p):
      buffers[d, d, :n] = x[d]
  else:
    flats = np.zeros((p, p * m), np.float32)
    flats[:, :n] = x
    buffers[:, :, :m] = flats.reshape(p, p, m)
  shape = tuple(torus) * 2 + (width,)
  transport = (INT8,) * len(torus)
  out = quantization.simulate(collective, tuple(torus), buffers.reshape(shape), transport)
  out = out.reshape(p, p, width)[:, :, :m]
  if collective == "reduce_scatter":
    return np.stack([out[d, d] for d in range(p)])
  return out.reshape(p, p * m)[:, : (n if collective == "all_reduce" else p * n)]


# (collective, mesh shape, elements per device, piece_rows, DMA mode): every mesh in both
# modes. Sizes: 1000 (one row per stream slice: ragged, three padding rows per int8
# slice), 5000 (seven rows on 3-D), and one slice of 33 rows in two pieces (32 + 1) on
# the ring, ragged.
CASES = [
  ("all_reduce", (2, 4), 1000, 256, "eager"),
  ("all_reduce", (2, 4), 5000, 256, "on_wait"),
  ("all_reduce", (8,), 8 * 2 * 128 * 33 - 77, 32, "on_wait"),
  ("all_reduce", (8,), 3000, 256, "eager"),
  ("all_reduce", (2, 2, 2), 1000, 256, "eager"),
  ("all_reduce", (2, 2, 2), 5000, 256, "on_wait"),
  ("reduce_scatter", (2, 4), 8 * 700, 32, "on_wait"),
  ("all_gather", (2, 2, 2), 3000, 32, "eager"),
]


@pytest.mark.interpret
@pytest.mark.parametrize(
  "collective,shape,n,piece_rows,mode",
  CASES,
  ids=[f"{c}-{'x'.join(map(str, s))}-{n}-{mode}" for c, s, n, _, mode in CASES],
)
def test_kernel_equals_the_model_and_the_shard_map_implementation(
  collective, shape, n, piece_rows, mode
):
  mesh = harness.mesh(shape)
  axes = tuple(mesh.axis_names)
  p = math.prod(shape)
  x = _inputs(p, n, seed=n)
  kernel = KERNELS[collective]
  ours = harness.interpreted(
    mode,
    lambda v: harness.per_device(
      lambda u: kernel(u, axes, shape, piece_rows=piece_rows), mesh, v, check_vma=False
    ),
    x,
  )
  ours = np.asarray(ours)
  np.testing.assert_array_equal(ours, _model(collective, shape, x))
  portable = harness.per_device(
    lambda u: getattr(backend, collective)(u, axes, shape, transport=(INT8,) * len(shape)),
    mesh,
    x,
    check_vma=False,
  )
  np.testing.assert_array_equal(ours, np.asarray(portable))
  if collective == "all_reduce":
    assert all(np.array_equal(ours[0], ours[d], equal_nan=True) for d in range(p))
    nan = np.isnan(ours[0])
    assert nan.any() and not nan.all() and not ours[0][128:256].any()


# (mesh, elements, dtype, DMA mode) of all-reduces read and written in place: a bfloat16
# buffer whose last 176 elements (no whole DMA word) span two rows after two whole rows of
# the piece that holds them; a float32 buffer that ends on a piece boundary (no piece is
# partial, later ones are all missing).
FLAT_CASES = [
  ((2, 4), 20_400, jnp.bfloat16, "eager"),
  ((8,), 128 * 300, jnp.float32, "on_wait"),
]


@pytest.mark.interpret
@pytest.mark.parametrize(
  "shape,n,dtype,mode",
  FLAT_CASES,
  ids=[f"{'x'.join(map(str, s))}-{n}-{jnp.dtype(d).name}-{m}" for s, n, d, m in FLAT_CASES],
)
def test_all_reduce_in_place_equals_the_model_in_the_inputs_type(shape, n, dtype, mode):
  """The all-reduce on its 1-D buffer as it is (``Flat``): the model of the float32
  values, rounded once to the input's type, and bitwise the ``shard_map`` result."""
  from torus_collectives.kernels.quantized_kernels import Flat

  mesh = harness.mesh(shape)
  axes, p = tuple(mesh.axis_names), math.prod(shape)
  x = jnp.asarray(_inputs(p, n, seed=n), dtype)
  schedule = schedule_lib.build("all_reduce", shape, schedule_lib.default_variant(shape))
  width = qk._width(ceil_div(n, p), schedule.num_streams)
  lay = qk.QLayout(schedule, width // (schedule.num_streams * 128))
  flat = Flat(n, jnp.dtype(dtype))
  assert (flat.partial(lay) is None) == (jnp.dtype(dtype) == jnp.float32)
  ours = harness.interpreted(
    mode,
    lambda v: harness.per_device(lambda u: qk.quantized_all_reduce(u, axes, shape), mesh, v),
    x,
  )
  ours = np.asarray(ours)
  assert ours.dtype == jnp.dtype(dtype)
  want = _model("all_reduce", shape, np.asarray(x, np.float32)).astype(ours.dtype)
  np.testing.assert_array_equal(ours, want)
  portable = harness.per_device(
    lambda u: backend.all_reduce(u, axes, shape, transport=(INT8,) * len(shape)), mesh, x
  )
  np.testing.assert_array_equal(ours, np.asarray(portable))


@pytest.mark.interpret
def test_under_check_vma_and_a_mesh_with_more_axes():
  """``check_vma=True``, and a 1-D ring over ``y`` of a 2x4 mesh (the other mesh axis in
  the device ids): per row of the mesh, the same as the portable implementation."""
  mesh = harness.mesh((2, 4))
  x = _inputs(8, 700, seed=3)
  ours = harness.interpreted(
    "on_wait",
    lambda v: harness.per_device(lambda u: qk.quantized_all_reduce(u, ("y",), (4,)), mesh, v),
    x,
  )
  portable = harness.per_device(
    lambda u: backend.all_reduce(u, ("y",), (4,), transport=(INT8,)), mesh, x, check_vma=False
  )
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(portable))


# ---------------------------------------------------------------------- ahead of time


def _compile(topology: str, elements: int, fn=None, dtype=jnp.float32):
  pytest.importorskip("libtpu", reason="ahead-of-time TPU compiles need libtpu")
  from bench import block_scaled_bytes_report

  return block_scaled_bytes_report.compile_per_device(topology, elements, fn, dtype)


@pytest.mark.aot
@pytest.mark.parametrize("topology", ["v5e:2x4", "v4:2x2x2", "v6e:2x4"])
def test_compiles_ahead_of_time(topology):
  _, compiled = _compile(topology, 100_003)
  assert compiled.as_text().count("tpu_custom_call") == 1


@pytest.mark.aot
def test_compiled_bytes_against_the_bfloat16_kernel_on_v5e_4x4():
  """2**20 float32 elements per device on v5e:4x4 (a whole grid: no pad, no slice; the
  only op around the kernel is XLA copying the program's result out of its buffer). The
  compiler's bytes accessed are the kernel's declared ones (counted in interpret mode by
  ``test_kernel_accounting.py``): 0.81 of the bfloat16 blocking kernel's floor on
  bfloat16 data and 0.40 of the float32 kernel's (the wire is VMEM to VMEM; what remains
  is the float32 own terms read at every hop and the float32 result written once). The
  wire bytes are 0.52 of the bfloat16 kernel's."""
  from torus_collectives.testing import aot

  elements = 2**20
  mesh, compiled = _compile("v5e:4x4", elements)
  glue = aot.glue(compiled)
  assert [g for g in glue if g not in aot.output_copies(glue)] == []
  ours = aot.collective_bytes(compiled)
  schedule = schedule_lib.build("all_reduce", (4, 4), "torus_split")
  lay = qk.QLayout(schedule, elements // (16 * 4 * 128))
  declared = qk.cost(schedule, lay, "all_reduce")
  # The kernel's declared bytes, and a few KB of XLA's small ops (the mesh coordinates).
  assert declared.bytes_accessed <= ours <= declared.bytes_accessed + 16 * 1024
  # The blocking kernels are at their floor 7 (p-1)/p S (test_kernels_aot.py).
  bf16_floor = aot.ideal_bytes(mesh.size, 2 * elements)
  assert ours < 0.82 * bf16_floor
  assert ours < 0.41 * aot.ideal_bytes(mesh.size, 4 * elements)
  bf16_wire = aot.wire_bound(mesh.size, 2 * elements)  # what the bf16 kernel sends
  assert 0.5 < declared.remote_bytes_transferred / bf16_wire < 0.53


@pytest.mark.aot
@pytest.mark.parametrize(
  "topology,dtype,bound",
  [
    ("v5e:4x4", jnp.bfloat16, 0.63),
    ("v5e:4x4", jnp.float32, 0.75),
  ],
  ids=["v5e:4x4-bf16", "v5e:4x4-f32"],
)
def test_resnet50_gradient_int8_against_bf16_transport_compiled_alike(topology, dtype, bound):
  """ResNet-50's gradient (25,557,032 elements, no multiple of 128) as one buffer, the sum
  consumed by ``2 *`` inside the program (``block_scaled_bytes_report.consumed_all_reduce``):
  the int8 kernel reads the gradient and writes the sum in place (no pad, reshape, slice or
  copy: XLA's one op is the ``2 *``, which reads the sum in place), and the compiler's
  bytes accessed are the kernel's declared ones plus the ``2 *``'s read and write. Against
  sending the gradient as bfloat16 (cast, bfloat16 kernels, cast back, ``2 *``; for a
  bfloat16 gradient the kernels and the ``2 *``), compiled and consumed the same way, f32
  in and out for a f32 gradient: at most ``bound`` of that program's bytes accessed.
  Compiler estimates, not measurements; ``python -m bench.block_scaled_bytes_report``
  tabulates them with the same functions (``bench/results/block_scaled_bytes.json``)."""
  pytest.importorskip("libtpu", reason="ahead-of-time TPU compiles need libtpu")
  from bench import block_scaled_bytes_report as report
  from torus_collectives.testing import aot

  elements = aot.RESNET50_PARAMS
  int8 = report.measure_side(topology, elements, dtype, "int8")
  (consumer,) = int8.ops
  assert consumer["root"] and consumer["op"] == "fusion", aot.describe(int8.ops)
  assert consumer["elements"] == elements
  declared = report.declared_cost(aot.topology_mesh(topology), elements, dtype)
  assert int8.kernel_bytes == declared.bytes_accessed
  # Beyond the kernel's declared bytes and the 2 *'s read and write: XLA's small ops (the
  # mesh coordinates, the tail's slice and pad) and padding to whole tiles, some tens of KB.
  expected = declared.bytes_accessed + 2 * consumer["bytes"]
  assert expected <= int8.hbm_bytes <= expected + 64 * 1024
  bf16 = report.measure_side(topology, elements, dtype, "bfloat16")
  assert int8.hbm_bytes <= bound * bf16.hbm_bytes


@pytest.mark.interpret
def test_gradient_summation_on_pallas_runs_these_kernels():
  """``tc.all_reduce_gradients(..., transport_dtype=jnp.int8, implementation="pallas")``
  (the registry's route: primitive, backend, kernel), in TPU interpret mode, equals the
  ``shard_map`` implementation's int8 summation bitwise (and so differs from the exact
  mean, as quantization must)."""
  import torus_collectives as tc

  mesh = harness.mesh((2, 4))
  axes = ("x", "y")
  tree = {
    "w": harness.random_floats((8, 40, 33), seed=2),
    "b": harness.random_floats((8, 9), seed=3),
  }

  def summed(impl):
    return lambda t: tc.all_reduce_gradients(t, axes, transport_dtype=jnp.int8, implementation=impl)

  ours = harness.interpreted(
    "on_wait", lambda t: harness.per_device(summed("pallas"), mesh, t), tree
  )
  portable = harness.per_device(summed("shard_map"), mesh, tree)
  for name in tree:
    np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(portable[name]))
    assert not np.array_equal(np.asarray(ours[name][0]), tree[name].mean(0))
