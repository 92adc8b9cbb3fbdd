"""What jax's own scheduling mechanisms do to a data-parallel step, compiled for a TPU:
``jax.experimental.overlap.program_order``, the async collectives (``psum_start``,
``lax.psum_scatter_start``), and the shapes XLA's TPU compiler accepts for a genuine
reduce-scatter. A markdown table and a JSON file.

  JAX_PLATFORMS=cpu python -m bench.async_collectives_report [--topology v5e:2x2] [--out PATH]

The program: a 6-layer tanh MLP (1024 wide, 512 rows a device) with a hand-written
backward pass in a ``shard_map`` over all devices (one axis), whose weight gradients are
summed over the mesh and consumed by an SGD update inside the program. Each row sums them
another way (``ROWS``). Each compiles ahead of time with libtpu on a CPU host, in a
process of its own (libtpu reads its flags once a process, and some forms crash the
compiler: the row then says how it ended). The figures are compiler estimates, not
measurements: the ENTRY computation's summed ``estimated_cycles`` (compute only: a
collective's own time is not in it, ``bench.overlap_report`` prices that), its bytes
accessed, and the collectives in schedule order between the compute (``C`` a run of
compute ops, ``[op]`` a collective, ``<op ... op>`` an async pair with what it encloses).

The shape probes compile one ``psum_scatter_start(...).done()`` (the async API's
reduce-scatter) over both axes of a 2-D ``("x", "y")`` mesh on a per-device operand
computed in the program: 1-D, ``[p, 1024]`` (one row a device: no whole tile) and
``[p * 8, 128]`` (a whole ``(8, 128)`` tile a device), and ``lax.psum_scatter`` of the
last, for each TPU generation. Two more probes feed
``torus_collectives.weight_update.xla_collectives``: the tile counts a device's part of a
``[p * r, 128]`` reduce-scatter may have (``TILE_COUNTS`` over ``TILE_TOPOLOGIES``, each
topology in one process: a refused count raises, it does not crash), and what
``lax.all_gather`` and the async all-gather (``all_gather_start(...).done()``) of a flat
shard over both axes compile to, for a shard of whole tiles and one of no whole number
(``GATHER_TOPOLOGIES``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import xla_settings
from torus_collectives.testing.hlo_schedule import entry_ops

LAYERS, WIDTH, ROWS_PER_DEVICE = 6, 1024, 512
# row: (how the weight gradients are summed, program_order(enforce=True), package flags)
ROWS = {
  "lax.psum after the backward pass (XLA default)": ("psum", False, False),
  "psum_start per gradient, done before the update": ("psum_start", False, False),
  "psum_start per gradient, package XLA settings": ("psum_start", False, True),
  "lax.psum, whole step under program_order": ("psum", True, False),
  "psum_start, whole step under program_order": ("psum_start", True, False),
  "lax.psum_scatter per gradient": ("psum_scatter", False, False),
  "psum_scatter_start per gradient": ("psum_scatter_start", False, False),
  "psum_scatter_start per gradient, package XLA settings": ("psum_scatter_start", False, True),
  "ring of ppermutes per gradient (shard_map backend)": ("psum_scatter_ring", False, False),
  "psum_scatter_start, whole step under program_order": ("psum_scatter_start", True, False),
}
PROBE_TOPOLOGIES = ("v5e:4x4", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1")
PROBE_SHAPES = ("1-D", "one row a device", "one tile a device", "one tile, lax.psum_scatter")
TILE_COUNTS = (1, 16, 17, 25, 31, 32, 48, 272)
TILE_TOPOLOGIES = (
  ("v5e:16x16", "float32"),
  ("v5e:16x16", "bfloat16"),
  ("v6e:16x16", "float32"),
  ("v4:4x4x4", "float32"),
  ("v5e:4x4", "float32"),
)
GATHER_TOPOLOGIES = ("v5e:2x2", "v5e:4x4", "v5e:16x16", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1")
GATHER_FORMS = ("lax.all_gather", "async all-gather")
GATHER_SHARDS = {"whole tiles": 16384, "no whole tile count": 16407}


def _mesh(topology: str, axes: tuple[str, ...]) -> Mesh:
  from jax.experimental import topologies

  devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  shape = (devices.size,) if len(axes) == 1 else (2, devices.size // 2)
  return Mesh(devices.reshape(shape), axes, axis_types=(AxisType.Explicit,) * len(axes))


def _sum(gradient, form: str, axis: str):
  """A future (``*_start``) or the summed gradient; ``psum_scatter`` forms give this
  device's rows, which the update then applies to the same rows of the weight."""
  from jax._src.lax import parallel

  if form == "psum_start":
    return parallel.psum_start(gradient, axis)
  if form == "psum_scatter_start":
    return lax.psum_scatter_start(gradient, axis, scatter_dimension=0, tiled=True)
  if form == "psum_scatter":
    return lax.psum_scatter(gradient, axis, scatter_dimension=0, tiled=True)
  if form == "psum_scatter_ring":  # every ring step a lax.ppermute, which XLA runs async
    return tc.psum_scatter(
      gradient, axis, scatter_dimension=0, tiled=True, implementation="shard_map"
    )
  return gradient


