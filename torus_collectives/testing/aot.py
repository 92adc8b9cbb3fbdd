"""Ahead-of-time compiles of the torus all-reduce for real TPU topologies, on any host.

With libtpu installed (the ``tpu`` extra) and ``JAX_PLATFORMS=cpu``, jax can compile for a
TPU topology it does not have (``topology_mesh``). These helpers build the program the
tests and reports compile (``tc.all_reduce`` of one flat per-device buffer inside a
``shard_map``: ``all_reduce_program``, ``lower_all_reduce``), find its Pallas calls and
their declared costs (``pallas_calls``, ``declared_wire_bytes``), read the compiled HLO's
entry computation for the ops XLA wraps around the kernels (``glue``, ``output_copies``,
``describe``) and its cost and memory analyses (``summary``, ``collective_bytes``), and
give the bounds they are held to: the ideal HBM bytes 7 (p-1)/p S (``ideal_bytes``) and
the wire bytes 2 (p-1)/p S (``wire_bound``). Everything is a compiler estimate: nothing
here runs on a TPU. ``bench/aot_report.py`` prints them as a table.

Importing this module needs only jax; compiling for a topology needs libtpu, and fails
without it where ``topology_mesh`` asks jax for the topology.

Never pass a v2/v3 topology with ``implementation="pallas"``: libtpu aborts the process
when compiling a Pallas remote DMA for those generations (the kernels refuse them first).
"""

from __future__ import annotations

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
from torus_collectives.cost_model import RESNET50_PARAMS as RESNET50_PARAMS  # re-exported
from torus_collectives.topology import most_square_shape

# The mesh axes of ``topology_mesh``'s 2-D meshes; ``RESNET50_PARAMS`` (ResNet-50's gradient,
# from ``cost_model``) is the size the tests and reports compile most.
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
