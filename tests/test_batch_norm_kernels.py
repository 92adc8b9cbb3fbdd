"""Pallas batch-norm passes: TPU interpret mode vs the jnp reference, and AOT compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives import batch_norm_passes
from torus_collectives.batch_norm import batch_norm
from torus_collectives.configs import BlockSizes
from torus_collectives.kernels import batch_norm as kbn

INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


@pytest.fixture
def interpret_mode():
  try:
    with pltpu.force_tpu_interpret_mode(INTERPRET):
      yield
  finally:
    pltpu.reset_tpu_interpret_mode_state()


def _operands(rows, channels, dtype, seed=0):
  kx, kd, kc = jax.random.split(jax.random.key(seed), 3)
  x = (50.0 + 3.0 * jax.random.normal(kx, (rows, channels))).astype(dtype)
  dy = jax.random.normal(kd, (rows, channels)).astype(dtype)
  stats = batch_norm_passes.stats_reference(x)
  mul = jax.lax.rsqrt(stats[1] / rows + 1e-5) * (1 + 0.1 * jax.random.normal(kc, (channels,)))
  coef = jnp.stack(
    [
      stats[0],
      mul,
      jnp.linspace(-1, 1, channels),
      0.01 * jnp.ones(channels),
      -0.02 * jnp.ones(channels),
    ]
  )
  return x, dy, coef


# rows, channels, block sizes: one block; ragged row blocks; two channel blocks; folded
# lanes (C = 32 -> 4 rows per 128 lanes) with a ragged folded block.
SHAPES = [
  (64, 128, None),
  (200, 128, BlockSizes(block_rows=48, block_channels=128)),
  (96, 256, BlockSizes(block_rows=32, block_channels=128)),
  (352, 32, BlockSizes(block_rows=32, block_channels=128)),
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,channels,block_sizes", SHAPES)
def test_passes_match_reference_in_interpret_mode(
  interpret_mode, rows, channels, block_sizes, dtype
):
  x, dy, coef = _operands(rows, channels, dtype)
  run = jax.jit(
    lambda x, dy, coef: (
      kbn.stats(x, block_sizes=block_sizes),
      kbn.normalize(x, coef[:3], relu=True, block_sizes=block_sizes),
      kbn.backward_sums(x, dy, coef[:3], relu=True, block_sizes=block_sizes),
      kbn.backward_dx(x, dy, coef, relu=True, block_sizes=block_sizes),
    )
  )
  stats, y, sums, dx = run(x, dy, coef)
  np.testing.assert_allclose(stats[0], batch_norm_passes.stats_reference(x)[0], rtol=1e-6)
  np.testing.assert_allclose(stats[1], batch_norm_passes.stats_reference(x)[1], rtol=1e-4)
  out_tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(y, np.float32),
    np.asarray(batch_norm_passes.normalize_reference(x, coef[:3], relu=True), np.float32),
    **out_tol,
  )
  np.testing.assert_allclose(
    sums,
    batch_norm_passes.backward_sums_reference(x, dy, coef[:3], relu=True),
    rtol=1e-4,
    atol=1e-3,
  )
  np.testing.assert_allclose(
    np.asarray(dx, np.float32),
    np.asarray(batch_norm_passes.backward_dx_reference(x, dy, coef, relu=True), np.float32),
    **out_tol,
  )


@pytest.mark.interpret
def test_pallas_op_matches_xla_op_across_a_group_in_interpret_mode(interpret_mode):
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  x = 10.0 + jax.random.normal(jax.random.key(3), (16, 4, 4, 64))
  scale, bias = jnp.linspace(0.5, 1.5, 64), jnp.linspace(-1, 1, 64)
  weights = jax.random.normal(jax.random.key(4), (4, 4, 64))

  def grads(implementation):
    def body(x, scale, bias):
      def loss(x, scale, bias):
        y, mean, var = batch_norm(
          x,
          scale,
          bias,
          axis_name=("x", "y"),
          group_size=2,
          relu=True,
          implementation=implementation,
        )
        return jnp.sum(y * y * weights), (y, mean[None], var[None])

      return jax.grad(loss, (0, 1, 2), has_aux=True)(x, scale, bias)

    spec = P(("x", "y"))
    f = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(spec, P(), P()),
      out_specs=((spec, P(), P()), (spec, spec, spec)),
      check_vma=False,
    )
    return jax.jit(f)(x, scale, bias)

  for a, b in zip(jax.tree.leaves(grads("pallas")), jax.tree.leaves(grads("xla"))):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b))))


def test_block_channels_that_do_not_divide_channels_raise():
  with pytest.raises(ValueError, match="block_channels=128 must divide channels=192"):
    BlockSizes(block_rows=16, block_channels=128).check(64, 192)


def test_misaligned_block_rows_raise():
  with pytest.raises(ValueError, match="block_rows=20 must be a multiple of 16"):
    BlockSizes(block_rows=20, block_channels=128).check(64, 128)


def test_non_positive_block_sizes_raise():
  with pytest.raises(ValueError, match="block sizes must be positive"):
    BlockSizes(block_rows=0, block_channels=128)


# ---------------------------------------------------------------------- AOT for TPU

TOPOLOGIES = ["v4:2x2x2", "v5e:4x4", "v5p:2x2x2", "v6e:4x4"]


def tpu_train_step(topology_name, per_replica_batch, hwc, group_size=2):
  """Compiled forward+backward of the Pallas op, sharded over all chips of a topology."""
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
  devices = np.array(topo.devices)
  mesh = jax.sharding.Mesh(devices.reshape(2, -1), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  spec = P(("x", "y"))
  channels = hwc[-1]

  def step(x, scale, bias):
    def loss(x, scale, bias):
      y, _, _ = batch_norm(
        x,
        scale,
        bias,
        axis_name=("x", "y"),
        group_size=group_size,
        relu=True,
        implementation="pallas",
      )
      return jnp.sum(y.astype(jnp.float32))

    return jax.grad(loss, (0, 1, 2))(x, scale, bias)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P(), P())))
  x = jax.ShapeDtypeStruct(
    (per_replica_batch * devices.size, *hwc), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
  )
  p = jax.ShapeDtypeStruct((channels,), jnp.float32, sharding=NamedSharding(mesh, P()))
  return f.lower(x, p, p).compile()


# Every generation at the largest folded shape; v5e also at the widest and batch 8.
AOT_CASES = [(t, 32, (56, 56, 64)) for t in TOPOLOGIES] + [
  ("v5e:4x4", 32, (7, 7, 2048)),
  ("v5e:4x4", 8, (14, 14, 1024)),
  ("v5e:4x4", 8, (7, 7, 512)),
]


@pytest.mark.aot
@pytest.mark.parametrize("topology_name,per_replica_batch,hwc", AOT_CASES)
def test_compiles_for_tpu(topology_name, per_replica_batch, hwc):
  pytest.importorskip("libtpu")
  compiled = tpu_train_step(topology_name, per_replica_batch, hwc)
  assert "bn_backward_dx" in compiled.as_text()
