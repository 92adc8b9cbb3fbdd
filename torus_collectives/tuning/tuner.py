"""The tuner: times every implementation "auto" could pick, here, and writes the table.

  python -m torus_collectives.tuning [--mesh 2x4] [--sizes 1MiB,4MiB,16MiB]
      [--dtypes float32,bfloat16] [--rounds 25] [--runs 2] [--output PATH]
  python -m torus_collectives.tuning --validate TABLE [--write [PATH]]

For each op (all_reduce, reduce_scatter, all_gather, the gradient summation of a pytree,
batch norm), dtype and size on the current mesh, the concrete implementations that run here
(``registry.candidates``) are timed against XLA with ``tuning.timing.Interleaved``, which gives
per-round time ratios. One such tuning of every case is a *run*; the command line times
``--runs`` (``tables.MIN_RUNS``) runs, each in a fresh subprocess, into the same table, and
``tables.decide`` picks a torus implementation only if it beats XLA with confidence in
every one of them (the rule: ``tuning.tables``). Cases where only XLA runs, or below the latency
floor where "auto" is XLA by rule, are not timed. Batch norm is timed alone and reported,
for callers choosing ``implementation="pallas"`` where it stands alone; "auto" keeps XLA
for it whatever the ratio (``registry.auto_implementation``). The result is a
``tables.Table``: written to the user cache (or ``--output``) and printed.

``--validate TABLE`` re-measures every entry of a table (``--runs`` fresh runs, each in a
fresh subprocess) and reports, per entry, whether it still holds (``tables.holds``);
``--write`` then writes the table (to TABLE, or to PATH) with each entry that no longer
holds replaced by what the rule makes of the fresh runs: XLA, unless another candidate
passed them all. (Deleting the entry instead would let the next smaller measured size's
choice cover its size.)

In a program, ``tune_cases`` (and ``tuning.tuner``, ``tune_for``) add one run, in this process, to
what the output file already holds, and install the result for this process. Several
processes: run the same call on every process (as any multi-controller JAX program). Each
process executes the same programs in the same order; process 0 merges its timings with
its file, and its table is broadcast, so all processes hold, write and install the same
table and compile the same programs.

A whole train step is tuned through the same ``tune_cases``: ``tuning.step_tuning.tune_step``
gives it one ``Case`` whose ``candidates`` are the step's (implementation, bucket size)
variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import platform as host_platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives import groups, registry
from torus_collectives.collectives import all_gather, all_reduce, reduce_scatter
from torus_collectives.gradients import all_reduce_gradients
from torus_collectives.norm.batch_norm import batch_norm
from torus_collectives.sizes import MiB, parse_size, size_label
from torus_collectives.topology import make_torus_mesh, most_square_shape
from torus_collectives.tuning import tables, timing

DEFAULT_SIZES = (MiB, 4 * MiB, 16 * MiB)
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_ROUNDS = 25
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing to time: ``build(name)`` returns a zero-argument call.

  ``candidates``: the names to time, ``tables.BASELINE`` among them (a whole train step's
  ``tables.step_variant`` names); None: the implementations of ``op`` that run here
  (``registry.candidates``).
  """

  op: str
  dtype: str
  nbytes: int
  torus: tuple[int, ...]
  label: str
  build: Callable[[str], Callable[[], Any]]
  candidates: tuple[str, ...] | None = None


def _global(mesh: Mesh, shape: tuple[int, ...], dtype, spec: P) -> jax.Array:
  """A deterministic array of small integers, laid out on ``mesh`` (any process count)."""
  size = math.prod(shape)
  make = lambda: (jnp.arange(size, dtype=jnp.int32) % 7).astype(dtype).reshape(shape)
  return jax.jit(make, out_shardings=NamedSharding(mesh, spec))()


