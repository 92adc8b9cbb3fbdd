"""The remote-DMA torus kernels in TPU interpret mode on 8 simulated CPU devices, against lax,
on 2-D and 3-D tori (a rank parameter).

Every kernel run goes through ``harness.interpret_mode``: the race detector on (a race
raises inside the interpreter, and the last kernel's race state is checked as well) and
uninitialized memory poisoned with NaN (integer buffers with their maximum value), so reading
a buffer before a DMA has filled it shows up as a wrong or NaN result. Interpret mode is slow
(seconds per kernel), so the matrix is a chosen spread over meshes, dtypes, collectives and
DMA execution modes rather than their product; every collective runs in both ``eager`` and
``on_wait`` modes somewhere on each rank (the multi-block all-reduce runs eagerly on the 4x4
torus in test_kernels_mixed_patterns.py).

On 3-D tori (2x2x2 here; 2x2x4, 16 devices, in a subprocess) the split schedule runs six
streams, and its first reduce-scatter slab spans two grid axes, which the 2-D kernels never
see; integer inputs make those comparisons exact.
"""

import os
import sys

import harness
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from device_count_subprocess import run_as_script
from harness import interpret_mode, interpreted
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import kernel_config as config_lib
from torus_collectives import registry
from torus_collectives.kernels import pallas_backend as kernels
from torus_collectives.kernels import torus_kernels

pytestmark = pytest.mark.interpret

AXES = ("x", "y")
MARKER = "2x2x4 kernels match lax"
# 16-row blocks, so a chunk of more than 16 rows per stream streams through VMEM in pieces.
SMALL_BLOCKS = config_lib.KernelConfig(block_rows=16)
# Per-device elements of each chunk: 2 blocks per stream slice on the 4-stream (2-D) and
# 6-stream (3-D) torus, minus an odd amount so the padding path runs too.
MULTI_BLOCK_CHUNK = 4 * 2 * 16 * 128 - 77
MULTI_BLOCK_CHUNK_3D = 6 * 2 * 16 * 128 - 77


def _per_device(fn, mesh, axes=None, *, check_vma=False):
  """Runs ``fn`` on each device's row of an ``(devices, k)`` array."""
  names = P(tuple(mesh.axis_names))
  return jax.jit(
    jax.shard_map(
      lambda v: fn(v[0])[None], mesh=mesh, in_specs=names, out_specs=names, check_vma=check_vma
    )
  )


def _inputs(dtype, shape, integers: bool):
  rng = np.random.default_rng(0)
  if integers:
    return jnp.asarray(rng.integers(-8, 8, size=shape), dtype)
  return jnp.asarray(rng.standard_normal(shape), dtype)


LAX = {
  "reduce_scatter": lambda axes: lambda v: lax.psum_scatter(v, axes, tiled=True),
  "all_gather": lambda axes: lambda v: lax.all_gather(v, axes, tiled=True),
  "all_reduce": lambda axes: lambda v: lax.psum(v, axes),
}
INPUT_ELEMENTS = {  # per device, for a chunk of m elements on p devices
  "reduce_scatter": lambda p, m: p * m,
  "all_gather": lambda p, m: m,
  "all_reduce": lambda p, m: p * m - 5,
}


