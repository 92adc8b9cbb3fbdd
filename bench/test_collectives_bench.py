"""Steady-state time, algbw and busbw of the collectives, per implementation and mesh.

Sizes follow nccl-tests: ``S`` is the full, unscattered buffer (all-reduce: each device's
input; reduce-scatter: each device's input; all-gather: each device's output), algbw is
``S / t`` and busbw is ``algbw * 2(n-1)/n`` for all-reduce, ``algbw * (n-1)/n`` for
reduce-scatter and all-gather. The implementations of a (collective, mesh, size) group are
timed interleaved in one test (``conftest.interleaved``), so ``time_ratio_to_xla`` compares
like with like: it is the median of per-round ratios.

On CPU, the "devices" are threads of one process sharing the host's cores and memory:
these numbers rank the implementations on this platform and say nothing about ICI.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from settings import FULL

import torus_collectives as tc
from torus_collectives.sizes import KiB, MiB, size_label

IMPLEMENTATIONS = ("xla", "shard_map", "lax_torus", "auto")  # those that run on CPU
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
MESHES = ((2, 4), (1, 8))
SIZES = (
  (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
  if FULL
  else (64 * KiB, 4 * MiB)
)
AXES = ("x", "y")
DTYPE = jnp.float32


def _per_device_op(collective: str, implementation: str):
  if collective == "all_reduce":
    return lambda x: tc.all_reduce(x, AXES, implementation=implementation)
  if collective == "reduce_scatter":
    return lambda x: tc.reduce_scatter(x, AXES, tiled=True, implementation=implementation)
  return lambda x: tc.all_gather(x, AXES, tiled=True, implementation=implementation)


def bus_factor(collective: str, n: int) -> float:
  """busbw / algbw, as nccl-tests defines it."""
  return (2 if collective == "all_reduce" else 1) * (n - 1) / n


CASES = [
  pytest.param(c, m, s, id=f"{c}-{m[0]}x{m[1]}-{size_label(s, sep='')}")
  for c, m, s in itertools.product(COLLECTIVES, MESHES, SIZES)
]


@pytest.mark.parametrize("collective,mesh_shape,nbytes", CASES)
def test_collective(benchmark, interleaved, collective, mesh_shape, nbytes):
  mesh = tc.make_torus_mesh(mesh_shape, AXES)
  n = mesh.size
  elements = nbytes // jnp.dtype(DTYPE).itemsize  # S, in elements
  per_device = elements // n if collective == "all_gather" else elements
  spec = P(AXES)
  x = jax.jit(
    lambda: jnp.arange(n * per_device, dtype=DTYPE) % 7, out_shardings=NamedSharding(mesh, spec)
  )()
  calls = {}
  for implementation in IMPLEMENTATIONS:
    fn = jax.jit(
      jax.shard_map(
        _per_device_op(collective, implementation), mesh=mesh, in_specs=spec, out_specs=spec
      )
    )
    calls[implementation] = lambda fn=fn: fn(x)

  benchmark.group = f"{collective} {mesh_shape[0]}x{mesh_shape[1]} {size_label(nbytes, sep='')}"
  runs = interleaved(calls, baseline="xla")

  expected = {"all_reduce": elements, "reduce_scatter": elements // n, "all_gather": elements}[
    collective
  ]
  for implementation in IMPLEMENTATIONS:
    assert calls[implementation]().shape == (n * expected,)
    algbw = nbytes / runs.median(implementation)
    benchmark.extra_info["variants"][implementation].update(
      algbw_GBps=algbw / 1e9, busbw_GBps=algbw * bus_factor(collective, n) / 1e9
    )
  benchmark.extra_info.update(
    collective=collective,
    mesh=f"{mesh_shape[0]}x{mesh_shape[1]}",
    devices=n,
    nbytes=nbytes,
    dtype=jnp.dtype(DTYPE).name,
  )
