"""The tuner: times every implementation "auto" could pick, here, and writes the table.

  python -m torus_collectives.tune [--mesh 2x4] [--sizes 1MiB,4MiB,16MiB]
      [--dtypes float32,bfloat16] [--rounds 15] [--output PATH]

For each op (all_reduce, reduce_scatter, all_gather, the gradient summation of a pytree,
batch norm), dtype and size on the current mesh, the concrete implementations that run here
(``registry.candidates``) are timed against XLA with ``timing.Interleaved``, and
``tuning.decide`` turns the median per-round ratios into a choice. Cases where only XLA
runs, or below the latency floor where "auto" is XLA by rule, are not timed. Batch norm is
timed alone and reported, for callers choosing ``implementation="pallas"`` where it stands
alone; "auto" keeps XLA for it whatever the ratio (``registry.auto_implementation``). The
result is a ``tuning.Table``: written to the user cache (or ``--output``), installed for
this process (``tuning.use_table``) and printed.

Several processes: run the same command on every process (as any multi-controller JAX
program). Each process executes the same programs in the same order; the ratios measured
on process 0 are broadcast and every process decides from them, so all processes hold the
same table and compile the same programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import platform as host_platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives import groups, registry, timing, tuning
from torus_collectives.batch_norm import batch_norm
from torus_collectives.collectives import all_gather, all_reduce, reduce_scatter
from torus_collectives.gradients import all_reduce_gradients
from torus_collectives.topology import make_torus_mesh, most_square_shape

MiB = 2**20
DEFAULT_SIZES = (MiB, 4 * MiB, 16 * MiB)
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_ROUNDS = 15
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather")
# Every name a ratio can be reported for, in a fixed order (the broadcast's columns).
_NAMES = tuple(n for n in registry.IMPLEMENTATIONS if n not in ("auto", tuning.BASELINE))


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing to time: ``build(implementation)`` returns a zero-argument call."""

  op: str
  dtype: str
  nbytes: int
  torus: tuple[int, ...]
  label: str
  build: Callable[[str], Callable[[], Any]]


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
  return Case(
    op, dtype.name, nbytes, torus, f"{op} {dtype.name} {tuning.size_label(nbytes)}", build
  )


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
  text = f"all_reduce_gradients {label}: {len(leaves)} leaves, {tuning.size_label(nbytes)}"
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
  if case.op != "batch_norm":
    floor = tuning.latency_floor_bytes(case.torus, device_kind)
    if case.nbytes < floor:
      return f"below the latency floor ({tuning.size_label(floor)}): xla by rule"
  return None


def measure(
  cases: Sequence[Case],
  *,
  rounds: int = DEFAULT_ROUNDS,
  timer: timing.Timer | None = None,
  progress: Callable[[str], None] | None = print,
) -> list[tuple[Case, dict[str, float]]]:
  """Times the candidates of every case; returns (case, ratios to XLA) for those timed.

  Every process must call this with the same cases: the collectives span all of them.
  """
  device_kind = jax.devices()[0].device_kind
  say = progress if progress is not None and jax.process_index() == 0 else lambda _: None
  out = []
  for i, case in enumerate(cases, 1):
    names = registry.candidates(case.op, case.dtype, device_kind)
    prefix = f"[{i}/{len(cases)}] {case.label} on {tuning.topology(case.torus)}"
    reason = _skip_reason(case, names, device_kind)
    if reason:
      say(f"{prefix}: {reason}")
      continue
    start = time.perf_counter()
    runs = timing.Interleaved({n: case.build(n) for n in names}, timer).run(rounds)
    ratios = runs.ratios(tuning.BASELINE)
    text = ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items())
    say(f"{prefix}: {text} ({time.perf_counter() - start:.1f} s)")
    out.append((case, ratios))
  return out


def agree(measured: list[tuple[Case, dict[str, float]]]) -> list[tuple[Case, dict[str, float]]]:
  """Process 0's ratios, on every process: the one set the decision is made from."""
  if jax.process_count() == 1 or not measured:
    return measured
  local = np.array([[r.get(n, np.nan) for n in _NAMES] for _, r in measured], np.float64)
  shared = np.asarray(multihost_utils.broadcast_one_to_all(local))
  return [
    (case, {n: float(v) for n, v in zip(_NAMES, row) if not np.isnan(v)})
    for (case, _), row in zip(measured, shared)
  ]