# (collective, mesh shape, axes, dtype, integer inputs, chunk elements, DMA mode), by rank.
# 3-D: every collective in both modes, on several axis orders, a 2-D torus and a ring over
# a 3-D mesh. Chunks of 300 elements are under a tile per stream, so they run one stream;
# the two larger chunks run all six, in pieces, and bfloat16 partial sums travel as bfloat16
# (16-row tiles) with float32 adds.
CASES = {
  "2d": [
    ("all_reduce", (2, 4), AXES, jnp.int32, True, MULTI_BLOCK_CHUNK, "on_wait"),
    ("all_reduce", (2, 4), AXES, jnp.bfloat16, False, 300, "on_wait"),
    ("all_reduce", (2, 4), ("y",), jnp.float32, True, 300, "eager"),
    ("reduce_scatter", (4, 2), AXES, jnp.float32, False, MULTI_BLOCK_CHUNK, "on_wait"),
    ("reduce_scatter", (1, 8), AXES, jnp.bfloat16, True, 300, "eager"),
    ("all_gather", (4, 2), AXES, jnp.bfloat16, False, 300, "eager"),
    ("all_gather", (1, 8), AXES, jnp.int32, True, 300, "on_wait"),
    ("all_gather", (8, 1), AXES, jnp.float16, True, 300, "eager"),
  ],
  "3d": [
    ("all_reduce", (2, 2, 2), ("x", "y", "z"), jnp.int32, True, MULTI_BLOCK_CHUNK_3D, "on_wait"),
    ("all_reduce", (2, 2, 2), ("z", "x", "y"), jnp.bfloat16, True, 6 * 16 * 128 - 5, "eager"),
    ("reduce_scatter", (2, 2, 2), ("y", "z", "x"), jnp.int32, True, 300, "eager"),
    ("reduce_scatter", (2, 2, 2), ("x", "y", "z"), jnp.float32, True, 300, "on_wait"),
    ("all_gather", (2, 2, 2), ("z", "y", "x"), jnp.int32, True, 300, "on_wait"),
    ("all_gather", (2, 2, 2), ("x", "y", "z"), jnp.bfloat16, True, 300, "eager"),
    ("all_reduce", (2, 2, 2), ("x", "z"), jnp.int32, True, 300, "on_wait"),
    ("all_reduce", (2, 2, 2), ("y",), jnp.float32, True, 300, "eager"),
  ],
}


def _case_id(rank, c):
  shape = "x".join(map(str, c[1]))
  return f"{rank}-{c[0]}-{shape}-{'.'.join(c[2])}-{jnp.dtype(c[3]).name}-{c[6]}"


def _inputs_for(shape, p, n, dtype, integers):
  if len(shape) == 3:  # the 3-D cases draw from a generator seeded by the group size
    return jnp.asarray(np.random.default_rng(p).integers(-8, 8, size=(8, n)), dtype)
  return _inputs(dtype, (8, n), integers)


@pytest.mark.parametrize(
  "rank,collective,shape,axes,dtype,integers,chunk,mode",
  [(rank, *c) for rank, cases in CASES.items() for c in cases],
  ids=[_case_id(rank, c) for rank, cases in CASES.items() for c in cases],
)
def test_kernel_matches_lax(rank, collective, shape, axes, dtype, integers, chunk, mode):
  mesh = harness.mesh(shape)
  torus = tuple(mesh.shape[a] for a in axes)
  p = int(np.prod(torus))
  x = _inputs_for(shape, p, INPUT_ELEMENTS[collective](p, chunk), dtype, integers)
  want = _per_device(LAX[collective](axes), mesh, axes)(x)
  ours = getattr(kernels, collective)
  # Random 16-bit floats are summed with float32 partials, rounded once like lax's sum on
  # CPU; integers exercise the default (16-bit partial sums, exact for small integers).
  config = config_lib.KernelConfig(
    block_rows=SMALL_BLOCKS.block_rows, float32_partials=not integers
  )
  got = interpreted(mode, _per_device(lambda v: ours(v, axes, torus, config=config), mesh, axes), x)
  if rank == "3d":
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    return
  got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
  assert not np.isnan(got).any()
  if integers or collective == "all_gather":
    np.testing.assert_array_equal(got, want)
  elif dtype == jnp.bfloat16:
    # Both sum in float32 and round once, in different orders: at most a few bf16 ulps.
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.sqrt(p))
  else:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
  "rank,shape,axes,seed",
  [("2d", (2, 4), AXES, None), ("3d", (2, 2, 2), ("z", "x", "y"), 3)],
  ids=["2d", "3d"],
)
def test_public_api_forward_and_gradient(rank, shape, axes, seed):
  """tc.reduce_scatter(implementation="pallas") under check_vma=True, with its VJP
  (the all-gather kernel), against lax. (Untiled calls differ only in the public layer's
  reshapes, which its own tests cover.)"""
  mesh = harness.mesh(shape)
  names = P(tuple(mesh.axis_names))
  if seed is None:
    x = _inputs(jnp.float32, (8, 8 * 24), integers=True)
    w = _inputs(jnp.float32, (8, 24), integers=True)
  else:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(-8, 8, size=(8, 8 * 24)), jnp.float32)
    w = jnp.asarray(rng.integers(-8, 8, size=(8, 24)), jnp.float32)

  def loss(impl):
    def per_device(v, u):
      out = tc.reduce_scatter(v[0], axes, tiled=True, implementation=impl)
      return jnp.sum(out * u[0])[None]

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(names, names), out_specs=names)
    return jax.jit(jax.value_and_grad(lambda v, u: sharded(v, u).sum()))

  want = loss("xla")(x, w)
  got = interpreted("on_wait", loss("pallas"), x, w)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


