"""Block-scaled transport compiled ahead of time for a two-slice v5e (``v5e:2x2`` x 2,
slices joined by the data-centre network): with ``{"dcn": jnp.int8}`` what crosses
between the slices (XLA's megascale host-transfer ``send``s) is int8 values and bfloat16
scales only, and what moves inside a slice (ICI ``collective-permute``s) is float32.
Compiler output, not a run: nothing here executes on a TPU."""

import re

import aot_skip
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("libtpu", reason=aot_skip.REASON)

import torus_collectives as tc

pytestmark = pytest.mark.aot

NAMES = ("dcn", "x", "y")


def _two_slice_mesh() -> Mesh:
  """(dcn, x, y) = (2, 2, 2) over two v5e:2x2 slices, the slice index outermost."""
  topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", num_slices=2)
  devices = sorted(topology.devices, key=lambda d: (d.slice_index, d.coords[1], d.coords[0]))
  return Mesh(np.array(devices).reshape(2, 2, 2), NAMES, axis_types=(AxisType.Auto,) * 3)


def _element_types(hlo: str, op: str) -> set[str]:
  """The element types that the ``op`` instructions of ``hlo`` move."""
  pattern = re.compile(rf"=\s*\(?([a-z]+\d*)\[[^=]*\s{re.escape(op)}\(")
  return {m.group(1) for line in hlo.splitlines() if (m := pattern.search(line))}


def test_int8_crosses_the_slices_and_floats_stay_inside():
  mesh = _two_slice_mesh()
  spec = P(NAMES)

  def per_device(v):
    return tc.all_reduce_gradients(v, NAMES, transport_dtype={"dcn": jnp.int8})

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  arg = jax.ShapeDtypeStruct((8 * 65536,), jnp.float32, sharding=NamedSharding(mesh, spec))
  hlo = fn.lower(arg).compile().as_text()
  assert "xla_megascale_runtime" in hlo, "no transfer between the slices"
  assert _element_types(hlo, "send") == {"s8", "bf16"}  # int8 values, bfloat16 scales
  assert _element_types(hlo, "recv") == {"s8", "bf16"}
  assert _element_types(hlo, "collective-permute-start") == {"f32"}
