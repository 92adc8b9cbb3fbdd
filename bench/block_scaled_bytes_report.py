"""HBM bytes accessed and wire bytes of the int8 block-scaled Pallas all-reduce of
ResNet-50's gradient, against sending the same gradient as bfloat16 on the bfloat16 Pallas
kernels, both compiled and consumed the same way: a markdown table and a JSON file.

  JAX_PLATFORMS=cpu python -m bench.block_scaled_bytes_report [--out PATH] [--json PATH]

``--json`` defaults to ``--out`` with the suffix ``.json``. Each row compiles two programs
ahead of time, with libtpu on a CPU host (``aot.topology_mesh``), over the same v5e
topology's 2-D mesh, on the same gradient: one flat buffer of ``aot.RESNET50_PARAMS``
elements per device, of the row's dtype, in a ``shard_map`` over every mesh axis. The two
programs differ only in the transport; each takes the gradient in its own dtype, returns
the result in that dtype and consumes the sum inside the program (``2 *``, as a train step's
update reads it), so neither has an output copy and neither leaves anything out:

* int8: ``2 * tc.all_reduce(v, AXES, implementation="pallas", transport_dtype=jnp.int8)``
  (the int8 kernel: blocks of 128, bfloat16 scales, sums in the gradient's dtype);
* bfloat16: ``2 * tc.all_reduce(v.astype(bf16), AXES, implementation="pallas").astype(v.dtype)``
  (the cast to bfloat16, the bfloat16 kernels, the cast back; for a bfloat16 gradient the
  casts are no ops and the program is the bfloat16 kernels and the ``2 *``).

Figures, per device; compiler estimates and declarations, not measurements (nothing here
runs on a TPU):

* HBM bytes accessed: XLA's ``compiled.cost_analysis()["bytes accessed"]`` of the whole
  program, the kernels' declared bytes (XLA cannot see inside a Mosaic kernel; the
  declarations are checked DMA by DMA in interpret mode by
  ``tests/test_kernel_accounting.py``) plus XLA's own ops (the casts, the ``2 *``). The
  ratio is int8 program over bfloat16 program.
* of which the kernels: the ``pl.CostEstimate`` bytes accessed of the program's Pallas
  calls (``aot.pallas_calls``); the bfloat16 kernels' are their floor 7 (p-1)/p S.
* wire bytes: the ``pl.CostEstimate`` remote bytes of the same calls, what one device sends
  (priced from the schedule the kernels execute); no HBM traffic, kept apart from it.

``tests/test_quantized_kernels.py`` asserts on these same functions, for every row but
v5e:16x16 float32 (tabulated here only).
"""

from __future__ import annotations

import os

# Compile for TPU topologies on the host's CPU: no TPU backend is needed or wanted.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import quantized_kernels as qk
from torus_collectives.testing import aot
from torus_collectives.tiling import ceil_div

CONFIGS = (
  ("v5e:4x4", "bfloat16"),
  ("v5e:4x4", "float32"),
  ("v5e:16x16", "bfloat16"),
  ("v5e:16x16", "float32"),
)
TRANSPORTS = ("int8", "bfloat16")
MB = 1e6
COMMAND = "JAX_PLATFORMS=cpu python -m bench.block_scaled_bytes_report"
DEFAULT_OUT = pathlib.Path(__file__).parent / "results" / "block_scaled_bytes.md"


def _per_device(mesh: jax.sharding.Mesh, elements: int, fn: Callable, dtype):
  """(jitted program, abstract argument): ``fn`` of each device's ``[elements]`` buffer of
  ``dtype`` in a ``shard_map`` over ``mesh``."""
  spec = P(tuple(mesh.axis_names))
  program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  arg = jax.ShapeDtypeStruct(
    (mesh.size * elements,), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec)
  )
  return program, arg


def compile_per_device(
  topology: str, elements: int, fn: Callable | None = None, dtype=jnp.float32
) -> tuple[jax.sharding.Mesh, object]:
  """(mesh, compiled): ``fn`` of each device's ``[elements]`` buffer of ``dtype``, in a
  ``shard_map`` over ``topology``'s 2-D mesh, compiled ahead of time. ``fn`` defaults to
  the int8 kernel's all-reduce over every mesh axis, its result the program's output."""
  mesh = aot.topology_mesh(topology)
  axes = tuple(mesh.axis_names)
  torus = tuple(mesh.shape[a] for a in axes)
  fn = fn or (lambda v: qk.quantized_all_reduce(v, axes, torus))
  program, arg = _per_device(mesh, elements, fn, dtype)
  return mesh, program.lower(arg).compile()


