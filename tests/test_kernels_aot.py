"""Ahead-of-time compilation of the torus kernels for real TPU generations, on CPU, on 2-D
and 3-D (v4, v5p) topologies (a rank parameter).

Runs the real Mosaic compiler through libtpu (the ``tpu`` extra, which ``make test``
installs). The tests are marked ``aot`` and run with the rest of the suite; ``-m aot`` runs
only them and ``-m "not aot"`` leaves them out. Without libtpu the module is skipped with
that reason in pytest's summary (and CI, which installs the extra, fails instead: see
``test_aot_in_ci``).
A v3 topology is only lowered (with the fallback), never compiled with Pallas: libtpu aborts
the whole process when compiling a Pallas remote DMA for v2/v3.
The 3-D meshes come from ``tc.make_torus_mesh`` over the topology's devices
(``testing.aot.topology_mesh(topology, shape)``), which places each device at its chip
coordinates (v4 exposes two devices per chip: they share the last axis).
"""

import aot_skip
import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("libtpu", reason=aot_skip.REASON)

import torus_collectives as tc
from torus_collectives.testing import aot
from torus_collectives.tuning import tables

pytestmark = pytest.mark.aot

MOSAIC = "tpu_custom_call"


def _mesh_and_axes(topology, shape):
  """The topology's 2-D mesh (shape None) or its torus mesh of ``shape``, and its axes."""
  mesh = aot.topology_mesh(topology, shape)
  return mesh, tuple(mesh.axis_names)


@pytest.mark.parametrize(
  "rank,topology,shape,dtype",
  [
    ("2d", "v5p:2x2x2", None, jnp.int32),
    ("3d", "v4:2x2x2", (2, 2, 4), jnp.bfloat16),
    ("3d", "v5p:2x2x2", (2, 2, 2), jnp.float32),
    ("3d", "v5p:4x4x4", (4, 4, 4), jnp.int32),
  ],
  ids=["2d-v5p:2x2x2", "3d-v4:2x2x2-2x2x4", "3d-v5p:2x2x2", "3d-v5p:4x4x4"],
)
def test_all_reduce_compiles_small(rank, topology, shape, dtype):
  """Both kernels (reduce-scatter, then all-gather) on the split torus (four streams in 2-D,
  six in 3-D), odd size (the floating types at this size on 2-D:
  ``test_ragged_all_reduce_is_the_kernels_alone...``)."""
  mesh, axes = _mesh_and_axes(topology, shape)
  compiled = aot.lower_all_reduce(mesh, 100_003, dtype, "pallas", axes=axes).compile()
  assert compiled.as_text().count(MOSAIC) >= 2


# Per-device elements that fill whole 16-row tiles on 8 and 16 devices with 4 streams, two
# tiles per stream slice: the kernels cut each slab into two pieces.
ALIGNED = 16 * 4 * 2 * 16 * 128


def assert_kernels_alone_at_the_traffic_floor(compiled, devices: int, nbytes: int) -> None:
  """No pad, convert, slice or copy of the buffer outside the kernels (the compiler's
  program), and bytes accessed within 1.05x of the ideal 7 (p-1)/p S (the kernels' part
  declared by them, checked by counting in test_kernel_accounting.py). The one copy
  allowed is XLA moving the result out of the kernel's buffer because it is the program's
  output (a consumer of the result reads it in place); its bytes are not the collective's."""
  glue = aot.glue(compiled)
  output_copy = aot.output_copies(glue)
  assert [g for g in glue if g not in output_copy] == [], aot.describe(glue)
  ideal = aot.ideal_bytes(devices, nbytes)
  assert ideal <= aot.collective_bytes(compiled) <= 1.05 * ideal


# Six streams with whole 16-row tiles on 8 devices (no padding).
ALIGNED_3D = 8 * 6 * 16 * 128 * 4


@pytest.mark.parametrize(
  "rank,topology,shape,dtype,elements",
  [
    ("2d", "v4:2x2x2", None, jnp.float32, ALIGNED),
    ("2d", "v5e:4x4", None, jnp.bfloat16, ALIGNED),
    ("2d", "v5p:2x2x2", None, jnp.bfloat16, ALIGNED),
    ("2d", "v6e:4x4", None, jnp.float32, ALIGNED),
    ("3d", "v5p:2x2x2", (2, 2, 2), jnp.bfloat16, ALIGNED_3D),
  ],
  ids=["2d-v4:2x2x2", "2d-v5e:4x4", "2d-v5p:2x2x2", "2d-v6e:4x4", "3d-v5p:2x2x2"],
)
def test_all_reduce_is_the_kernels_alone_at_the_traffic_floor(
  rank, topology, shape, dtype, elements
):
  mesh, axes = _mesh_and_axes(topology, shape)
  compiled = aot.lower_all_reduce(mesh, elements, dtype, "pallas", axes=axes).compile()
  assert_kernels_alone_at_the_traffic_floor(
    compiled, mesh.size, elements * jnp.dtype(dtype).itemsize
  )


# Per-device elements that are no multiple of the devices, the streams, a tile or a DMA word.
RAGGED = 100_003