def collective_case(mesh: Mesh, op: str, dtype, nbytes: int) -> Case:
  """``op`` over every axis of ``mesh`` on a full buffer of ``nbytes`` per device."""
  axes = tuple(mesh.axis_names)
  p = mesh.size
  dtype = jnp.dtype(dtype)
  per_device = nbytes // dtype.itemsize
  if op == "all_gather":
    per_device //= p
  spec = P(axes)

  def build(name: str):
    ops = {
      "all_reduce": lambda x: all_reduce(x, axes, implementation=name),
      "reduce_scatter": lambda x: reduce_scatter(x, axes, tiled=True, implementation=name),
      "all_gather": lambda x: all_gather(x, axes, tiled=True, implementation=name),
    }
    fn = jax.jit(jax.shard_map(ops[op], mesh=mesh, in_specs=spec, out_specs=spec))
    x = _global(mesh, (p * per_device,), dtype, spec)
    return lambda: fn(x)

  torus = tuple(mesh.shape[a] for a in axes)
  return Case(op, dtype.name, nbytes, torus, f"{op} {dtype.name} {size_label(nbytes)}", build)


def gradients_case(mesh: Mesh, tree: Any, label: str = "gradients") -> Case:
  """``all_reduce_gradients`` of a pytree shaped like ``tree`` (arrays or
  ``jax.ShapeDtypeStruct``s: only shapes and dtypes are used), over every mesh axis."""
  axes = tuple(mesh.axis_names)
  p = mesh.size
  leaves, treedef = jax.tree.flatten(tree)
  nbytes = sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize for v in leaves)
  dtype = max(leaves, key=lambda v: math.prod(v.shape) * jnp.dtype(v.dtype).itemsize).dtype
  spec = P(axes)

  def build(name: str):
    def body(t):
      local = jax.tree.map(lambda v: v[0], t)
      out = all_reduce_gradients(local, axes, implementation=name)
      return jax.tree.map(lambda v: v[None], out)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    inputs = jax.tree.unflatten(
      treedef, [_global(mesh, (p, *v.shape), v.dtype, spec) for v in leaves]
    )
    return lambda: fn(inputs)

  torus = tuple(mesh.shape[a] for a in axes)
  name = jnp.dtype(dtype).name
  text = f"all_reduce_gradients {label}: {len(leaves)} leaves, {size_label(nbytes)}"
  return Case("all_reduce_gradients", name, nbytes, torus, text, build)


def batch_norm_case(
  mesh: Mesh, shape: Sequence[int], dtype, group_size: groups.GroupSize = None
) -> Case:
  """Batch norm forward + backward on a per-replica activation of ``shape``
  (channels last), statistics over ``group_size`` replicas of the mesh."""
  axes = tuple(mesh.axis_names)
  shape = tuple(int(n) for n in shape)
  dtype = jnp.dtype(dtype)
  tile = groups.resolve_tile(group_size, tuple(mesh.shape[a] for a in axes))
  channels = shape[-1]
  spec = P(axes)

  def build(name: str):
    def body(x, cotangent):
      norm = lambda x, s, b: batch_norm(
        x, s, b, axis_name=axes, group_size=tile, implementation=name
      )[0]
      scale, bias = jnp.ones(channels, jnp.float32), jnp.zeros(channels, jnp.float32)
      y, vjp = jax.vjp(norm, x, scale, bias)
      return y, vjp(cotangent)[0]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = _global(mesh, (mesh.size * shape[0],) + shape[1:], dtype, spec)
    return lambda: fn(x, x)

  nbytes = math.prod(shape) * dtype.itemsize
  label = f"batch_norm {dtype.name} {'x'.join(map(str, shape))}"
  return Case("batch_norm", dtype.name, nbytes, tile, label, build)


def synthetic_gradients(nbytes: int, dtype="float32", leaves: int = 161) -> list:
  """Shapes of a gradient tree of about ``nbytes``: ``leaves`` leaves (ResNet-50 has 161)
  whose sizes spread over three decades, as conv kernels, biases and BN parameters do."""
  total = nbytes // jnp.dtype(dtype).itemsize
  weights = np.logspace(0, 3, leaves)
  sizes = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(int)
  sizes[-1] += total - sizes.sum()  # exactly nbytes: the size bucket is the one asked for
  return [jax.ShapeDtypeStruct((int(n),), jnp.dtype(dtype)) for n in sizes]


# ----------------------------------------------------------------------------------------
# Measuring and deciding.