def test_pallas_off_tpu_without_interpret_mode_raises():
  mesh = harness.mesh((2, 4))
  f = _per_device(lambda v: tc.all_reduce(v, AXES, implementation="pallas"), mesh, AXES)
  with pytest.raises(ValueError, match="force_tpu_interpret_mode"):
    f(jnp.ones((8, 16), jnp.float32))


def test_auto_is_xla_on_cpu():
  seen = []

  def record(v):
    seen.append(registry.auto_implementation())
    return v

  _per_device(record, harness.mesh((2, 4)), AXES)(jnp.ones((8, 4)))
  assert seen == ["xla"]


def _equations(jaxpr, primitive: str):
  """Every ``primitive`` equation in ``jaxpr``, inside sub-jaxprs too (not kernel bodies)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == primitive:
      yield eqn
    if eqn.primitive.name == "pallas_call":
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from _equations(sub, primitive)


@pytest.mark.parametrize("float32_partials", [False, True])
def test_bfloat16_wire_bytes_and_types(float32_partials):
  """bf16 partial sums travel as bf16 (the bound 2(p-1)/p S), unless asked for float32.

  Tracing only: the kernels' operand types and declared remote bytes, and whether any
  conversion runs outside them."""
  mesh, p = harness.mesh((2, 4)), 8
  n = p * 4 * 16 * 128  # a whole number of 16-row blocks per stream: no padding
  config = config_lib.KernelConfig(float32_partials=float32_partials)
  fn = _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4), config=config), mesh, AXES)
  with interpret_mode():
    jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((8, n), jnp.bfloat16)).jaxpr
  calls = list(_equations(jaxpr, "pallas_call"))
  wire = jnp.float32 if float32_partials else jnp.bfloat16
  assert [c.params["name"] for c in calls] == ["torus_reduce_scatter_x_y", "torus_all_gather_x_y"]
  assert calls[0].params["out_avals"][0].dtype == wire
  sent = sum(c.params["cost_estimate"].remote_bytes_transferred for c in calls)
  rs_sent = calls[0].params["cost_estimate"].remote_bytes_transferred
  assert rs_sent == (p - 1) / p * n * jnp.dtype(wire).itemsize
  assert sent == rs_sent + (p - 1) / p * n * 2  # the gather always moves bf16
  converts = list(_equations(jaxpr, "convert_element_type"))
  assert bool(converts) == float32_partials


def test_bfloat16_error_against_float64():
  """Both bf16 modes against the exact (float64) sum. With float32 partials the sum is
  rounded once: within half a bf16 ulp of the exact sum. With bf16 partials each of the
  4 adds on an element's path (3 on the y ring, 1 on x) rounds: within 4 u sum|x_i|
  (u = 2**-8, the bf16 unit roundoff)."""
  mesh, p, u = harness.mesh((2, 4)), 8, 2.0**-8
  x = _inputs(jnp.bfloat16, (8, p * 4 * 16 * 128), integers=False)
  terms = np.asarray(x, np.float64)
  exact, scale = terms.sum(0), np.abs(terms).sum(0)

  def error(float32_partials: bool) -> np.ndarray:
    config = config_lib.KernelConfig(float32_partials=float32_partials)
    fn = _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4), config=config), mesh, AXES)
    return np.abs(np.asarray(interpreted("eager", fn, x), np.float64) - exact[None])

  once, per_hop = error(True), error(False)
  assert np.all(once <= u * np.abs(exact) + 2.0**-20 * scale)
  assert np.all(per_hop <= 4 * u * scale)
  assert per_hop.mean() > once.mean()  # the bound is not vacuous: hops do round


@pytest.mark.parametrize(
  "n,block_rows",
  [
    (8 * 4 * 48 * 128 - 5, 32),  # 48 rows per stream slice: pieces of 32 and 16 rows
    (5, None),  # tiny: one 16-row tile per stream slice
  ],
  ids=["short-last-piece", "tiny"],
)
def test_all_reduce_pieces_and_padding(n, block_rows):
  """Slabs cut into pieces that do not divide the slice, and a buffer smaller than one
  tile per stream, against lax (integers: exact)."""
  mesh = harness.mesh((2, 4))
  x = _inputs(jnp.int32, (8, n), integers=True)
  want = _per_device(LAX["all_reduce"](AXES), mesh, AXES)(x)
  config = config_lib.KernelConfig(block_rows=block_rows)
  got = interpreted(
    "on_wait",
    _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4), config=config), mesh, AXES),
    x,
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype,rows", [(jnp.float32, 24), (jnp.bfloat16, 32)])
def test_stream_slices_are_padded_to_one_native_tile_at_most(dtype, rows):
  """17 rows per stream slice pad to 24 (8-row tiles) in 32-bit types, 32 (16-row tiles)
  in 16-bit ones: the receive slots (2 slots of a 4-chunk slab) are sized by them, while
  the buffer itself is not padded. Tracing only."""
  mesh, p = harness.mesh((2, 4)), 8
  n = p * 4 * 17 * 128 - 3
  fn = _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4)), mesh, AXES)
  with interpret_mode():
    jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((8, n), dtype)).jaxpr
  calls = list(_equations(jaxpr, "pallas_call"))
  work, slot = (aval.shape for aval in calls[0].params["out_avals"][:2])
  assert (work, slot) == ((n,), (2 * 4 * rows * 128,))
  assert _glue(jaxpr) == []


# Operations that would copy (part of) the buffer outside the kernels.
GLUE = ("pad", "slice", "dynamic_slice", "concatenate", "reshape", "convert_element_type")


def _glue(jaxpr) -> list[str]:
  return [eqn.primitive.name for name in GLUE for eqn in _equations(jaxpr, name)]


# Ragged all-reduces on the 2x4 torus with 16-row blocks. The split schedule's chunk is
# C = 4 streams x R rows x 128 elements, R a whole number of native tiles.
C_32_ROWS = 4 * 32 * 128  # 32-bit, 32 rows per slice: two pieces of 16 rows
C_16_ROWS = 4 * 16 * 128  # 16-bit, one 16-row tile per slice
RAGGED = [
  # The grid's end 40 short of whole: the last chunk's last piece is cut, its tail
  # (under a DMA word) travels by a DMA of its own.
  ("grid-minus-40", 8 * C_32_ROWS - 40, jnp.int32, "on_wait"),
  # 7 past a 4096-element grid: chunks grow to 16 rows per slice, chunks 5-7 are empty.
  ("grid-plus-7", 8 * 4096 + 7, jnp.float32, "eager"),
  ("bf16-ragged", 8 * C_16_ROWS - 300, jnp.bfloat16, "eager"),
  ("fewer-than-devices", 3, jnp.int32, "eager"),
  ("one-element", 1, jnp.float32, "on_wait"),
]


@pytest.mark.parametrize("n,dtype,mode", [c[1:] for c in RAGGED], ids=[c[0] for c in RAGGED])
def test_ragged_all_reduce_matches_lax(n, dtype, mode):
  """Sizes that are no multiple of the grid, of a DMA word or of the devices, against
  lax.psum on small integers: exact (16-bit floats too: their sums stay under 256)."""
  mesh = harness.mesh((2, 4))
  x = _inputs(dtype, (8, n), integers=True)
  want = _per_device(LAX["all_reduce"](AXES), mesh, AXES)(x)
  fn = _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4), config=SMALL_BLOCKS), mesh, AXES)
  with interpret_mode():
    assert _glue(jax.make_jaxpr(fn)(x).jaxpr) == []
  got = interpreted(mode, fn, x)
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


def test_ragged_bfloat16_all_reduce_error_against_float64():
  """Random bfloat16 on a ragged size, bf16 partial sums: within the per-hop bound of
  ``test_bfloat16_error_against_float64`` (4 u sum|x_i|) of the exact sum."""
  mesh, u = harness.mesh((2, 4)), 2.0**-8
  x = _inputs(jnp.bfloat16, (8, 8 * C_16_ROWS - 300), integers=False)
  terms = np.asarray(x, np.float64)
  fn = _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4), config=SMALL_BLOCKS), mesh, AXES)
  got = np.asarray(interpreted("on_wait", fn, x), np.float64)
  assert np.all(np.abs(got - terms.sum(0)[None]) <= 4 * u * np.abs(terms).sum(0))


# Chunks of whole DMA words but not of whole slices: 4480 = 2 slices of 2048 + 384, so
# stream 2 carries a short slice and stream 3 none.
WORD_CHUNKS = [
  ("reduce_scatter", 4480, jnp.int32, "on_wait"),
  ("reduce_scatter", 4096 + 256, jnp.bfloat16, "eager"),
  ("all_gather", 4480, jnp.float32, "eager"),
  ("all_gather", 4096 + 256, jnp.bfloat16, "on_wait"),
]


@pytest.mark.parametrize(
  "collective,m,dtype,mode",
  WORD_CHUNKS,
  ids=[f"{c[0]}-{c[1]}-{jnp.dtype(c[2]).name}-{c[3]}" for c in WORD_CHUNKS],
)
def test_word_aligned_chunks_match_lax_without_glue(collective, m, dtype, mode):
  """Chunks of ``m`` elements, ``m`` whole DMA words (512 bytes): the kernels read and
  write the caller's buffers as they are (no pad or slice in the program), exact on
  integers against lax."""
  mesh, p = harness.mesh((2, 4)), 8
  x = _inputs(dtype, (8, INPUT_ELEMENTS[collective](p, m)), integers=True)
  ours = getattr(kernels, collective)
  fn = _per_device(lambda v: ours(v, AXES, (2, 4), config=SMALL_BLOCKS), mesh, AXES)
  with interpret_mode():
    assert _glue(jax.make_jaxpr(fn)(x).jaxpr) == []
  want = _per_device(LAX[collective](AXES), mesh, AXES)(x)
  got = interpreted(mode, fn, x)
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


def test_too_many_pieces_for_the_semaphores_raises():
  """60 pieces of 16 rows per slice need more DMA semaphores than a kernel may hold: a
  clear error at trace time. Tracing only."""
  mesh = harness.mesh((2, 4))
  n = 8 * 4 * 60 * 16 * 128
  fn = _per_device(lambda v: kernels.all_reduce(v, AXES, (2, 4), config=SMALL_BLOCKS), mesh, AXES)
  with interpret_mode():
    with pytest.raises(ValueError, match="semaphores.*larger KernelConfig"):
      jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((8, n), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmem_add_loops_over_blocks(dtype):
  """The reduce-scatter's add in VMEM, over two whole blocks of ``ADD_BYTES`` and a shorter
  rest, against jnp (16-bit floats added in float32 and rounded once)."""
  block = torus_kernels.ADD_BYTES // jnp.dtype(dtype).itemsize
  n = 2 * block + 384
  x, y = (_inputs(dtype, (n,), integers=False) for _ in range(2))
  y = y * 3

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...]
    torus_kernels.add_in_vmem(o_ref, y_ref, n)

  want = (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)
  with interpret_mode() as params:  # a bare pallas_call takes the parameters itself
    add = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), dtype), interpret=params)
    got = jax.block_until_ready(add(x, y))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def check_against_lax(shape, collective, axes, dtype, chunk, mode):
  """One kernel on a mesh of ``shape`` (integers: exact) against lax."""
  mesh = harness.mesh(shape)
  torus = tuple(mesh.shape[a] for a in axes)
  p = int(np.prod(torus))
  n = INPUT_ELEMENTS[collective](p, chunk)
  x = jnp.asarray(np.random.default_rng(p).integers(-8, 8, size=(mesh.size, n)), dtype)
  want = _per_device(LAX[collective](axes), mesh)(x)
  ours = getattr(kernels, collective)
  got = interpreted(mode, _per_device(lambda v: ours(v, axes, torus, config=SMALL_BLOCKS), mesh), x)
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


@pytest.mark.slow
def test_2x2x4_in_a_subprocess():
  run_as_script(__file__, 16, MARKER)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  # A 4-long axis: phases of several steps, so the capacity handshake runs between phases.
  check_against_lax((2, 2, 4), "all_reduce", ("z", "y", "x"), jnp.int32, 300, "eager")
  print(MARKER)