def _machine() -> str:
  devices = jax.devices()
  return (
    f"{jax.device_count()} x {devices[0].device_kind} ({devices[0].platform}) in "
    f"{jax.process_count()} process(es); host {host_platform.machine()} with "
    f"{os.cpu_count()} cores, {jax.local_device_count()} local devices; jax {jax.__version__}"
  )


def tune_cases(
  cases: Sequence[Case],
  *,
  rounds: int = DEFAULT_ROUNDS,
  margin: float = tuning.MARGIN,
  timer: timing.Timer | None = None,
  output: str | None = None,
  install: bool = True,
  progress: Callable[[str], None] | None = print,
) -> tuning.Table:
  """Measures ``cases``, decides on process 0's ratios, and returns the table.

  ``output``: where to write it (merged with the entries already there that it does not
  remeasure); "" writes nothing; None: the user cache (``tuning.cache_path()``).
  ``install``: make it (the measured entries alone, the same on every process) the table
  "auto" reads first in this process.
  """
  measured = agree(measure(cases, rounds=rounds, timer=timer, progress=progress))
  entries = [
    tuning.Entry(
      topology=tuning.topology(case.torus),
      op=case.op,
      dtype=case.dtype,
      bucket=tuning.size_bucket(case.nbytes),
      choice=tuning.decide(ratios, margin),
      ratios={n: round(r, 4) for n, r in ratios.items()},
      rounds=rounds,
    )
    for case, ratios in measured
  ]
  table = tuning.Table(
    device_kind=jax.devices()[0].device_kind,
    machine=_machine(),
    created=tuning.now(),
    entries=entries,
    margin=margin,
  )
  if output != "":
    path = tuning.cache_path() if output is None else output
    previous = None
    try:
      previous = tuning.Table.from_json(pathlib.Path(path).read_text())
    except (OSError, ValueError):
      pass
    table.merged_into(previous).save(path)
    if progress is not None and jax.process_index() == 0:
      progress(f"wrote {path}")
  if install:  # what every process agreed on, not a merge with its own file
    tuning.use_table(table)
  return table


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
) -> tuning.Table:
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
# Command line.


def _parse_size(text: str) -> int:
  units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}
  for unit, scale in units.items():
    if text.endswith(unit):
      return int(float(text[: -len(unit)]) * scale)
  return int(text)


def main(argv: Sequence[str] | None = None) -> tuning.Table:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mesh", help="torus shape, e.g. 2x4 (default: most square)")
  parser.add_argument(
    "--sizes",
    default=",".join(tuning.size_label(s).replace(" ", "") for s in DEFAULT_SIZES),
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
  parser.add_argument("--margin", type=float, default=tuning.MARGIN)
  parser.add_argument("--output", help=f"table path (default: {tuning.cache_path()})")
  args = parser.parse_args(argv)
  split = lambda text: [t for t in text.split(",") if t]
  mesh = _mesh(make_torus_mesh(tuple(int(n) for n in args.mesh.split("x"))) if args.mesh else None)
  dtypes = split(args.dtypes)
  start = time.perf_counter()
  table = tune(
    mesh,
    sizes=[_parse_size(s) for s in split(args.sizes)],
    dtypes=dtypes,
    ops=split(args.ops),
    gradient_trees=[
      synthetic_gradients(_parse_size(s), d) for s in split(args.gradient_sizes) for d in dtypes
    ],
    batch_norm_shapes=[tuple(map(int, s.split("x"))) for s in split(args.batch_norm_shapes)],
    rounds=args.rounds,
    margin=args.margin,
    output=args.output,
  )
  if jax.process_index() == 0:
    print(tuning.format_table(table))
    print(f"tuned in {time.perf_counter() - start:.0f} s")
  return table


if __name__ == "__main__":
  main(sys.argv[1:])