def _skip_reason(case: Case, names: Sequence[str], device_kind: str) -> str | None:
  if len(names) < 2:
    return "only xla runs here"
  if case.op in registry.COLLECTIVES or case.op == "all_reduce_gradients":
    floor = tables.latency_floor_bytes(case.torus, device_kind)
    if case.nbytes < floor:
      return f"below the latency floor ({size_label(floor)}): xla by rule"
  return None


def measure(
  cases: Sequence[Case],
  *,
  rounds: int = DEFAULT_ROUNDS,
  timer: timing.Timer | None = None,
  progress: Callable[[str], None] | None = print,
) -> list[tuple[Case, dict[str, list[float]]]]:
  """Times the candidates of every case; returns, for those timed, (case, per-round time
  ratios to XLA per candidate).

  Every process must call this with the same cases: the collectives span all of them.
  """
  device_kind = jax.devices()[0].device_kind
  say = progress if progress is not None and jax.process_index() == 0 else lambda _: None
  out = []
  for i, case in enumerate(cases, 1):
    names = case.candidates or registry.candidates(case.op, case.dtype, device_kind)
    prefix = f"[{i}/{len(cases)}] {case.label} on {tables.topology(case.torus)}"
    reason = _skip_reason(case, names, device_kind)
    if reason:
      say(f"{prefix}: {reason}")
      continue
    start = time.perf_counter()
    runs = timing.Interleaved({n: case.build(n) for n in names}, timer).run(rounds)
    ratios = {n: runs.round_ratios(n, tables.BASELINE) for n in names if n != tables.BASELINE}
    text = ", ".join(
      f"{n} {np.median(r):.2f}x (CI high {tables.ci_high(r):.3f})" for n, r in ratios.items()
    )
    say(f"{prefix}: {text} ({time.perf_counter() - start:.1f} s)")
    out.append((case, ratios))
  return out


def _from_process_0(table: tables.Table) -> tables.Table:
  """Process 0's table, on every process: the one table all of them decide from."""
  if jax.process_count() == 1:
    return table
  data = np.frombuffer(table.to_json().encode(), np.uint8).astype(np.int32)
  size = int(multihost_utils.broadcast_one_to_all(np.array(data.size, np.int32)))
  buffer = data if jax.process_index() == 0 else np.zeros(size, np.int32)
  shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return tables.Table.from_json(shared.astype(np.uint8).tobytes().decode())


def _machine() -> str:
  devices = jax.devices()
  return (
    f"{jax.device_count()} x {devices[0].device_kind} ({devices[0].platform}) in "
    f"{jax.process_count()} process(es); host {host_platform.machine()} with "
    f"{os.cpu_count()} cores, {jax.local_device_count()} local devices; jax {jax.__version__}"
  )


def _read_table(path: str | os.PathLike) -> tables.Table | None:
  try:
    return tables.Table.from_json(pathlib.Path(path).read_text())
  except (OSError, ValueError):
    return None


def tune_cases(
  cases: Sequence[Case],
  *,
  rounds: int = DEFAULT_ROUNDS,
  timer: timing.Timer | None = None,
  output: str | None = None,
  install: bool = True,
  progress: Callable[[str], None] | None = print,
) -> tables.Table:
  """Measures ``cases`` once (one run, in this process), adds the run to the table at
  ``output`` and returns the entries of ``cases``, decided by the rule of ``tuning.tables``.

  An entry needs ``tables.MIN_RUNS`` runs from different processes to pick anything but
  XLA: the run of this call, and those ``output`` already holds for the same case.
  ``output``: the table to add to and write; "" reads and writes nothing (one run: every
  choice is XLA); None: the user cache (``tables.cache_path()``). With several processes,
  process 0's file and timings decide, and every process writes that table.
  ``install``: make the returned entries the table "auto" reads first in this process.
  """
  measured = measure(cases, rounds=rounds, timer=timer, progress=progress)
  fresh = tables.Table(
    device_kind=jax.devices()[0].device_kind,
    machine=_machine(),
    created=tables.now(),
    entries=[
      tables.Entry.from_runs(
        tables.topology(case.torus),
        case.op,
        case.dtype,
        tables.size_bucket(case.nbytes),
        [tables.Run.of(ratios)],
      )
      for case, ratios in measured
    ],
  )
  path = None if output == "" else (tables.cache_path() if output is None else output)
  table = fresh if path is None else fresh.merged_into(_read_table(path))
  table = _from_process_0(table)
  if path is not None:
    table.save(path)
    if progress is not None and jax.process_index() == 0:
      progress(f"wrote {path}")
  keys = {e.key for e in fresh.entries}
  mine = dataclasses.replace(table, entries=[e for e in table.entries if e.key in keys])
  if install:
    tables.use_table(mine)
  return mine


