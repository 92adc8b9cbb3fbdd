"""Modelled saving of weight-update sharding for ResNet-50 on the paper's pod (32x32, batch 32768).

Per device and per step, what the optimizer costs with the gradients all-reduced and LARS
run on every replica, against ``tc.sharded_update`` (LARS on a 1/p shard of every layer,
then one add of the all-gathered update). The communication is the same in both (one
all-reduce's bytes: a reduce-scatter plus an all-gather) and is left out here; see
``python -m torus_collectives.cost_model`` for it.

How the figures are made: the optimizer is compiled by XLA for this host's CPU on the
shapes a device holds (the full ResNet-50 parameters, or each layer's 1/p shard,
``ceil(size / p)`` elements), and FLOPs and bytes accessed are read from
``compiled.cost_analysis()``: compiler estimates for those shapes. The
pod figures are modelled: nothing here ran on a pod or a TPU. The sharded LARS is compiled
with local norms; the real one adds one all-reduce of two floats per LARS-scaled kernel
(108 floats for ResNet-50's 54), not counted. The training FLOPs the ratio is
taken against are XLA's estimate for forward and backward of the model at the per-device
batch (from the lowered, unoptimised program).

    JAX_PLATFORMS=cpu python -m bench.weight_update_model            # 32x32, batch 32768
    JAX_PLATFORMS=cpu python -m bench.weight_update_model --devices=256 --batch=8192
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import optax

from resnet import models, optim
from resnet.configs import pod
from torus_collectives.layout import ceil_div


def _cost(fn, *args) -> dict[str, float]:
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


def optimizer_costs(params, p: int, tx: optax.GradientTransformation) -> dict[str, dict]:
  """Per-device optimizer FLOPs, bytes accessed and state bytes, unsharded and sharded.

  ``params`` is a tree of ``jax.ShapeDtypeStruct``; ``p`` the number of devices.
  """

  def full_step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def shard_step(grads, state, params):
    return tx.update(grads, state, params)

  shards = jax.tree.map(lambda x: jax.ShapeDtypeStruct((ceil_div(x.size, p),), x.dtype), params)
  full_state = jax.eval_shape(tx.init, params)
  shard_state = jax.eval_shape(tx.init, shards)
  unsharded = _cost(full_step, params, full_state, params)
  optimizer = _cost(shard_step, shards, shard_state, shards)
  apply = _cost(optax.apply_updates, params, params)  # the gathered update, added everywhere
  return {
    "unsharded": {**unsharded, "state_bytes": _nbytes(full_state)},
    "sharded": {
      "flops": optimizer["flops"] + apply["flops"],
      "bytes": optimizer["bytes"] + apply["bytes"],
      "optimizer_flops": optimizer["flops"],
      "apply_flops": apply["flops"],
      "state_bytes": _nbytes(shard_state),
    },
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
  args = parser.parse_args(argv)

  model = models.create_model(
    config.model, num_classes=1000, dtype=jnp.dtype(config.dtype), axis_name=None
  )
  size = config.image_size
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
  )["params"]
  n = sum(x.size for x in jax.tree.leaves(params))
  costs = optimizer_costs(params, args.devices, _lars(config))
  train = training_flops(model, size, args.batch // args.devices)
  full, sharded = costs["unsharded"], costs["sharded"]
  print(
    f"ResNet-50 ({n:,} parameters, {len(jax.tree.leaves(params))} arrays), LARS, "
    f"{args.devices} devices, batch {args.batch} ({args.batch // args.devices} per device). "
    "Per device and step; XLA:CPU compiler estimates on each layout's shapes, pod figures "
    "modelled."
  )
  print(f"{'':28}{'unsharded':>16}{'sharded':>16}{'ratio':>10}")
  for label, key, scale in (
    ("optimizer GFLOP", "flops", 1e-9),
    ("optimizer bytes accessed MB", "bytes", 1e-6),
    ("optimizer state MB", "state_bytes", 1e-6),
  ):
    a, b = full[key] * scale, sharded[key] * scale
    print(f"{label:28}{a:16.4f}{b:16.4f}{a / b:10.1f}x")
  print(
    f"sharded FLOPs: LARS on shards {sharded['optimizer_flops'] * 1e-9:.4f} G + adding the "
    f"gathered update {sharded['apply_flops'] * 1e-9:.4f} G"
  )
  print(
    f"forward+backward: {train * 1e-9:.1f} GFLOP per device; optimizer share "
    f"{full['flops'] / train:.3%} unsharded, {sharded['flops'] / train:.4%} sharded"
  )


if __name__ == "__main__":
  main()
