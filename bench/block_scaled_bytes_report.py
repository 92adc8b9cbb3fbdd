"""Compiled bytes of the int8 block-scaled Pallas all-reduce at ResNet-50's gradient size,
against the bfloat16 kernels, as a markdown table.

  JAX_PLATFORMS=cpu python -m bench.block_scaled_bytes_report [--out PATH]

Each row compiles ahead of time, with libtpu on a CPU host (``aot_report.topology_mesh``),
``quantized_all_reduce`` (int8 blocks of 128, bfloat16 scales) of ResNet-50's gradient
(``aot_report.RESNET50_PARAMETERS`` elements, one flat buffer per device) inside a
``shard_map`` over a v5e topology, and reads XLA's ``cost_analysis`` bytes accessed less
the program's output copy (``aot_report.collective_bytes``: a consumer of the result reads
it in place). These are compiler estimates, not measurements: nothing here runs on a TPU.
The kernel's share is what it declares (``quantized_kernels.cost``, checked DMA by DMA in
interpret mode by ``tests/test_kernel_accounting.py``); XLA cannot see inside it.

Two references:

* the bfloat16 blocking kernels' floor 7 (p-1)/p S, S the bfloat16 gradient's bytes
  (``aot_report.ideal_bytes``), which those kernels reach (``tests/test_kernels_aot.py``);
* for a float32 gradient, sending it as bfloat16: the compiled bytes accessed of the whole
  program that casts it to bfloat16, all-reduces it on the Pallas kernels and casts the
  sum back to float32 (it has no output copy to take off: the cast back writes the result).

``tests/test_quantized_kernels.py`` asserts on these same functions, for every row but
v5e:16x16 float32 (tabulated here only): no op around the kernel but the output copy, the
compiled bytes within 64 KB above the declared ones, and a ratio of at most 0.6 against
the floor for bfloat16 gradients and against the bfloat16 transport for float32 ones.
"""

from __future__ import annotations

import os

# Compile for TPU topologies on the host's CPU: no TPU backend is needed or wanted.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from bench import aot_report, markdown_report
from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import quantized_kernels as qk
from torus_collectives.layout import ceil_div

CONFIGS = (
  ("v5e:4x4", "bfloat16"),
  ("v5e:4x4", "float32"),
  ("v5e:16x16", "bfloat16"),
  ("v5e:16x16", "float32"),
)
MB = 1e6
DEFAULT_OUT = pathlib.Path(__file__).parent / "results" / "block_scaled_bytes.md"


def compile_per_device(
  topology: str, elements: int, fn: Callable | None = None, dtype=jnp.float32
) -> tuple[jax.sharding.Mesh, object]:
  """(mesh, compiled): ``fn`` of each device's ``[elements]`` buffer of ``dtype``, in a
  ``shard_map`` over ``topology``'s 2-D mesh, compiled ahead of time. ``fn`` defaults to
  the int8 kernel's all-reduce over every mesh axis."""
  mesh = aot_report.topology_mesh(topology)
  axes = tuple(mesh.axis_names)
  torus = tuple(mesh.shape[a] for a in axes)
  spec = P(axes)
  fn = fn or (lambda v: qk.quantized_all_reduce(v, axes, torus))
  program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  arg = jax.ShapeDtypeStruct(
    (mesh.size * elements,), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec)
  )
  return mesh, program.lower(arg).compile()