def _mesh(mesh: Mesh | None) -> Mesh:
  return mesh if mesh is not None else make_torus_mesh(most_square_shape(jax.device_count()))


def tune(
  mesh: Mesh | None = None,
  *,
  sizes: Sequence[int] = DEFAULT_SIZES,
  dtypes: Sequence[str] = DEFAULT_DTYPES,
  ops: Sequence[str] = COLLECTIVE_OPS,
  gradient_trees: Sequence[Any] = (),
  batch_norm_shapes: Sequence[Sequence[int]] = (),
  **kwargs,
) -> tables.Table:
  """Tunes the collectives (``ops`` x ``dtypes`` x ``sizes``, full buffer bytes), the
  gradient summation of each tree in ``gradient_trees`` and batch norm on each
  per-replica activation shape, on ``mesh`` (default: all devices, most square torus).

  Keyword arguments go to ``tune_cases``.
  """
  mesh = _mesh(mesh)
  cases = [collective_case(mesh, op, d, s) for op in ops for d in dtypes for s in sizes]
  cases += [gradients_case(mesh, tree) for tree in gradient_trees]
  cases += [batch_norm_case(mesh, shape, d) for shape in batch_norm_shapes for d in dtypes]
  return tune_cases(cases, **kwargs)


def tune_for(
  params: Any,
  batch_norm_shapes: Sequence[tuple[Sequence[int], Any]] = (),
  mesh: Mesh | None = None,
  *,
  group_size: groups.GroupSize = None,
  label: str = "model",
  **kwargs,
) -> dict[str, str]:
  """Tunes what one model runs: the gradient summation of a tree shaped like ``params``
  and batch norm on each distinct (per-replica shape, dtype) in ``batch_norm_shapes``,
  with statistics over ``group_size`` replicas. Call it on every process before tracing
  the train step; "auto" then reads the result. Keyword arguments go to ``tune_cases``.

  Returns ``{op: implementation}``: what "auto" now runs for each of them (for the log).
  """
  mesh = _mesh(mesh)
  cases = [gradients_case(mesh, params, label)]
  distinct = dict.fromkeys((tuple(s), jnp.dtype(d).name) for s, d in batch_norm_shapes)
  cases += [batch_norm_case(mesh, s, d, group_size) for s, d in distinct]
  tune_cases(cases, **kwargs)
  return {c.label: auto_choice(c, mesh) for c in cases}


def auto_choice(case: Case, mesh: Mesh) -> str:
  """The implementation "auto" runs for ``case`` on ``mesh``, by the registry's rule."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return registry.auto_implementation(case.op, case.dtype, nbytes=case.nbytes, torus=case.torus)


# ----------------------------------------------------------------------------------------
# Validation: does a table still hold?


def entry_case(mesh: Mesh, entry: tables.Entry) -> Case | None:
  """The case that re-measures ``entry`` on ``mesh`` (at the top of its size bucket,
  ``2**bucket`` bytes; a gradient tree as ``synthetic_gradients`` of that size), or None
  for batch norm, whose activation shape a table does not record ("auto" never runs its
  measurement anyway)."""
  nbytes = 2**entry.bucket
  if entry.op in COLLECTIVE_OPS:
    return collective_case(mesh, entry.op, entry.dtype, nbytes)
  if entry.op == "all_reduce_gradients":
    return gradients_case(mesh, synthetic_gradients(nbytes, entry.dtype))
  return None


def validation_cases(table: tables.Table) -> dict[tuple, Case]:
  """``entry_case`` of every entry that can be re-measured here, by entry key."""
  out = {}
  for entry in table.entries:
    shape = tuple(int(n) for n in entry.topology.split("x"))
    if math.prod(shape) != jax.device_count():
      continue
    case = entry_case(make_torus_mesh(shape), entry)
    if case is not None:
      out[entry.key] = case
  return out


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What re-measuring one entry found: ``holds`` is None when it was not re-measured."""

  entry: tables.Entry
  fresh: list[tables.Run]
  holds: bool | None
  note: str

  def line(self) -> str:
    e = self.entry
    head = f"{e.topology} {e.op} {e.dtype} {size_label(2**e.bucket)}: {e.choice}"
    if self.holds is None:
      return f"{head}: not re-measured ({self.note})"
    figures = "; ".join(
      f"{n} " + ", ".join(f"{r.median[n]:.2f} [{r.ci_high[n]:.3f}]" for r in self.fresh)
      for n in sorted({n for r in self.fresh for n in r.median})
    )
    verdict = "holds" if self.holds else "NO LONGER HOLDS"
    return f"{head}: {verdict} (fresh runs, median [CI high]: {figures}){self.note}"


