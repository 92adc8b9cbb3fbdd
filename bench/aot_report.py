"""Ahead-of-time compilation of the torus all-reduce for real TPU generations, on any host.

With libtpu installed (the ``tpu`` extra) and ``JAX_PLATFORMS=cpu``, jax can compile for a
TPU topology it does not have. This module compiles ``tc.all_reduce`` of one flat gradient
inside a ``shard_map`` over such a topology and prints what XLA's cost and memory analyses
say about the Pallas kernels against XLA's own ``psum``, the bytes accessed against the
ideal 7 (p-1)/p S, the kernels' declared wire bytes against the bound 2 (p-1)/p S, and
every op XLA wraps around the kernels (``glue``). These are compiler estimates, not
measurements: nothing here runs on a TPU. The kernels' part of the bytes is what they
declare (XLA cannot see inside a Mosaic kernel); ``tests/test_kernel_accounting.py``
checks the declarations by counting every DMA in TPU interpret mode.

    JAX_PLATFORMS=cpu python -m bench.aot_report                       # v5e:16x16, ResNet-50
    JAX_PLATFORMS=cpu python -m bench.aot_report --topology=v6e:4x4 --elements=1000000
    JAX_PLATFORMS=cpu python -m bench.aot_report --topology=v5p:4x4x4 --mesh=4x4x4  # 3-D torus

Never pass a v2/v3 topology with ``implementation="pallas"``: libtpu aborts the process
when compiling a Pallas remote DMA for those generations (the kernels refuse them first).
"""

from __future__ import annotations

import argparse
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import primitives
from torus_collectives.cost_model import RESNET50_PARAMS
from torus_collectives.sizes import size_label
from torus_collectives.topology import most_square_shape

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


def all_reduce_program(
  mesh: Mesh, elements: int, dtype, implementation: str, axes: tuple[str, ...] = AXES, config=None
):
  """(jitted fn, abstract argument): ``tc.all_reduce`` over ``axes`` of a per-device
  ``[elements]`` buffer on ``mesh`` (every device holds its own buffer; the reduction spans
  ``axes`` only)."""
  spec = P(mesh.axis_names)

  def per_device(v):
    return tc.all_reduce(v, axes, implementation=implementation, config=config)

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  arg = jax.ShapeDtypeStruct(
    (mesh.size * elements,), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec)
  )
  return fn, arg


def lower_all_reduce(
  mesh: Mesh, elements: int, dtype, implementation: str, axes: tuple[str, ...] = AXES, config=None
):
  """``all_reduce_program`` lowered for ``mesh``."""
  fn, arg = all_reduce_program(mesh, elements, dtype, implementation, axes, config)
  return fn.lower(arg)


def declared_wire_bytes(
  mesh: Mesh, elements: int, dtype, axes: tuple[str, ...] = AXES, config=None
) -> int:
  """Bytes one device sends in the Pallas all-reduce over ``axes``: the kernels' declared
  remote bytes (priced from the schedule they execute)."""
  fn, arg = all_reduce_program(mesh, elements, dtype, "pallas", axes, config)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    jaxpr = jax.make_jaxpr(fn)(arg).jaxpr
    return sum(
      eqn.params["cost_estimate"].remote_bytes_transferred for eqn in pallas_calls(jaxpr, mesh)
    )


def pallas_calls(jaxpr, mesh):
  """Every pallas_call equation of ``jaxpr``, a program over ``mesh``: in its sub-jaxprs
  (scan bodies, jit calls), and in the torus primitives, whose kernels appear only when
  they lower: each is traced as its lowering in a ``shard_map`` of its own. A generator:
  consume it in the context (interpret mode, abstract mesh) the program was traced in."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    elif eqn.primitive in primitives.PRIMITIVES.values():
      kind = eqn.primitive.name.removeprefix("torus_")
      (aval,) = (v.aval for v in eqn.invars)
      spec = P(mesh.axis_names)
      lowered = jax.shard_map(
        lambda v, kind=kind, params=eqn.params: primitives.lowering(kind, v[0], **params)[None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
      )
      per_device = jax.ShapeDtypeStruct((mesh.size, *aval.shape), aval.dtype)
      yield from pallas_calls(jax.make_jaxpr(lowered)(per_device).jaxpr, mesh)
    else:
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from pallas_calls(sub, mesh)


def ideal_bytes(devices: int, nbytes: int) -> float:
  """HBM bytes a ring reduce-scatter + all-gather of ``nbytes`` must access per device:
  per element sent, the RS reads it to send, writes it on arrival, reads both terms and
  writes their sum (5); the AG reads and writes it (2); each sends (p-1)/p of the buffer."""
  return 7 * (devices - 1) / devices * nbytes


def wire_bound(devices: int, nbytes: int) -> float:
  """Bytes each device must send for an all-reduce of ``nbytes``."""
  return 2 * (devices - 1) / devices * nbytes


# Ops that move no data (views, tuples, the kernels themselves) or only scalars.
_FREE_OPS = {"parameter", "bitcast", "get-tuple-element", "tuple", "custom-call", "constant"}
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")


def glue(compiled, min_elements: int = 1024) -> list[dict]:
  """HLO instructions of the entry computation, outside the Pallas kernels, that produce an
  array of at least ``min_elements`` elements: the pads, converts, slices, copies and
  fusions XLA wraps around the kernels (the kernels' own small scalar operands excepted).

  Each is ``{"op", "name", "elements", "bytes", "root"}``, ``bytes`` its result size
  (its operands are about as large). A ``root`` copy is XLA moving a kernel's result out
  of the kernel's buffer because it is the program's result; a program that consumes the
  result (an optimizer update, say) reads it in place instead.
  """
  text = compiled.as_text()
  entry = text[text.index("\nENTRY") :]
  found = []
  for line in entry.splitlines()[1:]:
    if line.startswith("}"):
      break
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    root, name, dtype, dims, opcode = match.groups()
    elements = math.prod(int(d) for d in dims.split(",") if d)
    if opcode not in _FREE_OPS and elements >= min_elements:
      itemsize = int(re.sub(r"\D", "", dtype) or 8) // 8
      found.append(
        {
          "op": opcode,
          "name": name,
          "elements": elements,
          "bytes": elements * itemsize,
          "root": bool(root),
        }
      )
  return found


def output_copies(ops: list[dict]) -> list[dict]:
  """The ``glue`` entries that are XLA copying the program's result out of a kernel's
  buffer (``root`` copies): a consumer of the result would read it in place."""
  return [g for g in ops if g["root"] and g["op"] == "copy"]


def collective_bytes(compiled) -> float:
  """Bytes accessed by the program less its output copies' (operand and result)."""
  copies = output_copies(glue(compiled))
  return summary(compiled)["bytes accessed"] - 2 * sum(g["bytes"] for g in copies)


def describe(ops: list[dict]) -> str:
  return (
    ", ".join(
      f"{'ROOT ' if g['root'] else ''}{g['op']} {g['name']} ({g['elements']:,} elements)"
      for g in ops
    )
    or "none"
  )


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
