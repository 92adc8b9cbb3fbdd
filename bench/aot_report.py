"""Ahead-of-time compilation of the torus all-reduce for real TPU generations, on any host.

With libtpu installed (the ``tpu`` extra) and ``JAX_PLATFORMS=cpu``, jax can compile for a
TPU topology it does not have. This report compiles ``tc.all_reduce`` of one flat gradient
inside a ``shard_map`` over such a topology and prints what XLA's cost and memory analyses
say about the Pallas kernels against XLA's own ``psum``, the bytes accessed against the
ideal 7 (p-1)/p S, the kernels' declared wire bytes against the bound 2 (p-1)/p S, and
every op XLA wraps around the kernels (``glue``). These are compiler estimates, not
measurements: nothing here runs on a TPU. The kernels' part of the bytes is what they
declare (XLA cannot see inside a Mosaic kernel); ``tests/test_kernel_accounting.py``
checks the declarations by counting every DMA in TPU interpret mode. The helpers that
compile and read the program, which the tests use too, are
``torus_collectives.testing.aot``.

    JAX_PLATFORMS=cpu python -m bench.aot_report                       # v5e:16x16, ResNet-50
    JAX_PLATFORMS=cpu python -m bench.aot_report --topology=v6e:4x4 --elements=1000000
    JAX_PLATFORMS=cpu python -m bench.aot_report --topology=v5p:4x4x4 --mesh=4x4x4  # 3-D torus

Never pass a v2/v3 topology with ``implementation="pallas"``: libtpu aborts the process
when compiling a Pallas remote DMA for those generations (the kernels refuse them first).
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from torus_collectives.cost_model import RESNET50_PARAMS
from torus_collectives.sizes import size_label
from torus_collectives.testing.aot import (
  collective_bytes,
  declared_wire_bytes,
  describe,
  glue,
  ideal_bytes,
  lower_all_reduce,
  summary,
  topology_mesh,
  wire_bound,
)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:16x16")
  parser.add_argument(
    "--elements",
    type=int,
    default=RESNET50_PARAMS,
    help="gradient elements per device (default: ResNet-50)",
  )
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument(
    "--mesh", default=None, help="mesh shape such as 4x4x4 (default: 2-D, as square as can be)"
  )
  args = parser.parse_args(argv)
  shape = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else None
  mesh = topology_mesh(args.topology, shape)
  axes, p = tuple(mesh.axis_names), mesh.size
  print(
    f"{args.topology}: mesh {dict(mesh.shape)}, all-reduce of {args.elements:,} elements "
    "per device (XLA compiler estimates, not measurements)"
  )
  for dtype in args.dtypes.split(","):
    nbytes = args.elements * jnp.dtype(dtype).itemsize
    compiled = {
      impl: lower_all_reduce(mesh, args.elements, dtype, impl, axes).compile()
      for impl in ("pallas", "xla")
    }
    rows = {impl: summary(c) for impl, c in compiled.items()}
    print(f"\n{dtype}  ({size_label(nbytes)})")
    print(f"  {'':22s}{'pallas torus':>18s}{'xla psum':>18s}")
    for key in rows["xla"]:
      print(f"  {key:22s}{rows['pallas'][key]:18,.0f}{rows['xla'][key]:18,.0f}")
    ideal = ideal_bytes(p, nbytes)
    pallas_bytes = rows["pallas"]["bytes accessed"]
    collective = collective_bytes(compiled["pallas"])
    print(f"  ideal 7(p-1)/p S       {ideal:18,.0f}   pallas / ideal = {pallas_bytes / ideal:.3f}")
    print(
      f"  less output copies     {collective:18,.0f}   pallas / ideal = {collective / ideal:.3f}"
    )
    wire = declared_wire_bytes(mesh, args.elements, dtype, axes)
    bound = wire_bound(p, nbytes)
    print(f"  wire bytes per device  {wire:18,.0f}   bound 2(p-1)/p S = {bound:,.0f}")
    print("  glue around the kernels:", describe(glue(compiled["pallas"])))
  print(
    "\nBytes accessed: the kernels' HBM traffic as they declare it (pl.CostEstimate, priced "
    "from the schedule, checked by counting in TPU interpret mode) plus XLA's glue;\nXLA's "
    "all-reduce estimate counts only its operand and result, not the traffic inside the "
    "collective."
  )


if __name__ == "__main__":
  main()