def validate(table: tables.Table, fresh: Sequence[tables.Table]) -> list[Verdict]:
  """Judges every entry of ``table`` on the runs of the same case in ``fresh`` (tables of
  re-measurements, one run each, from different processes)."""
  verdicts = []
  for entry in table.entries:
    runs = [r for t in fresh for e in t.entries if e.key == entry.key for r in e.runs]
    if not runs:
      why = {
        "batch_norm": "batch norm: its shape is not recorded",
        tables.STEP_OP: "a train step: tune it again with tuning.step_tuning.tune_step",
      }.get(entry.op, f"needs {entry.topology} on this device count, or was not timed")
      verdicts.append(Verdict(entry, [], None, why))
      continue
    ok = tables.holds(entry, runs)
    note = ""
    if len(tables.kept_runs(runs)) < tables.MIN_RUNS:
      note = f"; only {len(runs)} fresh run(s), the rule needs {tables.MIN_RUNS}"
    elif entry.choice == tables.BASELINE and tables.passing(runs):
      note = f"; {', '.join(tables.passing(runs))} now passes: tune again to use it"
    verdicts.append(Verdict(entry, runs, ok, note))
  return verdicts


def without_failures(table: tables.Table, verdicts: Sequence[Verdict]) -> tables.Table:
  """``table`` with each entry that no longer holds replaced by the rule's entry of its
  fresh runs."""
  failed = {v.entry.key: v for v in verdicts if v.holds is False}
  entries = [
    tables.Entry.from_runs(*e.key, failed[e.key].fresh) if e.key in failed else e
    for e in table.entries
  ]
  return dataclasses.replace(table, entries=entries)


# ----------------------------------------------------------------------------------------
# Command line.


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m torus_collectives.tuning", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--mesh", help="torus shape, e.g. 2x4 (default: most square)")
  parser.add_argument(
    "--sizes",
    default=",".join(size_label(s, sep="") for s in DEFAULT_SIZES),
    help="full buffer sizes per device, e.g. 1MiB,16MiB",
  )
  parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
  parser.add_argument("--ops", default=",".join(COLLECTIVE_OPS))
  parser.add_argument(
    "--gradient-sizes",
    default="16MiB",
    help="total bytes of synthetic 161-leaf gradient trees to tune (empty: none)",
  )
  parser.add_argument(
    "--batch-norm-shapes",
    default="2x28x28x512,2x7x7x2048",
    help="per-replica NHWC activations to tune batch norm on (empty: none)",
  )
  parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
  parser.add_argument(
    "--runs",
    type=int,
    default=tables.MIN_RUNS,
    help=f"timing runs, each in a fresh subprocess (1: once, in this process; the rule "
    f"needs {tables.MIN_RUNS} from different processes)",
  )
  parser.add_argument("--output", help=f"table path (default: {tables.cache_path()})")
  parser.add_argument(
    "--validate", metavar="TABLE", help="re-measure every entry of TABLE and report"
  )
  parser.add_argument(
    "--write",
    nargs="?",
    const="",
    metavar="PATH",
    help="with --validate: write the table (to TABLE, or PATH) with the entries that no "
    "longer hold replaced by the rule's entries of the fresh runs",
  )
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  return parser