def declared_cost(mesh: jax.sharding.Mesh, elements: int, dtype):
  """The int8 kernel's declared cost (``pl.CostEstimate``) of the all-reduce of a flat
  ``[elements]`` buffer of ``dtype`` over every axis of ``mesh``, read in place."""
  axes = tuple(mesh.axis_names)
  schedule = schedule_lib.build("all_reduce", tuple(mesh.shape[a] for a in axes), "torus_split")
  width = qk._width(ceil_div(elements, mesh.size), schedule.num_streams)
  lay = qk.QLayout(schedule, width // (schedule.num_streams * 128))
  return qk.cost(schedule, lay, "all_reduce", qk.Flat(elements, jnp.dtype(dtype)))


def consumed_all_reduce(transport: str) -> Callable:
  """The per-device program of one side: the all-reduce over every mesh axis on the Pallas
  kernels, ``transport`` "int8" (block-scaled) or "bfloat16" (cast there and back), its
  result in the input's dtype and consumed by ``2 *``."""
  if transport == "int8":
    return lambda v: (
      2 * tc.all_reduce(v, aot.AXES, implementation="pallas", transport_dtype=jnp.int8)
    )
  if transport == "bfloat16":
    return lambda v: (
      2 * tc.all_reduce(v.astype(jnp.bfloat16), aot.AXES, implementation="pallas").astype(v.dtype)
    )
  raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")


@dataclasses.dataclass(frozen=True)
class Side:
  """One side's compiled program, per device."""

  hbm_bytes: float  # cost_analysis bytes accessed of the whole program
  kernel_bytes: float  # of which the Pallas calls' declared bytes accessed
  wire_bytes: float  # the Pallas calls' declared remote bytes (sent; not HBM)
  ops: tuple[dict, ...]  # XLA's ops outside the kernels (aot.glue)


def measure_side(topology: str, elements: int, dtype, transport: str) -> Side:
  """Compiles ``consumed_all_reduce(transport)`` of ``elements`` of ``dtype`` per device
  over ``topology`` and reads its bytes, and its kernels' declarations from its jaxpr."""
  mesh = aot.topology_mesh(topology)
  program, arg = _per_device(mesh, elements, consumed_all_reduce(transport), dtype)
  compiled = program.lower(arg).compile()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    jaxpr = jax.make_jaxpr(program)(arg).jaxpr
    costs = [eqn.params["cost_estimate"] for eqn in aot.pallas_calls(jaxpr, mesh)]
  return Side(
    aot.summary(compiled)["bytes accessed"],
    sum(c.bytes_accessed for c in costs),
    sum(c.remote_bytes_transferred for c in costs),
    tuple(aot.glue(compiled)),
  )


@dataclasses.dataclass(frozen=True)
class Row:
  topology: str
  dtype: str
  devices: int
  elements: int
  int8: Side
  bf16: Side
  bf16_floor: float  # 7 (p-1)/p S, S the bfloat16 gradient's bytes

  @property
  def hbm_ratio(self) -> float:
    return self.int8.hbm_bytes / self.bf16.hbm_bytes

  @property
  def wire_ratio(self) -> float:
    return self.int8.wire_bytes / self.bf16.wire_bytes


def measure(topology: str, dtype: str, elements: int = aot.RESNET50_PARAMS) -> Row:
  """One row: both sides compiled on ``topology`` for a gradient of ``dtype``."""
  devices = aot.topology_mesh(topology).size
  int8, bf16 = (measure_side(topology, elements, dtype, t) for t in TRANSPORTS)
  return Row(topology, dtype, devices, elements, int8, bf16, aot.ideal_bytes(devices, 2 * elements))


def format_tables(rows: Sequence[Row]) -> str:
  hbm = (
    "| gradient | int8 program (MB) | of which the int8 kernel, declared (MB) "
    "| bf16 program (MB) | of which the bf16 kernels, declared (MB) | int8 / bf16 |"
  )
  wire = "| gradient | int8 kernel sends (MB) | bf16 kernels send (MB) | int8 / bf16 |"
  hbm_lines = [hbm, "|" + "---|" * (hbm.count("|") - 1)]
  wire_lines = [wire, "|" + "---|" * (wire.count("|") - 1)]
  for r in rows:
    config = f"{r.topology}, {r.dtype}"
    hbm_lines.append(
      f"| {config} | {r.int8.hbm_bytes / MB:.1f} | {r.int8.kernel_bytes / MB:.1f} "
      f"| {r.bf16.hbm_bytes / MB:.1f} | {r.bf16.kernel_bytes / MB:.1f} | {r.hbm_ratio:.2f} |"
    )
    wire_lines.append(
      f"| {config} | {r.int8.wire_bytes / MB:.1f} | {r.bf16.wire_bytes / MB:.1f} "
      f"| {r.wire_ratio:.2f} |"
    )
  return "\n".join(
    [
      "HBM bytes accessed per device, whole program (XLA's `cost_analysis`):",
      "",
      *hbm_lines,
      "",
      "Wire bytes per device, sent by the kernels (their declared remote bytes; not HBM):",
      "",
      *wire_lines,
    ]
  )


def format_checks(rows: Sequence[Row]) -> str:
  """Per row and side: XLA's ops outside the kernels, and their bytes (the program's less
  the kernels' declared); the bfloat16 kernels' declared bytes against their floor."""
  lines = []
  for r in rows:
    for name, side in (("int8", r.int8), ("bf16", r.bf16)):
      lines.append(
        f"- {r.topology}, {r.dtype}, {name} program: XLA's ops outside the kernels "
        f"{(side.hbm_bytes - side.kernel_bytes) / MB:.1f} MB: {aot.describe(side.ops)}"
      )
    lines.append(
      f"- {r.topology}, {r.dtype}: bf16 kernels' declared bytes {r.bf16.kernel_bytes / MB:.1f} "
      f"MB, their floor 7 (p-1)/p·S {r.bf16_floor / MB:.1f} MB"
    )
  return "\n".join(lines)


def figures(rows: Sequence[Row]) -> dict:
  """The figures as JSON-ready data: bytes per device, unrounded; ratios int8 / bf16."""

  def side(s: Side) -> dict:
    return {
      "hbm_bytes_accessed": s.hbm_bytes,
      "kernels_declared_hbm_bytes": s.kernel_bytes,
      "xla_ops_hbm_bytes": s.hbm_bytes - s.kernel_bytes,
      "wire_bytes": s.wire_bytes,
    }

  return {
    "command": COMMAND,
    "source": "compiler estimates (ahead-of-time compiles with libtpu on a CPU host), "
    "not measurements",
    "programs": {
      "int8": "2 * tc.all_reduce(v, ('x', 'y'), implementation='pallas', transport_dtype=jnp.int8)",
      "bf16": "2 * tc.all_reduce(v.astype(jnp.bfloat16), ('x', 'y'), "
      "implementation='pallas').astype(v.dtype)",
    },
    "units": "bytes per device",
    "hbm_bytes_accessed": "compiled.cost_analysis()['bytes accessed'] of the whole program",
    "wire_bytes": "the Pallas calls' declared remote bytes (pl.CostEstimate), not HBM",
    "rows": [
      {
        "topology": r.topology,
        "gradient_dtype": r.dtype,
        "devices": r.devices,
        "elements_per_device": r.elements,
        "int8": side(r.int8),
        "bf16": side(r.bf16),
        "bf16_floor_hbm_bytes": r.bf16_floor,
        "hbm_ratio_int8_to_bf16": r.hbm_ratio,
        "wire_ratio_int8_to_bf16": r.wire_ratio,
      }
      for r in rows
    ],
  }


def report(configs=CONFIGS) -> tuple[str, dict, float]:
  """The markdown report (title, how it was made, tables, checks), its figures as JSON-ready
  data, and the seconds it took."""
  start = time.perf_counter()
  rows = [measure(topology, dtype) for topology, dtype in configs]
  seconds = time.perf_counter() - start
  how = (
    f"`{COMMAND}`. Compiler estimates, not measurements: ahead-of-time compiles for v5e "
    "topologies with libtpu on a CPU host, nothing run on a TPU. Both sides are whole "
    "programs over the same mesh and the same gradient, ResNet-50's "
    f"({aot.RESNET50_PARAMS:,} elements, one buffer per device), taken in the "
    "gradient's dtype, returned in it and consumed inside the program by `2 *` (as an "
    "update reads the sum, so no output copy on either side): int8 is "
    '`2 * tc.all_reduce(v, axes, implementation="pallas", transport_dtype=jnp.int8)` '
    "(the int8 block-scaled kernel: blocks of 128, bfloat16 scales); bf16 is "
    '`2 * tc.all_reduce(v.astype(jnp.bfloat16), axes, implementation="pallas")'
    ".astype(v.dtype)` (the cast to bfloat16, the bfloat16 kernels, the cast back; no casts "
    "for a bfloat16 gradient). HBM bytes accessed: XLA's `cost_analysis` of the whole "
    "program, per device: the kernels' declared bytes (`pl.CostEstimate`; XLA cannot see "
    "inside them) plus XLA's ops (the casts, the `2 *`). The ratio is the int8 program's "
    "over the bf16 program's. Wire bytes: what one device's kernels send, their declared "
    "remote bytes, no part of the HBM figures. MB: 10⁶ bytes."
  )
  title = "# Int8 block-scaled all-reduce against bfloat16 transport: ResNet-50's gradient"
  text = "\n".join([title, "", how, "", format_tables(rows), "", format_checks(rows), ""])
  return text, figures(rows), seconds


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="markdown file")
  parser.add_argument("--json", type=pathlib.Path, help="JSON file (default: --out, .json)")
  args = parser.parse_args(argv)
  json_path = args.json or args.out.with_suffix(".json")
  text, data, seconds = report()
  print(text)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(text)
  json_path.parent.mkdir(parents=True, exist_ok=True)
  json_path.write_text(json.dumps(data, indent=2) + "\n")
  print(f"wrote {args.out} and {json_path} ({seconds:.0f} s)")


if __name__ == "__main__":
  main()