def declared_cost(mesh: jax.sharding.Mesh, elements: int, dtype):
  """The int8 kernel's declared cost (``pl.CostEstimate``) of the all-reduce of a flat
  ``[elements]`` buffer of ``dtype`` over every axis of ``mesh``, read in place."""
  axes = tuple(mesh.axis_names)
  schedule = schedule_lib.build("all_reduce", tuple(mesh.shape[a] for a in axes), "torus_split")
  width = qk._width(ceil_div(elements, mesh.size), schedule.num_streams)
  lay = qk.QLayout(schedule, width // (schedule.num_streams * 128))
  return qk.cost(schedule, lay, "all_reduce", qk.Flat(elements, jnp.dtype(dtype)))


def bf16_transport_bytes(topology: str, elements: int) -> float:
  """Compiled bytes accessed of the bfloat16-transport all-reduce of a float32 buffer on
  the Pallas kernels: the cast to bfloat16, the bfloat16 kernels, the cast back."""

  def summed(v):
    return tc.all_reduce(v.astype(jnp.bfloat16), aot_report.AXES, implementation="pallas").astype(
      jnp.float32
    )

  _, compiled = compile_per_device(topology, elements, fn=summed)
  return aot_report.summary(compiled)["bytes accessed"]


@dataclasses.dataclass(frozen=True)
class Row:
  topology: str
  dtype: str
  int8_bytes: float  # the int8 program's bytes accessed less its output copy
  declared_bytes: float  # the kernel's declared bytes accessed
  other_ops: str  # ops XLA puts around the kernel besides the output copy ("none")
  bf16_floor: float  # 7 (p-1)/p S of the bfloat16 gradient
  bf16_transport: float | None  # float32 rows: cast, bfloat16 kernels, cast back


def measure(topology: str, dtype: str, elements: int = aot_report.RESNET50_PARAMETERS) -> Row:
  """One row: the int8 kernel's compile, and its references, on ``topology``."""
  mesh, compiled = compile_per_device(topology, elements, dtype=dtype)
  glue = aot_report.glue(compiled)
  others = [g for g in glue if g not in aot_report.output_copies(glue)]
  return Row(
    topology,
    dtype,
    aot_report.collective_bytes(compiled),
    declared_cost(mesh, elements, dtype).bytes_accessed,
    aot_report.describe(others),
    aot_report.ideal_bytes(mesh.size, 2 * elements),
    bf16_transport_bytes(topology, elements) if dtype == "float32" else None,
  )


def format_table(rows: Sequence[Row]) -> str:
  header = (
    "| config | int8 kernel bytes (MB) | bf16 kernels' floor 7(p-1)/p·S (MB) | ratio "
    "| bf16 transport of the f32 gradient: cast, bf16 kernels, cast back (MB) | ratio |"
  )
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for r in rows:
    transport = (
      ("-", "-")
      if r.bf16_transport is None
      else (f"{r.bf16_transport / MB:.1f}", f"{r.int8_bytes / r.bf16_transport:.2f}")
    )
    lines.append(
      f"| {r.topology}, {r.dtype} gradient | {r.int8_bytes / MB:.1f} | {r.bf16_floor / MB:.1f} "
      f"| {r.int8_bytes / r.bf16_floor:.2f} | {transport[0]} | {transport[1]} |"
    )
  return "\n".join(lines)


def format_checks(rows: Sequence[Row]) -> str:
  """Per row: the compiled bytes above the kernel's declared ones, and the other ops."""
  return "\n".join(
    f"- {r.topology}, {r.dtype}: compiled - declared = "
    f"{(r.int8_bytes - r.declared_bytes) / 1024:.1f} KB; ops around the kernel besides "
    f"the output copy: {r.other_ops}"
    for r in rows
  )


def report(configs=CONFIGS) -> tuple[str, float]:
  """The markdown report (title, how it was made, table, checks) and the seconds it took."""
  start = time.perf_counter()
  rows = [measure(topology, dtype) for topology, dtype in configs]
  seconds = time.perf_counter() - start
  how = (
    "`python -m bench.block_scaled_bytes_report`. Compiler estimates, not measurements: "
    "XLA's `cost_analysis` bytes accessed per device of ahead-of-time compiles for v5e "
    "topologies on a CPU host (libtpu), nothing run on a TPU. The int8 block-scaled Pallas "
    "all-reduce (blocks of 128, bfloat16 scales) of ResNet-50's gradient "
    f"({aot_report.RESNET50_PARAMETERS:,} elements as one buffer per device), less the "
    "program's output copy, against the bfloat16 blocking kernels' floor 7 (p-1)/p·S "
    "(S: the bfloat16 gradient's bytes) and, for a float32 gradient, against the whole "
    "program that casts it to bfloat16, all-reduces it on the bfloat16 Pallas kernels and "
    "casts the sum back. MB: 10⁶ bytes."
  )
  title = "# Int8 block-scaled all-reduce: compiled bytes at ResNet-50's gradient size"
  text = "\n".join([title, "", how, "", format_table(rows), "", format_checks(rows), ""])
  return text, seconds


def main(argv: Sequence[str] | None = None) -> None:
  markdown_report.main(argv, __doc__.split("\n\n")[0], DEFAULT_OUT, report)


if __name__ == "__main__":
  main()
