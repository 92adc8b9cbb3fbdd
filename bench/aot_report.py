"""Ahead-of-time compilation of the torus all-reduce for real TPU generations, on any host.

With libtpu installed (the ``tpu`` extra) and ``JAX_PLATFORMS=cpu``, jax can compile for a
TPU topology it does not have. This module compiles ``tc.all_reduce`` of one flat gradient
inside a ``shard_map`` over such a topology and prints what XLA's cost and memory analyses
say about the Pallas kernels against XLA's own ``psum``. These are compiler estimates, not
measurements: nothing here runs on a TPU.

    JAX_PLATFORMS=cpu python -m bench.aot_report                       # v5e:16x16, ResNet-50
    JAX_PLATFORMS=cpu python -m bench.aot_report --topology=v6e:4x4 --elements=1000000
    JAX_PLATFORMS=cpu python -m bench.aot_report --topology=v5p:4x4x4 --mesh=4x4x4  # 3-D torus

Never pass a v2/v3 topology with ``implementation="pallas"``: libtpu aborts the process
when compiling a Pallas remote DMA for those generations (the kernels refuse them first).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.topology import most_square_shape

# Trainable parameters of ResNet-50 (ImageNet, 1000 classes): its gradient's size.
RESNET50_PARAMETERS = 25_557_032
AXES = ("x", "y")


def topology_mesh(topology_name: str, shape: tuple[int, ...] | None = None) -> Mesh:
  """A 2-D ("x", "y") mesh over a TPU topology's devices, as square as their count allows,
  or a ``tc.make_torus_mesh`` of ``shape`` (axes "x", "y", "z") placed by chip coordinates."""
  devices = np.array(
    topologies.get_topology_desc(platform="tpu", topology_name=topology_name).devices
  )
  if shape is not None:
    return tc.make_torus_mesh(shape, ("x", "y", "z")[: len(shape)], devices=list(devices))
  # Plain device order: v4 exposes two devices per chip, which mesh_utils refuses to lay out.
  shape = most_square_shape(devices.size)
  return Mesh(devices.reshape(shape), AXES, axis_types=(AxisType.Auto,) * 2)


def lower_all_reduce(
  mesh: Mesh, elements: int, dtype, implementation: str, axes: tuple[str, ...] = AXES
):
  """``tc.all_reduce`` over ``axes`` of a per-device ``[elements]`` buffer, lowered for
  ``mesh`` (every device holds its own buffer; the reduction spans ``axes`` only)."""
  spec = P(mesh.axis_names)

  def per_device(v):
    return tc.all_reduce(v, axes, implementation=implementation)

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  arg = jax.ShapeDtypeStruct(
    (mesh.size * elements,), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec)
  )
  return fn.lower(arg)


def summary(compiled) -> dict[str, float]:
  """The headline figures of a compiled executable's cost and memory analyses."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  memory = compiled.memory_analysis()
  return {
    "bytes accessed": cost.get("bytes accessed", float("nan")),
    "flops": cost.get("flops", 0.0),
    "argument bytes": memory.argument_size_in_bytes,
    "output bytes": memory.output_size_in_bytes,
    "temp bytes": memory.temp_size_in_bytes,
    "generated code bytes": memory.generated_code_size_in_bytes,
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:16x16")
  parser.add_argument(
    "--elements",
    type=int,
    default=RESNET50_PARAMETERS,
    help="gradient elements per device (default: ResNet-50)",
  )
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument(
    "--mesh", default=None, help="mesh shape such as 4x4x4 (default: 2-D, as square as can be)"
  )
  args = parser.parse_args(argv)
  shape = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else None
  mesh = topology_mesh(args.topology, shape)
  axes = tuple(mesh.axis_names)
  print(
    f"{args.topology}: mesh {dict(mesh.shape)}, all-reduce of {args.elements:,} elements "
    "per device (XLA compiler estimates, not measurements)"
  )
  for dtype in args.dtypes.split(","):
    rows = {
      impl: summary(lower_all_reduce(mesh, args.elements, dtype, impl, axes).compile())
      for impl in ("pallas", "xla")
    }
    print(f"\n{dtype}  ({args.elements * jnp.dtype(dtype).itemsize / 2**20:.1f} MiB)")
    print(f"  {'':22s}{'pallas torus':>18s}{'xla psum':>18s}")
    for key in rows["xla"]:
      print(f"  {key:22s}{rows['pallas'][key]:18,.0f}{rows['xla'][key]:18,.0f}")
  print(
    "\nBytes accessed: the kernels' HBM traffic is priced from the schedule (their "
    "pl.CostEstimate) plus XLA's glue;\nXLA's all-reduce estimate counts only its "
    "operand and result, not the traffic inside the collective."
  )


if __name__ == "__main__":
  main()
