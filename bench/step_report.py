"""Compiled bytes accessed of a whole ResNet-50 training step, per batch-norm implementation.

Compiles, ahead of time on a CPU host with libtpu, one data-parallel ResNet-50 step
(forward, backward, gradient mean over the mesh) for a TPU topology, once per batch-norm
implementation, and prints ``cost_analysis()["bytes accessed"]`` of each. Everything but
the batch norm is the same program: bfloat16 compute, batch-norm statistics over groups of
``--bn-group`` replicas, gradients averaged with ``lax.pmean`` (so the gradient collective
does not differ between the rows). These are compiler estimates, not measurements.

Rows: "xla", "pallas" (every batch norm), "auto" (nothing measured: XLA), and
"auto-measured": "auto" under a tuning table in which Pallas was measured faster at every
batch-norm size. "auto" must never move more than "xla", measured or not; for batch norm
the registry's rule keeps XLA whatever was measured, since this report found the kernels,
which win alone, losing inside the step.

  JAX_PLATFORMS=cpu python -m bench.step_report [--topology v5e:4x4] [--batch 32]
  JAX_PLATFORMS=cpu python -m bench.step_report --model resnet_tiny  # a quick look

ResNet-50 takes a minute or two to compile per row on a small host.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resnet import models
from torus_collectives import groups
from torus_collectives.norm import linen as tc_nn
from torus_collectives.testing.aot import topology_mesh
from torus_collectives.tuning import tables

IMPLEMENTATIONS = ("xla", "pallas", "auto", "auto-measured")


def pallas_measured_faster(device_kind: str, bn_tile: tuple[int, ...]) -> tables.Table:
  """A hypothetical tuning table: Pallas batch norm measured faster at every size, in two
  runs from two processes (so the rule accepts it), each at half XLA's time."""
  runs = [
    tables.Run.of({"pallas": [0.5] * tables.MIN_ROUNDS}, process=f"hypothetical-{i}")
    for i in range(tables.MIN_RUNS)
  ]
  entry = tables.Entry.from_runs(tables.topology(bn_tile), "batch_norm", "bfloat16", 0, runs)
  return tables.Table(device_kind, "hypothetical: Pallas faster", tables.now(), [entry])


def lower_step(mesh, implementation: str, *, model: str, batch: int, image: int, bn_group: int):
  """One training step's forward, backward and gradient mean, lowered for ``mesh``."""
  net = models.create_model(
    model,
    num_classes=1000,
    dtype=jnp.bfloat16,
    axis_name=mesh.axis_names,
    bn_group_size=bn_group,
    norm=functools.partial(tc_nn.BatchNorm, implementation=implementation),
  )
  variables = jax.eval_shape(
    lambda: net.init(jax.random.key(0), jnp.zeros((1, image, image, 3)), train=False)
  )
  axes = mesh.axis_names

  def step(params, batch_stats, images, labels):
    def loss_fn(p):
      logits, updates = net.apply(
        {"params": p, "batch_stats": batch_stats}, images, train=True, mutable=["batch_stats"]
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, updates["batch_stats"]

    grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
    return lax.pmean(grads, axes), lax.pmean(new_stats, axes)

  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(axes))

  def abstract(tree, sharding):
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding), tree)

  fn = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P(), P(axes), P(axes)), out_specs=(P(), P()), check_vma=False
    )
  )
  images = jax.ShapeDtypeStruct((mesh.size * batch, image, image, 3), jnp.bfloat16, sharding=split)
  labels = jax.ShapeDtypeStruct((mesh.size * batch,), jnp.int32, sharding=split)
  return fn.lower(
    abstract(variables["params"], replicated),
    abstract(variables["batch_stats"], replicated),
    images,
    labels,
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:4x4")
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--batch", type=int, default=32, help="per-replica batch")
  parser.add_argument("--image", type=int, default=224)
  parser.add_argument("--bn-group", type=int, default=4, help="replicas per BN group")
  parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
  args = parser.parse_args(argv)
  mesh = topology_mesh(args.topology)
  print(
    f"{args.model} step on {args.topology} (mesh {dict(mesh.shape)}), per-replica batch "
    f"{args.batch}, {args.image}px bfloat16, BN group {args.bn_group}: GiB accessed per "
    "device (XLA compiler estimates, not measurements)"
  )
  figures = {}
  device_kind = mesh.devices.flat[0].device_kind
  bn_tile = groups.resolve_tile(args.bn_group, tuple(mesh.shape.values()))
  for implementation in args.implementations.split(","):
    measured = implementation == "auto-measured"
    tables.use_table(pallas_measured_faster(device_kind, bn_tile) if measured else None)
    compiled = lower_step(
      mesh,
      "auto" if measured else implementation,
      model=args.model,
      batch=args.batch,
      image=args.image,
      bn_group=args.bn_group,
    ).compile()
    cost = compiled.cost_analysis()
    figures[implementation] = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
    ratio = figures[implementation] / figures.get("xla", figures[implementation])
    print(
      f"  BN implementation={implementation!r:15s} {figures[implementation] / 2**30:8.2f} GiB"
      f"   x XLA BN: {ratio:.3f}",
      flush=True,
    )


if __name__ == "__main__":
  main()