def mlp_step(weights, x, *, form: str, axis: str = "d"):
  """One SGD step of the MLP on this device's rows, the weight gradients summed by
  ``form`` (the forms that scatter update this device's rows of each weight only)."""
  activations = [x]
  for w in weights:
    activations.append(jnp.tanh(activations[-1] @ w))
  g = 2 * activations[-1]
  summed = [None] * len(weights)
  for i in reversed(range(len(weights))):
    g = g * (1 - activations[i + 1] ** 2)
    summed[i] = _sum(activations[i].T @ g, form, axis)
    g = g @ weights[i].T
  if form == "psum":
    summed = lax.psum(summed, axis)
  elif form.endswith("_start"):
    summed = [future.done() for future in summed]
  if form.startswith("psum_scatter"):
    rows = summed[0].shape[0]
    start = lax.axis_index(axis) * rows
    weights = [lax.dynamic_slice_in_dim(w, start, rows) for w in weights]
  return [w - 0.01 * s for w, s in zip(weights, summed)]


def schedule_text(ops) -> str:
  """The ENTRY schedule, compute runs as ``C``, collectives by opcode."""
  words: list[str] = []
  for op in ops:
    if op.opcode.split("-")[0] in ("slice", "copy"):  # XLA's async local moves
      continue
    if op.kind == "compute" and op.collective == "":
      if not words or words[-1] != "C":
        words.append("C")
    elif op.kind == "sync":
      words.append(f"[{op.opcode}]")
    elif op.kind == "start":
      words.append(f"<{op.collective or op.opcode}")
    elif op.kind == "done":
      words.append(f"{op.collective or op.opcode}>")
  return " ".join(words)


def compile_row(topology: str, form: str, ordered: bool) -> dict:
  from jax.experimental.overlap import program_order

  mesh = _mesh(topology, ("d",))
  step = jax.tree_util.Partial(mlp_step, form=form)
  if ordered:
    step = program_order(step, enforce=True)
  scatters = form.startswith("psum_scatter")
  program = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d") if scatters else P())
  )
  weights = [
    jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P()))
  ] * LAYERS
  x = jax.ShapeDtypeStruct(
    (ROWS_PER_DEVICE * mesh.size, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("d"))
  )
  compiled = program.lower(weights, x).compile()
  ops = entry_ops(compiled.as_text())
  collectives = sorted({op.collective or op.opcode for op in ops if op.kind in ("sync", "start")})
  return {
    "cycles": sum(op.cycles or 0 for op in ops),
    "bytes": compiled.cost_analysis()["bytes accessed"],
    "collectives": collectives,
    "schedule": schedule_text(ops),
  }


