"""Compiled bytes accessed of batch norm on TPU v5e: fused Pallas passes vs XLA's fusions.

Compiles, ahead of time on a CPU host with libtpu, the per-replica batch norm of every
ResNet-50 layer shape (bfloat16 NHWC, ReLU fused, statistics local to the replica) for
one v5e chip, forward alone and forward plus backward, once with
``implementation="pallas"``, once with "xla" (the jnp passes as fused by XLA) and once
with ``flax.linen.BatchNorm`` (the usual approach, which a user swaps ours in for), and
prints ``compiled.cost_analysis()["bytes accessed"]``. These are compiler estimates, not
measurements. XLA cannot see inside a Mosaic kernel, so each kernel declares its traffic
(operands plus results) in a ``pl.CostEstimate``; the rest, e.g. any relayout copy around
the kernels, is XLA's own count. X, one activation's bytes, is printed for scale: the
Pallas passes move 3X forward and 8X forward plus backward when nothing surrounds them.

Activations (x, dy, y, dx) enter and leave in the layout XLA's TPU convolutions give them
inside a ResNet-50 step ({3,0,2,1}: H, W, N, C major to minor), since that is where batch
norm runs; ``--layout default`` leaves the choice to XLA as for any entry parameter (row
major for some of these shapes).

  JAX_PLATFORMS=cpu python -m bench.batch_norm_report [--batch 32] [--layout conv]
"""

from __future__ import annotations

import argparse
import math

import flax.linen
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives.norm.batch_norm import batch_norm

RESNET50_BN_SHAPES = [
  (112, 112, 64),
  (56, 56, 64),
  (56, 56, 256),
  (28, 28, 128),
  (28, 28, 512),
  (14, 14, 256),
  (14, 14, 1024),
  (7, 7, 512),
  (7, 7, 2048),
]
# XLA's TPU convolution layout of an NHWC activation, major to minor.
CONV_LAYOUT = Layout(major_to_minor=(1, 2, 0, 3))


def flax_batch_norm(x, scale, bias):
  """``flax.linen.BatchNorm`` in training mode, then ReLU: (y, mean, var), the usual
  approach our batch norm replaces (momentum 0, so its updated statistics are the
  batch's)."""
  module = flax.linen.BatchNorm(use_running_average=False, momentum=0.0, dtype=x.dtype)
  variables = {
    "params": {"scale": scale, "bias": bias},
    "batch_stats": {"mean": jnp.zeros_like(scale), "var": jnp.ones_like(scale)},
  }
  y, updated = module.apply(variables, x, mutable=["batch_stats"])
  return jax.nn.relu(y), updated["batch_stats"]["mean"], updated["batch_stats"]["var"]


def compile_batch_norm(implementation: str, shape, backward: bool, device, layout: str = "conv"):
  """Forward (y, mean, var), or forward plus backward (y, (dx, dscale, dbias)), of the
  local batch norm of a bfloat16 ``shape``, compiled for ``device``: ours with
  ``implementation``, or flax's with "flax"."""
  channels = shape[-1]

  def forward(x, scale, bias):
    if implementation == "flax":
      return flax_batch_norm(x, scale, bias)
    return batch_norm(x, scale, bias, relu=True, implementation=implementation)

  def train(x, scale, bias, dy):
    y, vjp = jax.vjp(lambda *a: forward(*a)[0], x, scale, bias)
    return y, vjp(dy)

  mesh = jax.sharding.Mesh([device], ("d",))
  sharding = NamedSharding(mesh, P())
  act = Format(CONV_LAYOUT, sharding) if layout == "conv" else sharding
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=act)
  p = jax.ShapeDtypeStruct((channels,), jnp.float32, sharding=sharding)
  # The mesh names the target device for "auto" and the kernels' defaults.
  with jax.set_mesh(mesh):
    if backward:
      fn = jax.jit(train, out_shardings=(act, (act, sharding, sharding)))
      return fn.lower(x, p, p, x).compile()
    return jax.jit(forward, out_shardings=(act, sharding, sharding)).lower(x, p, p).compile()


def bytes_accessed(implementation: str, shape, backward: bool, device, layout: str = "conv"):
  compiled = compile_batch_norm(implementation, shape, backward, device, layout)
  return compiled.cost_analysis()["bytes accessed"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32, help="per-replica batch")
  parser.add_argument("--layout", choices=("conv", "default"), default="conv")
  args = parser.parse_args()
  device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
  mib = 1 << 20
  print(
    f"v5e, per-replica batch {args.batch}, bfloat16, {args.layout} layout, MiB accessed "
    "(compiler estimates: compiled cost analysis)"
  )
  print(
    f"{'N,H,W,C':>18} {'X':>6} |{'fwd pallas':>11} {'xla':>7} {'flax':>7} "
    f"{'pallas/xla':>10} {'xla/flax':>8} |{'fwd+bwd pallas':>15} {'xla':>7} {'flax':>7} "
    f"{'pallas/xla':>10} {'xla/flax':>8}"
  )
  for hwc in RESNET50_BN_SHAPES:
    shape = (args.batch, *hwc)
    cells = []
    for backward in (False, True):
      pallas, xla, flax = (
        bytes_accessed(implementation, shape, backward, device, args.layout) / mib
        for implementation in ("pallas", "xla", "flax")
      )
      cells.append(
        f"{pallas:{15 if backward else 11}.1f} {xla:7.1f} {flax:7.1f} "
        f"{pallas / xla:10.2f} {xla / flax:8.2f}"
      )
    x_mib = math.prod(shape) * 2 / mib
    print(f"{str(shape):>18} {x_mib:6.1f} |{cells[0]} |{cells[1]}")


if __name__ == "__main__":
  main()
