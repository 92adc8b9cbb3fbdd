"""Compiled bytes accessed of batch norm on TPU v5e: fused Pallas passes vs XLA's fusions.

Compiles, ahead of time on a CPU host with libtpu, the per-replica batch norm of every
ResNet-50 layer shape (bfloat16 NHWC, ReLU fused) for one v5e chip, forward alone and
forward plus backward, once with ``implementation="pallas"`` and once with "xla" (the
jnp path as fused by XLA), and prints ``compiled.cost_analysis()["bytes accessed"]``.
These are static figures, not measurements. XLA cannot see inside a Mosaic kernel, so
each kernel declares its traffic (operands plus results) in a ``pl.CostEstimate``; the
rest, e.g. relayout copies around the kernels, is XLA's own count.

  JAX_PLATFORMS=cpu python -m bench.batch_norm_report [--batch 32]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives.batch_norm import batch_norm

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


def bytes_accessed(implementation: str, shape, backward: bool, device) -> float:
  channels = shape[-1]

  def forward(x, scale, bias):
    return batch_norm(x, scale, bias, relu=True, implementation=implementation)

  def train(x, scale, bias, dy):
    y, vjp = jax.vjp(lambda *a: forward(*a)[0], x, scale, bias)
    return y, vjp(dy)

  mesh = jax.sharding.Mesh([device], ("d",))
  sharding = NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
  p = jax.ShapeDtypeStruct((channels,), jnp.float32, sharding=sharding)
  args = (x, p, p, x) if backward else (x, p, p)
  compiled = jax.jit(train if backward else forward).lower(*args).compile()
  return compiled.cost_analysis()["bytes accessed"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32, help="per-replica batch")
  args = parser.parse_args()
  device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
  mib = 1 << 20
  print(f"v5e, per-replica batch {args.batch}, bfloat16, MiB accessed (compiled cost analysis)")
  print(
    f"{'N,H,W,C':>18} {'fwd pallas':>11} {'fwd xla':>9} {'ratio':>6} "
    f"{'fwd+bwd pallas':>15} {'fwd+bwd xla':>12} {'ratio':>6}"
  )
  for hwc in RESNET50_BN_SHAPES:
    shape = (args.batch, *hwc)
    row = []
    for backward in (False, True):
      pallas = bytes_accessed("pallas", shape, backward, device) / mib
      xla = bytes_accessed("xla", shape, backward, device) / mib
      row += [pallas, xla, pallas / xla]
    print(
      f"{str(shape):>18} {row[0]:11.1f} {row[1]:9.1f} {row[2]:6.2f} "
      f"{row[3]:15.1f} {row[4]:12.1f} {row[5]:6.2f}"
    )


if __name__ == "__main__":
  main()
