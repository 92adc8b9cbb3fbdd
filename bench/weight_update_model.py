"""Modelled saving of weight-update sharding for ResNet-50 on the paper's pod (32x32, batch 32768).

Per device and per step, what the optimizer costs with the gradients all-reduced and LARS
run on every replica, against ``tc.sharded_update(...).apply_gradients`` (LARS and the add
to the weights on a 1/p shard of every layer; the new weights are all-gathered). Its optax
form, ``update``, gathers the update instead and leaves the add to ``optax.apply_updates``
on every replica; that add is printed separately. The communication is the same in both (one
all-reduce's bytes: a reduce-scatter plus an all-gather) and is left out here; see
``python -m torus_collectives.cost_model`` for it.

How the figures are made: the optimizer is compiled by XLA (for this host's CPU, or with
``--topology`` ahead of time for one chip of a TPU generation, with libtpu and
``JAX_PLATFORMS=cpu``) on the shapes a device holds (the full ResNet-50 parameters, or each
layer's 1/p shard, ``ceil(size / p)`` elements), and FLOPs and bytes accessed are read from
``compiled.cost_analysis()``: compiler estimates for those shapes. The pod figures are
modelled: nothing here ran on a pod or a TPU. The sharded LARS is compiled with local
norms; the real one adds one all-reduce of two floats per LARS-scaled kernel (108 floats
for ResNet-50's 54), not counted. The training FLOPs the optimizer's share is taken of are
XLA's estimate for forward and backward of the model at the per-device batch (from the
lowered, unoptimised program).

    JAX_PLATFORMS=cpu python -m bench.weight_update_model            # 32x32, batch 32768
    JAX_PLATFORMS=cpu python -m bench.weight_update_model --topology=v3:2x2   # TPU v3 compiler
    JAX_PLATFORMS=cpu python -m bench.weight_update_model --devices=256 --batch=8192
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import optax
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from resnet import models, optim
from resnet.configs import pod
from torus_collectives.tiling import ceil_div


def _cost(fn, *args, device=None) -> dict[str, float]:
  if device is not None:
    args = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)), args
    )
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _lars(config) -> optax.GradientTransformation:
  return optim.lars(
    optax.constant_schedule(1.0),
    weight_decay=config.weight_decay,
    momentum=config.momentum,
    trust_coefficient=config.lars_trust_coefficient,
    eps=config.lars_eps,
  )


def optimizer_costs(
  params, p: int, tx: optax.GradientTransformation, device=None
) -> dict[str, dict]:
  """Per-device optimizer FLOPs, bytes accessed and state bytes, unsharded and sharded.

  ``params`` is a tree of ``jax.ShapeDtypeStruct``; ``p`` the number of devices; ``device``
  the device to compile for (default: this host's).
  """

  def full_step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  shards = jax.tree.map(lambda x: jax.ShapeDtypeStruct((ceil_div(x.size, p),), x.dtype), params)
  full_state = jax.eval_shape(tx.init, params)
  shard_state = jax.eval_shape(tx.init, shards)
  return {
    "unsharded": {
      **_cost(full_step, params, full_state, params, device=device),
      "state_bytes": _nbytes(full_state),
    },
    "sharded": {
      **_cost(full_step, shards, shard_state, shards, device=device),
      "state_bytes": _nbytes(shard_state),
    },
    # What ``update`` + ``optax.apply_updates`` adds: the gathered update, added everywhere.
    "replicated_add": _cost(optax.apply_updates, params, params, device=device),
  }


def training_flops(model, image_size: int, per_device_batch: int) -> float:
  """XLA's FLOP estimate of forward and backward at the per-device batch."""

  def loss(params, batch_stats, images):
    logits, _ = model.apply(
      {"params": params, "batch_stats": batch_stats},
      images,
      train=True,
      mutable=["batch_stats"],
    )
    return logits.astype(jnp.float32).mean()

  images = jax.ShapeDtypeStruct((per_device_batch, image_size, image_size, 3), model.dtype)
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, image_size, image_size, 3)), train=False)
  )
  lowered = jax.jit(jax.grad(loss)).lower(variables["params"], variables["batch_stats"], images)
  return float(lowered.cost_analysis()["flops"])


def main(argv=None) -> None:
  config = pod.get_config()
  devices = math.prod(config.mesh_shape)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=devices)
  parser.add_argument("--batch", type=int, default=config.global_batch_size)
  parser.add_argument("--topology", help="compile for one chip of this TPU topology (v3:2x2)")
  args = parser.parse_args(argv)
  device, target = None, "XLA:CPU"
  if args.topology:
    device = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices[0]
    target = f"XLA:TPU ({args.topology}, {device.device_kind})"

  model = models.create_model(
    config.model, num_classes=1000, dtype=jnp.dtype(config.dtype), axis_name=None
  )
  size = config.image_size
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
  )["params"]
  n = sum(x.size for x in jax.tree.leaves(params))
  costs = optimizer_costs(params, args.devices, _lars(config), device)
  train = training_flops(model, size, args.batch // args.devices)
  full, sharded = costs["unsharded"], costs["sharded"]
  print(
    f"ResNet-50 ({n:,} parameters, {len(jax.tree.leaves(params))} arrays), LARS, "
    f"{args.devices} devices, batch {args.batch} ({args.batch // args.devices} per device). "
    f"Per device and step; {target} compiler estimates on each layout's shapes, pod "
    "figures modelled."
  )
  print(f"{'':28}{'unsharded':>16}{'sharded':>16}{'ratio':>10}")
  for label, key, scale in (
    ("optimizer GFLOP", "flops", 1e-9),
    ("optimizer bytes accessed MB", "bytes", 1e-6),
    ("optimizer state MB", "state_bytes", 1e-6),
  ):
    a, b = full[key] * scale, sharded[key] * scale
    print(f"{label:28}{a:16.4f}{b:16.4f}{a / b:10.1f}x")
  add = costs["replicated_add"]
  print(
    f"gathering the update instead (optax form): + {add['flops'] * 1e-9:.4f} GFLOP and "
    f"{add['bytes'] * 1e-6:.1f} MB for the add on every replica"
  )
  print(
    f"forward+backward: {train * 1e-9:.1f} GFLOP per device; optimizer share "
    f"{full['flops'] / train:.3%} unsharded, {sharded['flops'] / train:.4%} sharded"
  )


if __name__ == "__main__":
  main()
