"""How much gradient communication a compiled ResNet training step exposes.

Compiles, ahead of time on a CPU host with libtpu, the ResNet example's own data-parallel
train step (``resnet.train.build_train_step`` with the imagenet config) for a TPU topology,
reads its scheduled program (``testing.hlo_schedule``: ENTRY order, async start/done
pairs, Pallas calls, the compiler's ``estimated_cycles``) and prices every gradient
collective with ``torus_collectives.cost_model`` (the split torus schedule over the
collective's mesh axes, on the generation's links). A synchronous collective blocks; an
async one overlaps the compute scheduled between its start and its done. These are
compiler estimates and a model, not measurements.

  JAX_PLATFORMS=cpu python -m bench.overlap_report --topology v5e:4x4 --batch 32
  JAX_PLATFORMS=cpu python -m bench.overlap_report --xla-settings default   # plain XLA
  JAX_PLATFORMS=cpu python -m bench.overlap_report --rows                  # every row

With no options beyond topology, model and batch it compiles what ``python -m resnet``
runs there with the imagenet config (weight-update sharding, "auto", the package's XLA
settings). ``--rows`` runs each standard row in a process of its own, since libtpu reads
its flags once per process.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resnet import grad_sync, train
from resnet.configs import imagenet
from torus_collectives import cost_model, xla_settings
from torus_collectives.gradients import GRADIENT_SCOPE, WEIGHT_GATHER_SCOPE
from torus_collectives.kernels import leaf_kernels
from torus_collectives.testing import hlo_schedule
from torus_collectives.testing.aot import topology_mesh

ROWS = {
  # label: (implementation, weight-update sharding, XLA settings, summation threaded)
  "xla, default flags": ("xla", False, "default", False),
  "xla, package settings": ("xla", False, "package", False),
  "lax_torus, package settings": ("lax_torus", False, "package", False),
  "pallas (blocking kernels)": ("pallas", False, "package", False),
  "pallas split kernels, threaded": ("pallas", False, "package", True),
  "weight-update sharding, deferred gather": ("auto", True, "package", False),
  "weight-update sharding, default flags": ("auto", True, "default", False),
}


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:4x4")
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--batch", type=int, default=32, help="per-replica batch")
  parser.add_argument("--implementation", default=None, help="gradient summation")
  parser.add_argument(
    "--weight-update-sharding", choices=("on", "off"), default=None, help="default: config"
  )
  parser.add_argument("--xla-settings", choices=("package", "default"), default="package")
  parser.add_argument(
    "--grad-overlap",
    choices=("on", "off"),
    default=None,
    help="thread the summation through the backward pass (config.grad_overlap)",
  )
  parser.add_argument(
    "--threaded-update",
    choices=("on", "off"),
    default="on",
    help="with --grad-overlap on: the optimizer's step threaded too, or after the last call",
  )
  parser.add_argument("--bucket-mib", type=float, default=None, help="gradient bucket size")
  parser.add_argument(
    "--dump-hlo", default=None, help="write the compiled program here (--rows: a directory)"
  )
  parser.add_argument(
    "--from-hlo", default=None, help="read a program --dump-hlo wrote instead of compiling"
  )
  parser.add_argument("--rows", action="store_true", help="every standard row")
  parser.add_argument("--quiet", action="store_true", help="print only the last line")
  return parser.parse_args(argv)


def lower_train_step(
  topology: str,
  model: str,
  batch: int,
  implementation,
  sharded,
  bucket_bytes=None,
  overlap=None,
  mesh_shape=None,
  threaded_update=True,
  image_size=None,
):
  """The example's train step, lowered for ``topology`` with abstract state and batch;
  ``overlap``: ``config.grad_overlap`` (None: the config's); ``threaded_update`` False:
  with it, the optimizer's step after the last call (``update_after``); ``mesh_shape``: a
  torus mesh of that shape (``testing.aot.topology_mesh``; default 2-D); ``image_size``:
  the images' side (default: the config's). A combination the example refuses (such as
  ``overlap`` with weight-update sharding) raises its ``ValueError``."""
  mesh = topology_mesh(topology, mesh_shape)
  config = imagenet.get_config(global_batch=batch * mesh.devices.size)
  config.model = model
  if image_size is not None:
    config.image_size = image_size
  if implementation is not None:
    config.grad_implementation = implementation
  if bucket_bytes is not None:
    config.grad_bucket_bytes = bucket_bytes
  if overlap is not None:
    config.grad_overlap = overlap
  if sharded is not None:
    config.weight_update_sharding = sharded
    config.defer_weight_gather = sharded and config.defer_weight_gather
  built = train.build_train_step(
    config, mesh, num_classes=1000, steps_per_epoch=100, total_steps=10_000
  )
  step = built.train_step
  if isinstance(built.sync, grad_sync.ThreadedAllReduce) and not threaded_update:
    sync = dataclasses.replace(
      built.sync, value_and_averaged_grad=update_after(built.sync.value_and_averaged_grad)
    )
    step = train.make_train_step(
      built.model,
      sync.tx,
      built.learning_rate_fn,
      mesh,
      num_classes=1000,
      label_smoothing=config.label_smoothing,
      sync=sync,
    )

  def abstract(spec, subtree):
    sharding = NamedSharding(mesh, spec)
    as_abstract = lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
    return jax.tree.map(as_abstract, subtree)

  running = jax.eval_shape(lambda key: built.sync.layout.to_running(built.init_fn(key)), built.key)
  state = jax.tree.map(abstract, built.running_spec, running, is_leaf=lambda x: isinstance(x, P))
  split = NamedSharding(mesh, P(mesh.axis_names))
  examples = batch * mesh.devices.size
  size = config.image_size
  dtype = jnp.dtype(config.dtype)
  inputs = {
    "image": jax.ShapeDtypeStruct((examples, size, size, 3), dtype, sharding=split),
    "label": jax.ShapeDtypeStruct((examples,), jnp.int32, sharding=split),
  }
  return mesh, jax.jit(step).lower(state, inputs)


def update_after(value_and_averaged_grad):
  """``value_and_averaged_grad`` (``grad_sync.ThreadedAllReduce``'s) with its ``update``
  applied to the summed gradient it returns, after the last call, rather than threaded
  behind the summation: the step ``value_and_summed_grad`` gives without ``update``."""

  def wrapped(loss_fn, axes, update=None):
    summed = value_and_averaged_grad(loss_fn, axes)

    def run(*args):
      value, grads = summed(*args)
      return value, grads if update is None else update(grads)

    return run

  return wrapped


def calibrated_clock(mesh, generation: str, sizes=(2048, 4096, 8192)) -> float:
  """The fastest clock (Hz) at which the compiler's estimate of an ``n``-cubed bf16 matmul
  per device, for each ``n`` in ``sizes``, runs at ``generation``'s published peak
  (``hlo_schedule.implied_clock``), compiled for ``mesh`` with the libtpu this process
  loaded. The estimates' efficiency varies with the tiling (for v5e with libtpu 0.0.50,
  1,552 to 1,712 MHz over these sizes), so the fastest is taken: the shortest compute,
  hence the least overlap."""

  def implied(n):
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    a = jax.ShapeDtypeStruct((n * mesh.devices.size, n), jnp.bfloat16, sharding=sharding)
    b = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(jnp.matmul).lower(a, b).compile()
    cycles = sum(op.cycles or 0 for op in hlo_schedule.entry_ops(compiled.as_text()))
    return hlo_schedule.implied_clock(cycles, 2.0 * n**3, hlo_schedule.PEAK_FLOPS[generation])

  return max(implied(n) for n in sizes)


PRICED = ("all_reduce", "reduce_scatter", "all_gather")  # what cost_model models


def is_data_parallel(op, mesh_axes) -> bool:
  """A collective of the step's gradient summation or weight gather: one in their named
  scopes, or one that XLA made itself (a combined or rewritten collective carries no
  ``op_name``) over the whole mesh. XLA merges the gradient's small leaves into such
  collectives, and rewrites small reduce-scatters as all-reduces; when it merges the
  batch-statistics means in as well, they are counted with them."""
  if any(scope in op.op_name for scope in (GRADIENT_SCOPE, WEIGHT_GATHER_SCOPE)):
    return True
  return not op.op_name and op.kind != "pallas" and set(op.axes or ()) == set(mesh_axes)


def _collective_name(op) -> str:
  """The ``cost_model`` collective an op runs: from its opcode, or (a Pallas call) its
  jax ``op_name``."""
  if op.collective:
    return op.collective.replace("-", "_")
  if "all_gather" in op.op_name:
    return "all_gather"
  if "reduce_scatter" in op.op_name or "psum_scatter" in op.op_name:
    return "reduce_scatter"
  return "all_reduce"


def collective_price(mesh, generation: str):
  """``price(op, nbytes)``: the modelled seconds (``cost_model``, on a ``generation``
  ("v5e") mesh) of a collective op of the compiled step, or of one hop of a split one."""
  generation = cost_model.GENERATIONS[generation]
  sizes = dict(mesh.shape)

  def price(op, nbytes):
    split = hlo_schedule.split_call(op)
    if split is not None:  # one ring hop of a split collective; nbytes: what it sends
      kind, _, axis = split
      n = sizes[axis]
      ring = cost_model.predict(kind, (n,), "ring", n * nbytes, generation)
      return ring.time_s / (n - 1)
    axes = tuple(sizes) if op.kind == "pallas" else (op.axes or tuple(sizes))
    torus = tuple(sizes[a] for a in axes)
    collective = _collective_name(op)
    if nbytes == 0 or max(torus) == 1 or collective not in PRICED:
      return 0.0
    if collective == "all_gather" and op.kind != "pallas":
      nbytes *= math.prod(torus)  # XLA's operand is one shard (a kernel's is the buffer)
    variant = "torus_split" if len(torus) > 1 else "bidirectional_ring"
    # The leaf kernels' reduce-scatter adds each group of leaves as it lands: priced with
    # its adds, in ``leaf_kernels.add_groups``'s min(ADD_GROUPS, leaves) groups.
    pieces = None
    if "leaf_reduce_scatter" in op.name:
      pieces = min(leaf_kernels.ADD_GROUPS, len(op.operands) - 1)  # less the coordinates
    return cost_model.predict(
      collective, torus, variant, nbytes, generation, reduce_pieces=pieces
    ).time_s

  return price


def step_timeline(compiled_text: str, mesh, generation: str, clock_hz: float):
  """The ``hlo_schedule.Timeline`` of one compiled step on a ``generation`` ("v5e") mesh:
  its compute timed at ``clock_hz``, every collective priced by ``collective_price``, the
  gradient summation's and weight gather's (``is_data_parallel``) counted."""
  ops = hlo_schedule.entry_ops(compiled_text)
  counts = lambda op: is_data_parallel(op, tuple(mesh.axis_names))
  return hlo_schedule.timeline(ops, clock_hz, collective_price(mesh, generation), counts=counts)


def report(
  compiled_text: str, mesh, generation: str, flops: float, clock_hz: float, *, quiet=False
) -> str:
  """Rows and the summary line of ``step_timeline``; ``flops`` the step's per device, or
  None when unknown (a program read back from a file)."""
  timeline = step_timeline(compiled_text, mesh, generation, clock_hz)
  lines = []
  if not quiet:
    lines.append(f"{'collective':32s} {'kind':6s} {'MiB':>8s} {'model ms':>9s} {'covered':>8s} "
                 f"{'exposed':>8s} {'waits':>7s}  after last conv")  # fmt: skip
    for row in timeline.rows:
      waits = f"{row.waits}/{row.hops}" if row.kind == "split" else "-"
      lines.append(
        f"{row.name[:32]:32s} {row.kind:6s} {row.nbytes / 2**20:8.3f} {1e3 * row.modelled_s:9.4f}"
        f" {1e3 * row.covered_s:8.4f} {1e3 * row.exposed_s:8.4f} {waits:>7s}"
        f"  {row.after_last_convolution}"
      )
    others = timeline.others
    lines.append(
      f"other collectives (batch norm, metrics; timed, not counted above): {len(others)}, "
      f"{1e3 * sum(r.modelled_s for r in others):.3f} ms modelled, "
      f"{1e3 * sum(r.exposed_s for r in others):.3f} ms exposed"
    )
    ops = hlo_schedule.entry_ops(compiled_text)
    chains = hlo_schedule.split_chains(ops)
    if chains:
      problems = hlo_schedule.split_schedule_problems(ops)
      lines.append(
        f"split collectives: {len(chains)} chains of {sum(map(len, chains))} calls; "
        f"schedule problems: {'; '.join(problems) if problems else 'none'}"
      )
      loads = hlo_schedule.link_loads(ops, clock_hz, collective_price(mesh, generation))
      first, tightest = loads[0], max(loads, key=lambda load: load.share)
      lines.append(
        f"split links: from the first call on, the busiest carries {1e3 * first.need_s:.3f} "
        f"ms against {1e3 * first.compute_s:.3f} ms of compute ({100 * first.share:.0f} %); "
        f"the tightest, from {tightest.first}, {1e3 * tightest.need_s:.3f} against "
        f"{1e3 * tightest.compute_s:.3f} ms ({100 * tightest.share:.0f} %)"
      )
    lines.append(
      f"{generation} clock {clock_hz / 1e6:.0f} MHz, calibrated on a bf16 matmul at peak; "
      "compiler estimates and the cost model, not measurements"
    )
    if flops:
      peak = hlo_schedule.PEAK_FLOPS[generation]
      lines.append(
        f"compute estimate / (FLOPs at peak): {timeline.compute_s / (flops / peak):.2f} "
        f"({flops / 1e9:.1f} GFLOP per device)"
      )
    by_category = hlo_schedule.compute_by_category(compiled_text)
    lines.append(
      "compute by category (ms): "
      + ", ".join(f"{name} {1e3 * c / clock_hz:.3f}" for name, c in by_category.items())
    )
    lines.append(
      f"step estimate: {1e3 * timeline.step_s:.3f} ms (compute and exposed communication)"
    )
  lines.append(timeline.summary())
  return "\n".join(lines)


def run_rows(args) -> None:
  """Each standard row in a fresh process (libtpu reads its flags once per process)."""
  print(
    f"{args.model}, per-replica batch {args.batch}, on {args.topology} (compiler estimates "
    "and the cost model, not measurements)"
  )
  for label, (implementation, sharded, settings, overlap) in ROWS.items():
    command = [sys.executable, "-m", "bench.overlap_report", "--quiet"]
    command += ["--topology", args.topology, "--model", args.model, "--batch", str(args.batch)]
    command += ["--implementation", implementation, "--xla-settings", settings]
    command += ["--weight-update-sharding", "on" if sharded else "off"]
    command += ["--grad-overlap", "on" if overlap else "off"]
    if args.dump_hlo:  # with --rows: a directory, one program per row
      os.makedirs(args.dump_hlo, exist_ok=True)
      name = "".join(c if c.isalnum() else "_" for c in label)
      command += ["--dump-hlo", os.path.join(args.dump_hlo, f"{name}.hlo")]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    last = result.stdout.strip().splitlines()[-1:] or [result.stderr.strip()[-300:]]
    print(f"  {label:30s} {last[0]}", flush=True)


def main(argv=None) -> None:
  args = _parse(argv)
  if args.rows:
    run_rows(args)
    return
  if args.xla_settings == "package":
    xla_settings.apply()  # importing jax starts no backend; the topology below does
  else:
    os.environ.pop("LIBTPU_INIT_ARGS", None)
  generation = args.topology.split(":")[0]
  if args.from_hlo:
    mesh = topology_mesh(args.topology)
    with open(args.from_hlo) as f:
      text = f.read()
    clock = calibrated_clock(mesh, generation)
    print(report(text, mesh, generation, None, clock, quiet=args.quiet))
    return
  sharded = None if args.weight_update_sharding is None else args.weight_update_sharding == "on"
  mesh, lowered = lower_train_step(
    args.topology,
    args.model,
    args.batch,
    args.implementation,
    sharded,
    None if args.bucket_mib is None else int(args.bucket_mib * 2**20),
    None if args.grad_overlap is None else args.grad_overlap == "on",
    threaded_update=args.threaded_update == "on",
  )
  compiled = lowered.compile()
  text = compiled.as_text()
  if args.dump_hlo:
    with open(args.dump_hlo, "w") as f:
      f.write(text)
  cost = compiled.cost_analysis()
  flops = (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)
  clock = calibrated_clock(mesh, generation)
  print(report(text, mesh, generation, flops, clock, quiet=args.quiet))


if __name__ == "__main__":
  main()
