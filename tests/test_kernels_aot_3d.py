"""Ahead-of-time compilation of the kernels on 3-D TPU topologies (v4, v5p), on CPU.

Runs the real Mosaic compiler through libtpu (the ``tpu`` extra, which ``make test``
installs). The tests are marked ``aot`` and run with the rest of the suite; ``-m aot`` runs
only them and ``-m "not aot"`` leaves them out. Without libtpu the module is skipped with
that reason in pytest's summary (and CI, which installs the extra, fails instead: see
``test_aot_in_ci``).
The meshes come from ``tc.make_torus_mesh`` over the topology's devices, which places each
device at its chip coordinates (v4 exposes two devices per chip: they share the last axis).
"""

import aot_skip
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason=aot_skip.REASON)

from jax.experimental import topologies

import torus_collectives as tc
from bench import aot_report

pytestmark = pytest.mark.aot

MOSAIC = "tpu_custom_call"
XYZ = ("x", "y", "z")


def _devices(topology):
  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices


def _compiles(mesh, axes, elements, dtype):
  compiled = aot_report.lower_all_reduce(mesh, elements, dtype, "pallas", axes=axes).compile()
  return compiled.as_text().count(MOSAIC)


@pytest.mark.parametrize(
  "topology,shape,dtype",
  [
    ("v4:2x2x2", (2, 2, 4), jnp.bfloat16),
    ("v5p:2x2x2", (2, 2, 2), jnp.float32),
    ("v5p:4x4x4", (4, 4, 4), jnp.int32),
  ],
)
def test_split_3d_all_reduce_compiles(topology, shape, dtype):
  """Both kernels (reduce-scatter, then all-gather) on six streams, odd size."""
  mesh = tc.make_torus_mesh(shape, XYZ, devices=_devices(topology))
  assert _compiles(mesh, XYZ, 100_003, dtype) >= 2


def test_2d_torus_over_a_3d_slice_compiles():
  mesh = tc.make_torus_mesh((2, 4), ("x", "y"), devices=_devices("v5p:2x2x2"))
  assert _compiles(mesh, ("x", "y"), 4096, jnp.float32) >= 2


def test_3d_meshes_follow_chip_coordinates():
  mesh = tc.make_torus_mesh((4, 4, 4), XYZ, devices=_devices("v5p:4x4x4"))
  for index in np.ndindex(4, 4, 4):
    assert tuple(mesh.devices[index].coords) == index
  mesh = tc.make_torus_mesh((2, 2, 4), XYZ, devices=_devices("v4:2x2x2"))
  for (i, j, k), device in np.ndenumerate(mesh.devices):
    assert (tuple(device.coords), device.core_on_chip) == ((i, j, k // 2), k % 2)


def test_split_3d_all_reduce_is_the_kernels_alone_at_the_traffic_floor():
  """As the 2-D floor test in test_kernels_aot: six streams with whole 16-row tiles (no
  padding), no glue but the program's output copy, bytes within 1.05x of 7 (p-1)/p S."""
  mesh = tc.make_torus_mesh((2, 2, 2), XYZ, devices=_devices("v5p:2x2x2"))
  elements = 8 * 6 * 16 * 128 * 4
  compiled = aot_report.lower_all_reduce(mesh, elements, jnp.bfloat16, "pallas", XYZ).compile()
  glue = aot_report.glue(compiled)
  output_copy = [g for g in glue if g["root"] and g["op"] == "copy"]
  assert [g for g in glue if g not in output_copy] == [], aot_report.describe(glue)
  collective = aot_report.summary(compiled)["bytes accessed"] - 2 * sum(
    g["bytes"] for g in output_copy
  )
  ideal = aot_report.ideal_bytes(mesh.size, elements * 2)
  assert ideal <= collective <= 1.05 * ideal