def _child_argv(args: argparse.Namespace, output: str) -> list[str]:
  """The arguments of one fresh-process run of ``args``."""
  argv = [
    f"--sizes={args.sizes}",
    f"--dtypes={args.dtypes}",
    f"--ops={args.ops}",
    f"--gradient-sizes={args.gradient_sizes}",
    f"--batch-norm-shapes={args.batch_norm_shapes}",
    f"--rounds={args.rounds}",
    "--runs=1",
    f"--output={output}",
    "--child",
  ]
  if args.mesh:
    argv.append(f"--mesh={args.mesh}")
  if args.validate:
    argv.append(f"--validate={args.validate}")
  return argv


def _in_fresh_processes(args: argparse.Namespace, outputs: Sequence[str]) -> None:
  for i, output in enumerate(outputs, 1):
    print(f"run {i} of {len(outputs)}, in a fresh process", flush=True)
    command = [sys.executable, "-m", "torus_collectives.tuning", *_child_argv(args, output)]
    subprocess.run(command, check=True)


def _validate_main(args: argparse.Namespace) -> tables.Table:
  table = tables.Table.from_json(pathlib.Path(args.validate).read_text())
  if args.runs > 1:
    with tempfile.TemporaryDirectory() as tmp:
      outputs = [str(pathlib.Path(tmp) / f"run{i}.json") for i in range(args.runs)]
      _in_fresh_processes(args, outputs)
      fresh = [t for t in map(_read_table, outputs) if t is not None]
  else:
    kind = jax.devices()[0].device_kind
    if table.device_kind != kind:
      raise SystemExit(f"{args.validate} was measured on {table.device_kind!r}, this is {kind!r}")
    cases = list(validation_cases(table).values())
    output = args.output if args.child else ""
    fresh = [tune_cases(cases, rounds=args.rounds, output=output, install=False)]
    if args.child:
      return fresh[0]
  verdicts = validate(table, fresh)
  for v in verdicts:
    print(v.line())
  failed = sum(v.holds is False for v in verdicts)
  print(f"{failed} of {len(verdicts)} entries no longer hold")
  if args.write is not None:
    path = args.write or args.validate
    kept = without_failures(table, verdicts)
    kept.save(path)
    print(f"wrote {path}")
    print(tables.format_table(kept))
    return kept
  return table


def main(argv: Sequence[str] | None = None) -> tables.Table:
  args = _parser().parse_args(argv)
  if args.runs < 1 or args.rounds < 1:
    raise SystemExit(f"--runs and --rounds must be positive, got {args.runs}, {args.rounds}")
  if args.rounds < tables.MIN_ROUNDS and not args.child:
    print(
      f"note: a run of fewer than {tables.MIN_ROUNDS} rounds passes nothing: every choice is xla"
    )
  start = time.perf_counter()
  if args.validate:
    table = _validate_main(args)
  elif args.runs > 1:
    path = args.output or str(tables.cache_path())
    _in_fresh_processes(args, [path] * args.runs)
    table = tables.Table.from_json(pathlib.Path(path).read_text())
  else:
    split = lambda text: [t for t in text.split(",") if t]
    mesh = _mesh(
      make_torus_mesh(tuple(int(n) for n in args.mesh.split("x"))) if args.mesh else None
    )
    dtypes = split(args.dtypes)
    table = tune(
      mesh,
      sizes=[parse_size(s) for s in split(args.sizes)],
      dtypes=dtypes,
      ops=split(args.ops),
      gradient_trees=[
        synthetic_gradients(parse_size(s), d) for s in split(args.gradient_sizes) for d in dtypes
      ],
      batch_norm_shapes=[tuple(map(int, s.split("x"))) for s in split(args.batch_norm_shapes)],
      rounds=args.rounds,
      output=args.output,
    )
  if not args.child and jax.process_index() == 0:
    if not args.validate:
      print(tables.format_table(table))
    print(f"done in {time.perf_counter() - start:.0f} s")
  return table