@pytest.mark.parametrize("topology", ["v4:2x2x2", "v5e:4x4", "v5p:2x2x2", "v6e:4x4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_all_reduce_is_the_kernels_alone_at_the_traffic_floor(topology, dtype):
  """A ragged size: the kernels handle the buffer's end themselves (no XLA pad before or
  slice after), and declare only the elements that exist."""
  mesh = aot.topology_mesh(topology)
  compiled = aot.lower_all_reduce(mesh, RAGGED, dtype, "pallas").compile()
  assert_kernels_alone_at_the_traffic_floor(compiled, mesh.size, RAGGED * jnp.dtype(dtype).itemsize)


def test_a_consumed_result_is_read_in_place_without_an_output_copy():
  """The output copy the floor tests leave out exists only because the result is the
  program's own output: when the program consumes the result (here a scale, as an
  optimizer update would), XLA reads it straight from the kernels' buffer."""
  mesh = aot.topology_mesh("v5e:4x4")
  spec = P(mesh.axis_names)

  def per_device(v):
    return 2 * tc.all_reduce(v, aot.AXES, implementation="pallas")

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))
  arg = jax.ShapeDtypeStruct((mesh.size * RAGGED,), jnp.float32, sharding=NamedSharding(mesh, spec))
  compiled = fn.lower(arg).compile()
  glue = aot.glue(compiled)
  # The scale alone: one elementwise op (XLA may wrap it in a fusion), and no copy.
  assert [g["op"] for g in glue] in (["multiply"], ["fusion"]), aot.describe(glue)
  nbytes = RAGGED * 4
  scale = 2 * nbytes  # the consumer reads the sum and writes its result
  collective = aot.summary(compiled)["bytes accessed"] - scale
  ideal = aot.ideal_bytes(mesh.size, nbytes)
  assert ideal <= collective <= 1.05 * ideal


@pytest.mark.parametrize(
  "rank,topology,shape,axes",
  [("2d", "v5e:4x4", None, ("y",)), ("3d", "v5p:2x2x2", (2, 4), ("x", "y"))],
  ids=["2d-ring-on-y", "3d-2d-torus-over-a-3d-slice"],
)
def test_torus_of_fewer_axes_compiles(rank, topology, shape, axes):
  """A torus of fewer axes than the topology: the bidirectional ring along one axis of a
  2-D mesh (the other axis in device ids), and a 2-D torus over a 3-D slice."""
  mesh, _ = _mesh_and_axes(topology, shape)
  compiled = aot.lower_all_reduce(mesh, 4096, jnp.float32, "pallas", axes=axes).compile()
  assert compiled.as_text().count(MOSAIC) >= 2


def test_3d_meshes_follow_chip_coordinates():
  mesh = aot.topology_mesh("v5p:4x4x4", (4, 4, 4))
  for index in np.ndindex(4, 4, 4):
    assert tuple(mesh.devices[index].coords) == index
  mesh = aot.topology_mesh("v4:2x2x2", (2, 2, 4))
  for (i, j, k), device in np.ndenumerate(mesh.devices):
    assert (tuple(device.coords), device.core_on_chip) == ((i, j, k // 2), k % 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_resnet50_gradient_is_the_kernels_alone_at_the_traffic_floor(dtype):
  """ResNet-50's gradient (25,557,032 elements, not a multiple of 128) on v5e:4x4."""
  mesh = aot.topology_mesh("v5e:4x4")
  elements = aot.RESNET50_PARAMS
  compiled = aot.lower_all_reduce(mesh, elements, dtype, "pallas").compile()
  assert_kernels_alone_at_the_traffic_floor(
    compiled, mesh.size, elements * jnp.dtype(dtype).itemsize
  )


def test_auto_on_tpu_is_xla_unless_a_table_says_otherwise(tmp_path, monkeypatch):
  """Unmeasured, "auto" lowers XLA's all-reduce; a table entry for the device kind and
  torus turns it into the kernels on v5e; on v3, where Pallas cannot run, it stays XLA."""
  monkeypatch.setenv(tables.ENV_VAR, str(tmp_path / "cache.json"))
  monkeypatch.setattr(tables, "SHIPPED_DIR", tmp_path)
  elements = 2**22  # 16 MiB of float32, above the latency floor of a 4x4 torus
  for topology, uses_pallas in (("v5e:4x4", True), ("v3:4x4", False)):
    mesh = aot.topology_mesh(topology)
    lower = lambda m=mesh: aot.lower_all_reduce(m, elements, jnp.float32, "auto").as_text()
    assert MOSAIC not in lower(), topology
    measured = harness.measured_entry(
      "4x4", "all_reduce", "float32", tables.size_bucket(4 * elements), "pallas"
    )
    kind = mesh.devices.flat[0].device_kind
    tables.use_table(tables.Table(kind, "test", tables.now(), [measured]))
    try:
      assert (MOSAIC in lower()) == uses_pallas, topology
    finally:
      tables.use_table(None)


def test_pallas_on_v3_is_refused_before_compiling():
  with pytest.raises(NotImplementedError, match="TPU v3"):
    aot.lower_all_reduce(aot.topology_mesh("v3:4x4"), 1024, jnp.float32, "pallas")
