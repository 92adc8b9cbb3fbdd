"""How much gradient communication a compiled ResNet training step exposes.

Compiles, ahead of time on a CPU host with libtpu, the ResNet example's own data-parallel
train step (``resnet.train.make_train_step`` with the imagenet config) for a TPU topology,
reads its scheduled program (``bench.hlo_schedule``: ENTRY order, async start/done
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
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from bench import hlo_schedule
from bench.aot_report import topology_mesh
from resnet import optim, train
from resnet.configs import imagenet
from torus_collectives import cost_model, xla_settings

ROWS = {
  # label: (implementation, weight-update sharding, XLA settings)
  "xla, default flags": ("xla", False, "default"),
  "xla, package settings": ("xla", False, "package"),
  "lax_torus, package settings": ("lax_torus", False, "package"),
  "pallas (blocking kernels)": ("pallas", False, "package"),
  "weight-update sharding": ("auto", True, "package"),
}
COLLECTIVE_NAMES = {"all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter"}


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
  parser.add_argument("--dump-hlo", default=None, help="write the compiled program here")
  parser.add_argument("--rows", action="store_true", help="every standard row")
  parser.add_argument("--quiet", action="store_true", help="print only the last line")
  return parser.parse_args(argv)


def lower_train_step(topology: str, model: str, batch: int, implementation, sharded):
  """The example's train step, lowered for ``topology`` with abstract state and batch."""
  mesh = topology_mesh(topology)
  config = imagenet.get_config(global_batch=batch * mesh.devices.size)
  config.model = model
  if implementation is not None:
    config.grad_implementation = implementation
  if sharded is not None:
    config.weight_update_sharding = sharded
  net = train.create_model(config, 1000, mesh)
  learning_rate_fn = train.create_learning_rate_fn(config, steps_per_epoch=100, total_steps=10_000)
  tx, opt_state_spec = optim.create_optimizer(config, learning_rate_fn, mesh.axis_names)
  init = train.make_init_fn(net, tx, config.image_size, mesh, opt_state_spec)
  specs = train.state_specs(opt_state_spec)

  def abstract(spec, subtree):
    sharding = NamedSharding(mesh, spec)
    as_abstract = lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
    return jax.tree.map(as_abstract, subtree)

  state = jax.tree.map(
    abstract, specs, jax.eval_shape(init, jax.random.key(0)), is_leaf=lambda x: isinstance(x, P)
  )
  split = NamedSharding(mesh, P(mesh.axis_names))
  examples = batch * mesh.devices.size
  size = config.image_size
  dtype = jnp.dtype(config.dtype)
  inputs = {
    "image": jax.ShapeDtypeStruct((examples, size, size, 3), dtype, sharding=split),
    "label": jax.ShapeDtypeStruct((examples,), jnp.int32, sharding=split),
  }
  average = None
  if not config.weight_update_sharding:
    average = lambda grads, axes: tc.all_reduce_gradients(
      grads, axes, implementation=config.grad_implementation
    )
  step = train.make_train_step(
    net,
    tx,
    learning_rate_fn,
    mesh,
    num_classes=1000,
    label_smoothing=config.label_smoothing,
    average_gradients=average,
    opt_state_spec=opt_state_spec,
  )
  return mesh, jax.jit(step).lower(state, inputs)


def report(compiled_text: str, mesh, generation: str, flops: float, *, quiet=False) -> str:
  """Rows and the summary line of one compiled step on a ``generation`` ("v5e") mesh."""
  generation = cost_model.GENERATIONS[generation]
  clock = hlo_schedule.CLOCK_HZ[generation.name]
  sizes = dict(mesh.shape)
  ops = hlo_schedule.entry_ops(compiled_text)

  def axes_of(op):
    return tuple(sizes) if op.kind == "pallas" else op.axes

  def counts(op):  # the gradient's collectives span the whole mesh
    return axes_of(op) is not None and set(axes_of(op)) == set(sizes)

  def price(op, nbytes):
    axes = axes_of(op) or tuple(sizes)
    torus = tuple(sizes[a] for a in axes)
    collective = next(
      (name for text, name in COLLECTIVE_NAMES.items() if text in op.opcode + op.op_name),
      "all_reduce",
    )
    variant = "torus_split" if len(torus) > 1 else "bidirectional_ring"
    if nbytes == 0 or max(torus) == 1:
      return 0.0
    return cost_model.predict(collective, torus, variant, nbytes, generation).time_s

  timeline = hlo_schedule.timeline(ops, clock, price, counts=counts)
  lines = []
  if not quiet:
    lines.append(f"{'collective':32s} {'kind':6s} {'MiB':>8s} {'model ms':>9s} {'covered':>8s} "
                 f"{'exposed':>8s}  after last conv")  # fmt: skip
    for row in timeline.rows:
      lines.append(
        f"{row.name[:32]:32s} {row.kind:6s} {row.nbytes / 2**20:8.3f} {1e3 * row.modelled_s:9.4f}"
        f" {1e3 * row.covered_s:8.4f} {1e3 * row.exposed_s:8.4f}  {row.after_last_convolution}"
      )
    peak = hlo_schedule.PEAK_FLOPS[generation.name]
    lines.append(
      f"compute estimate / (FLOPs at peak): {timeline.compute_s / (flops / peak):.2f} "
      f"({flops / 1e9:.1f} GFLOP, {generation.name} clock {clock / 1e6:.0f} MHz assumed)"
    )
  lines.append(timeline.summary())
  return "\n".join(lines)


def run_rows(args) -> None:
  """Each standard row in a fresh process (libtpu reads its flags once per process)."""
  print(
    f"{args.model}, per-replica batch {args.batch}, on {args.topology} (compiler estimates "
    "and the cost model, not measurements)"
  )
  for label, (implementation, sharded, settings) in ROWS.items():
    command = [sys.executable, "-m", "bench.overlap_report", "--quiet"]
    command += ["--topology", args.topology, "--model", args.model, "--batch", str(args.batch)]
    command += ["--implementation", implementation, "--xla-settings", settings]
    command += ["--weight-update-sharding", "on" if sharded else "off"]
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
  sharded = None if args.weight_update_sharding is None else args.weight_update_sharding == "on"
  mesh, lowered = lower_train_step(
    args.topology, args.model, args.batch, args.implementation, sharded
  )
  compiled = lowered.compile()
  text = compiled.as_text()
  if args.dump_hlo:
    with open(args.dump_hlo, "w") as f:
      f.write(text)
  cost = compiled.cost_analysis()
  flops = (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)
  generation = args.topology.split(":")[0]
  print(report(text, mesh, generation, flops, quiet=args.quiet))


if __name__ == "__main__":
  main()
