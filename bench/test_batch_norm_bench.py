"""Distributed batch norm, forward + backward: the "xla" path against flax.linen.BatchNorm.

Both normalize over all 8 replicas of a 2x4 mesh (synchronized batch norm), in training
mode, at ResNet-50's activation shapes (the output of each stage, channels last) with a
per-replica batch scaled down for CPU. The timed function is one jitted shard_map that
computes the output and the gradients with respect to x, scale and bias; the two variants
of a layer are timed interleaved (``conftest.interleaved``).
"""

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from settings import FULL

import torus_collectives as tc

AXES = ("x", "y")
MESH_SHAPE = (2, 4)
PER_REPLICA_BATCH = 2
EPSILON = 1e-5
# ResNet-50 stage outputs (H, W, C) at 224x224 input.
LAYERS = {
  "res2": (56, 56, 256),
  "res3": (28, 28, 512),
  "res4": (14, 14, 1024),
  "res5": (7, 7, 2048),
}
SHAPES = tuple(LAYERS) if FULL else ("res3", "res5")
VARIANTS = ("flax", "torus_collectives[xla]")


def _ours(x, scale, bias):
  y, _, _ = tc.batch_norm(x, scale, bias, axis_name=AXES, epsilon=EPSILON, implementation="xla")
  return y


def _flax(x, scale, bias):
  module = nn.BatchNorm(use_running_average=False, axis_name=AXES, epsilon=EPSILON)
  stats = {"mean": jnp.zeros_like(scale), "var": jnp.ones_like(scale)}
  y, _ = module.apply(
    {"params": {"scale": scale, "bias": bias}, "batch_stats": stats}, x, mutable=["batch_stats"]
  )
  return y


def _fwd_bwd(norm):
  def step(x, scale, bias, cotangent):
    y, vjp = jax.vjp(norm, x, scale, bias)
    dx, dscale, dbias = vjp(cotangent)
    # Parameter gradients are per-replica partial sums; the optimizer would sum them.
    return y, dx, dscale[None], dbias[None]

  return step


@pytest.mark.parametrize("layer", SHAPES)
def test_batch_norm_fwd_bwd(benchmark, interleaved, layer):
  mesh = tc.make_torus_mesh(MESH_SHAPE, AXES)
  h, w, c = LAYERS[layer]
  batch = PER_REPLICA_BATCH * mesh.size
  data = NamedSharding(mesh, P(AXES))
  key_x, key_g = jax.random.split(jax.random.key(0))
  x = jax.device_put(jax.random.normal(key_x, (batch, h, w, c)), data)
  cotangent = jax.device_put(jax.random.normal(key_g, (batch, h, w, c)), data)
  scale, bias = jnp.full((c,), 1.5), jnp.full((c,), 0.25)
  calls = {}
  for variant in VARIANTS:
    norm = {"torus_collectives[xla]": _ours, "flax": _flax}[variant]
    fn = jax.jit(
      jax.shard_map(
        _fwd_bwd(norm),
        mesh=mesh,
        in_specs=(P(AXES), P(), P(), P(AXES)),
        out_specs=(P(AXES), P(AXES), P(AXES), P(AXES)),
      )
    )
    calls[variant] = lambda fn=fn: fn(x, scale, bias, cotangent)

  benchmark.group = f"batch_norm fwd+bwd {layer} {batch}x{h}x{w}x{c}"
  runs = interleaved(calls, baseline="flax")

  for variant in VARIANTS:
    benchmark.extra_info["variants"][variant].update(
      items_per_s=batch / runs.median(variant), unit="images/s"
    )
  benchmark.extra_info.update(layer=layer)