def compile_probe(topology: str, shape: str) -> dict:
  mesh = _mesh(topology, ("x", "y"))
  p, axes = mesh.size, ("x", "y")
  local = {"1-D": (p * 1024,), "one row a device": (p, 1024)}.get(shape, (p * 8, 128))

  def reduce_scatter(v):
    if shape.endswith("lax.psum_scatter"):
      summed = lax.psum_scatter(jnp.tanh(v), axes, scatter_dimension=0, tiled=True)
    else:
      summed = lax.psum_scatter_start(jnp.tanh(v), axes, scatter_dimension=0, tiled=True).done()
    return jnp.sum(summed)[None]

  program = jax.jit(jax.shard_map(reduce_scatter, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
  arg = jax.ShapeDtypeStruct(
    (p * local[0], *local[1:]), jnp.float32, sharding=NamedSharding(mesh, P(axes))
  )
  ops = entry_ops(program.lower(arg).compile().as_text())
  return {
    "collectives": sorted(
      {op.collective or op.opcode for op in ops if op.kind != "other"}
      & {"all-reduce", "reduce-scatter", "all-gather", "collective-permute"}
    )
  }


def _collectives(program, arg) -> list[str]:
  ops = entry_ops(program.lower(arg).compile().as_text())
  return sorted({op.collective for op in ops if op.collective})


def compile_tiles(topology: str, dtype: str) -> dict:
  """For each of ``TILE_COUNTS``: what ``psum_scatter_start`` of ``[p * r, 128]`` over both
  axes, ``r`` that many whole tiles of ``dtype`` a device, compiles to (or the error)."""
  mesh = _mesh(topology, ("x", "y"))
  p, axes, dtype = mesh.size, ("x", "y"), jnp.dtype(dtype)
  sublanes = 8 * max(1, 4 // dtype.itemsize)

  def reduce_scatter(v):
    return lax.psum_scatter_start(jnp.tanh(v), axes, scatter_dimension=0, tiled=True).done()

  program = jax.jit(
    jax.shard_map(reduce_scatter, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
  )
  cells = {}
  for tiles in TILE_COUNTS:
    rows = p * p * tiles * sublanes  # [p * r, 128] on every device
    arg = jax.ShapeDtypeStruct((rows, 128), dtype, sharding=NamedSharding(mesh, P(axes)))
    try:
      cells[str(tiles)] = {"collectives": _collectives(program, arg)}
    except jax.errors.JaxRuntimeError as e:  # the compiler refuses the shape
      cells[str(tiles)] = {"failed": str(e).split("\n")[0].split(" for ")[0][:60]}
  return cells


def compile_gathers(topology: str) -> dict:
  """For each of ``GATHER_FORMS`` and ``GATHER_SHARDS``: what an all-gather over both axes
  of a flat float32 shard computed on the device compiles to."""
  from torus_collectives import _jax_internals

  mesh = _mesh(topology, ("x", "y"))
  p, axes = mesh.size, ("x", "y")
  cells = {}
  for form in GATHER_FORMS:
    for label, m in GATHER_SHARDS.items():

      def gather(v, form=form):
        if form == "lax.all_gather":
          return 2 * lax.all_gather(jnp.tanh(v), axes, tiled=True)
        return 2 * _jax_internals.all_gather_start(jnp.tanh(v), axes, tiled=True).done()

      program = jax.jit(
        jax.shard_map(gather, mesh=mesh, in_specs=P(axes), out_specs=P(), check_vma=False)
      )
      arg = jax.ShapeDtypeStruct((p * m,), jnp.float32, sharding=NamedSharding(mesh, P(axes)))
      cells[f"{form}, {label}"] = {"collectives": _collectives(program, arg)}
  return cells


def _in_process(kind: str, *args: str) -> dict:
  """One row in a process of its own: its result, or how the process ended."""
  # Other processes may hold libtpu (the test suite's ahead-of-time compiles).
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  if kind == "row" and ROWS[args[1]][2]:
    env[xla_settings.ENV_VAR] = xla_settings.libtpu_init_args(env.get(xla_settings.ENV_VAR, ""))
  run = subprocess.run(
    [sys.executable, "-m", "bench.async_collectives_report", f"--{kind}", *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )
  for line in reversed(run.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  if run.returncode < 0:
    return {"failed": f"the compiler crashed ({signal.Signals(-run.returncode).name})"}
  errors = [line.split("Error: ", 1)[-1] for line in run.stderr.splitlines() if "Error: " in line]
  return {"failed": errors[-1].strip()[:160] if errors else f"exit status {run.returncode}"}


def markdown(topology: str, rows: dict, probes: dict) -> str:
  lines = [
    f"# jax's scheduling mechanisms on a data-parallel step, compiled for {topology}",
    "",
    "Compiler estimates of `python -m bench.async_collectives_report` (module docstring).",
    "",
    "| row | compute cycles | bytes accessed | collectives | schedule |",
    "|---|---|---|---|---|",
  ]
  for label, r in rows.items():
    if "failed" in r:
      lines.append(f"| {label} | | | | compile failed ({r['failed']}) |")
    else:
      lines.append(
        f"| {label} | {r['cycles']:,} | {r['bytes'] / 1e6:,.1f} MB | "
        f"{', '.join(r['collectives'])} | `{r['schedule']}` |"
      )
  lines += [
    "",
    "## psum_scatter_start's shapes",
    "",
    "| topology | " + " | ".join(PROBE_SHAPES) + " |",
  ]
  lines.append("|---" * (len(PROBE_SHAPES) + 1) + "|")
  for topo, cells in probes.items():
    texts = [c.get("failed") or ", ".join(c["collectives"]) for c in cells.values()]
    lines.append(f"| {topo} | " + " | ".join(texts) + " |")
  return "\n".join(lines) + "\n"


def _cell(c: dict) -> str:
  return c.get("failed") or ", ".join(c["collectives"])


def probe_tables(tiles: dict, gathers: dict) -> str:
  """The tile-count and all-gather probes as two markdown tables."""
  lines = [
    "",
    "## psum_scatter_start of [p * r, 128]: tiles a device",
    "",
    "| topology, dtype | " + " | ".join(str(t) for t in TILE_COUNTS) + " |",
    "|---" * (len(TILE_COUNTS) + 1) + "|",
  ]
  for key, cells in tiles.items():
    if "failed" in cells:  # the whole process ended
      lines.append(f"| {key} | " + " | ".join([cells["failed"]] * len(TILE_COUNTS)) + " |")
      continue
    lines.append(f"| {key} | " + " | ".join(_cell(cells[str(t)]) for t in TILE_COUNTS) + " |")
  columns = [f"{form}, {label}" for form in GATHER_FORMS for label in GATHER_SHARDS]
  lines += [
    "",
    "## all-gather of a flat shard over both axes (16,384 or 16,407 float32 a device)",
    "",
    "| topology | " + " | ".join(columns) + " |",
    "|---" * (len(columns) + 1) + "|",
  ]
  for topo, cells in gathers.items():
    if "failed" in cells:
      lines.append(f"| {topo} | " + " | ".join([cells["failed"]] * len(columns)) + " |")
      continue
    lines.append(f"| {topo} | " + " | ".join(_cell(cells[c]) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:2x2")
  parser.add_argument("--out", default="bench/results/async_collectives.md")
  parser.add_argument("--row", nargs=2, metavar=("TOPOLOGY", "LABEL"), help=argparse.SUPPRESS)
  parser.add_argument("--probe", nargs=2, metavar=("TOPOLOGY", "SHAPE"), help=argparse.SUPPRESS)
  parser.add_argument("--tiles", nargs=2, metavar=("TOPOLOGY", "DTYPE"), help=argparse.SUPPRESS)
  parser.add_argument("--gathers", nargs=1, metavar="TOPOLOGY", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.row:
    form, ordered, _ = ROWS[args.row[1]]
    print(json.dumps(compile_row(args.row[0], form, ordered)))
    return
  if args.probe:
    print(json.dumps(compile_probe(*args.probe)))
    return
  if args.tiles:
    print(json.dumps(compile_tiles(*args.tiles)))
    return
  if args.gathers:
    print(json.dumps(compile_gathers(*args.gathers)))
    return
  rows = {label: _in_process("row", args.topology, label) for label in ROWS}
  probes = {t: {s: _in_process("probe", t, s) for s in PROBE_SHAPES} for t in PROBE_TOPOLOGIES}
  tiles = {f"{t}, {d}": _in_process("tiles", t, d) for t, d in TILE_TOPOLOGIES}
  gathers = {t: _in_process("gathers", t) for t in GATHER_TOPOLOGIES}
  text = markdown(args.topology, rows, probes) + probe_tables(tiles, gathers)
  with open(args.out, "w") as f:
    f.write(text)
  with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
    record = {"topology": args.topology, "rows": rows, "probes": probes}
    json.dump({**record, "tiles": tiles, "gathers": gathers}, f, indent=1)
  print(text)


if __name__ == "__main__":
  main()
