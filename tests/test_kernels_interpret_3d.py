"""The remote-DMA kernels on 3-D tori in TPU interpret mode, against lax.

2x2x2 (8 simulated devices) in this process; 2x2x4 (16) in a subprocess. The split 3-D
schedule runs six streams, and its first reduce-scatter slab spans two grid axes, which the
2-D kernels never see. Every run uses the race detector and NaN-poisoned scratch (see
``test_kernels_interpret.interpreted``); integer inputs make the comparisons exact.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_count_subprocess import run_as_script
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_kernels_interpret import INPUT_ELEMENTS, LAX, SMALL_BLOCKS, interpreted

import torus_collectives as tc
from torus_collectives.kernels import pallas_backend as kernels

pytestmark = pytest.mark.interpret

AXES = ("x", "y", "z")
MARKER = "2x2x4 kernels match lax"
# 2 blocks of 16 rows per stream slice on the 6-stream torus, minus an odd amount.
MULTI_BLOCK_CHUNK = 6 * 2 * 16 * 128 - 77


def _mesh(shape):
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3)


def _per_device(fn, mesh):
  return jax.jit(
    jax.shard_map(
      lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(AXES), out_specs=P(AXES), check_vma=False
    )
  )


def check_against_lax(shape, collective, axes, dtype, chunk, mode):
  mesh = _mesh(shape)
  torus = tuple(mesh.shape[a] for a in axes)
  p = int(np.prod(torus))
  n = INPUT_ELEMENTS[collective](p, chunk)
  x = jnp.asarray(np.random.default_rng(p).integers(-8, 8, size=(mesh.size, n)), dtype)
  want = _per_device(LAX[collective](axes), mesh)(x)
  ours = getattr(kernels, collective)
  got = interpreted(mode, _per_device(lambda v: ours(v, axes, torus, config=SMALL_BLOCKS), mesh), x)
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


# (collective, axes, dtype, chunk elements, DMA mode): every collective in both modes, on
# several axis orders, a 2-D torus and a ring over a 3-D mesh. Chunks of 300 elements are
# under a tile per stream, so they run one stream; the two larger chunks run all six, in
# pieces, and bfloat16 partial sums travel as bfloat16 (16-row tiles) with float32 adds.
CASES = [
  ("all_reduce", ("x", "y", "z"), jnp.int32, MULTI_BLOCK_CHUNK, "on_wait"),
  ("all_reduce", ("z", "x", "y"), jnp.bfloat16, 6 * 16 * 128 - 5, "eager"),
  ("reduce_scatter", ("y", "z", "x"), jnp.int32, 300, "eager"),
  ("reduce_scatter", ("x", "y", "z"), jnp.float32, 300, "on_wait"),
  ("all_gather", ("z", "y", "x"), jnp.int32, 300, "on_wait"),
  ("all_gather", ("x", "y", "z"), jnp.bfloat16, 300, "eager"),
  ("all_reduce", ("x", "z"), jnp.int32, 300, "on_wait"),
  ("all_reduce", ("y",), jnp.float32, 300, "eager"),
]


@pytest.mark.parametrize(
  "collective,axes,dtype,chunk,mode",
  CASES,
  ids=[f"{c[0]}-{''.join(c[1])}-{jnp.dtype(c[2]).name}-{c[4]}" for c in CASES],
)
def test_kernel_matches_lax_on_2x2x2(collective, axes, dtype, chunk, mode):
  check_against_lax((2, 2, 2), collective, axes, dtype, chunk, mode)


def test_public_api_forward_and_gradient_on_three_axes():
  """tc.reduce_scatter(implementation="pallas") over three axes under check_vma=True,
  with its VJP (the all-gather kernel), against lax."""
  mesh = _mesh((2, 2, 2))
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.integers(-8, 8, size=(8, 8 * 24)), jnp.float32)
  w = jnp.asarray(rng.integers(-8, 8, size=(8, 24)), jnp.float32)
  axes = ("z", "x", "y")

  def loss(impl):
    def per_device(v, u):
      out = tc.reduce_scatter(v[0], axes, tiled=True, implementation=impl)
      return jnp.sum(out * u[0])[None]

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(AXES), P(AXES)), out_specs=P(AXES))
    return jax.jit(jax.value_and_grad(lambda v, u: sharded(v, u).sum()))

  want = loss("xla")(x, w)
  got = interpreted("on_wait", loss("pallas"), x, w)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.slow
def test_2x2x4_in_a_subprocess():
  run_as_script(__file__, 16, MARKER)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  # A 4-long axis: phases of several steps, so the capacity handshake runs between phases.
  check_against_lax((2, 2, 4), "all_reduce", ("z", "y", "x"), jnp.int32, 300, "eager")
  print(MARKER)
