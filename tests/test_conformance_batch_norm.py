"""The conformance base of batch norm: ``tc.batch_norm`` against float64 and gathered-batch
references, for every registered implementation of the op.

Parametrized at collection time over the backends whose record has ``batch_norm`` among
its ops ("xla", the jnp passes, and "pallas", the fused kernels; "auto" is "xla" for batch
norm whatever was measured, see ``registry.auto_implementation``) × torus rank (a ring (8,),
a 2-D torus (2, 4), a 3-D torus (2, 2, 2)) × the replica groups of that torus (the whole
mesh, aligned tiles given as a size and as a shape, single replicas) × dtype. Every case
runs under ``jax.shard_map``, differentiating the sum of all replicas' losses (jax's
shard_map autodiff semantics), and compares with references computed from the gathered
batch of each group.

Depth. "xla" runs every case: 3 ranks × 4 groups × 2 dtypes of statistics and outputs
(24, one dtype per assertion set below), 7 (rank, group) × 2 dtypes of gradients (14), and
the tile checks. "pallas" runs its kernels in TPU interpret mode (seconds per pass), on a
spread: the bfloat16 statistics on every 2-D group (as before) and one group of each other
rank, the float32 statistics on one 3-D group, and the gradients of one 2-D group (both
DMA execution modes among them). The kernels' own checks (every pass against the jnp
reference, block sizes, layouts, races, ahead-of-time compiles) are
test_batch_norm_kernels.py's; the module against flax.linen.BatchNorm and the bad inputs
are test_batch_norm.py's.
"""

import functools
import itertools
import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_norm_cases import C, assert_close, inputs, loss
from harness import RANKS
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import groups, registry
from torus_collectives.norm.batch_norm import batch_norm

# Read at collection time: every registered backend that implements batch norm.
IMPLEMENTATIONS = tuple(name for name, b in registry.BACKENDS.items() if "batch_norm" in b.ops)
cases = functools.partial(harness.implementation_cases, IMPLEMENTATIONS)
run = harness.run

# (group_size, the tile it names) per rank: the whole mesh, tiles named by a size (filled
# along the last axis first) and by a shape, and single replicas.
GROUPS = {
  "1d": [(None, (8,)), (2, (2,)), (4, (4,)), (1, (1,))],
  "2d": [(None, (2, 4)), (2, (1, 2)), ((2, 2), (2, 2)), (1, (1, 1))],
  "3d": [(None, (2, 2, 2)), (4, (1, 2, 2)), ((2, 1, 2), (2, 1, 2)), (8, (2, 2, 2))],
}
GROUP_ROWS = [(rank, g, tile) for rank in RANKS for g, tile in GROUPS[rank]]


def _axes(rank):
  mesh = harness.mesh(RANKS[rank])
  return mesh, tuple(mesh.axis_names)


def _boxes(shape, tile):
  """For each replica (row-major over the mesh), the slices of its group's tile."""
  for c in np.ndindex(*shape):
    yield c, tuple(slice(i // t * t, i // t * t + t) for i, t in zip(c, tile))


# ---------------------------------------------------------------------- statistics, outputs


def _group_reference(x, shape, tile):
  """Per replica (row-major over the mesh): its group's mean and variance in float64, and
  its normalized rows (scale 1, bias 0) rounded once to ``x.dtype``."""
  replicas = math.prod(shape)
  per_replica = np.asarray(x, np.float64).reshape(*shape, -1, C)
  means, variances = np.empty(shape + (C,)), np.empty(shape + (C,))
  ys = np.empty(per_replica.shape)
  for c, box in _boxes(shape, tile):
    group = per_replica[box].reshape(-1, C)
    means[c], variances[c] = group.mean(0), group.var(0)
    ys[c] = (per_replica[c] - means[c]) / np.sqrt(variances[c] + 1e-5)
  y = np.asarray(jnp.asarray(ys.reshape(x.shape), jnp.float32).astype(x.dtype), np.float64)
  return means.reshape(replicas, C), variances.reshape(replicas, C), y


BF16_SPREAD = {
  ("2d", None, (2, 4)): "on_wait",
  ("2d", 2, (1, 2)): "eager",
  ("2d", (2, 2), (2, 2)): "on_wait",
  ("2d", 1, (1, 1)): "eager",
  ("1d", 2, (2,)): "on_wait",
  ("3d", (2, 1, 2), (2, 1, 2)): "eager",
}


@cases("rank,group_size,tile", rows=GROUP_ROWS, spread=BF16_SPREAD)
def test_bfloat16_statistics_and_outputs_match_float64(impl, dma, rank, group_size, tile):
  """bfloat16 activations (mean 3, spread 2), statistics in float32: against float64 on the
  same bfloat16 values, tight enough to catch a 0.4 % variance error.

  * mean and var: float32 sums over at most 256 rows per channel round by about
    sqrt(R) * u = 1e-6 relative (u = 2**-24; the group's M2 adds non-negative terms, no
    cancellation): rtol 2e-5, 200 times below 4e-3.
  * y in bfloat16: rounding the float64 result gives it within float32 error, so each
    element is the correctly rounded value or (when the exact value lies within that error
    of a rounding boundary) one ulp off, which is rare (none of these 4096 elements). A
    0.4 % variance error moves y by 0.2 %, half a bfloat16 ulp (2**-8 relative):
    about half the elements would round the other way, so at most 1 % may differ.
  """
  mesh, axes = _axes(rank)
  x, _, _, _ = inputs(jnp.bfloat16, offset=3.0, seed=5)
  ones, zeros = jnp.ones(C), jnp.zeros(C)

  def body(x):
    y, mean, var = batch_norm(
      x, ones, zeros, axis_name=axes, group_size=group_size, implementation=impl
    )
    return y, mean[None], var[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
  y, mean, var = run(impl, lambda: f(x), dma)
  want_mean, want_var, want_y = _group_reference(x, RANKS[rank], tile)
  assert y.dtype == jnp.bfloat16 and mean.dtype == var.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(var), want_var, rtol=2e-5)
  y = np.asarray(y, np.float64)
  ulp = np.spacing(np.abs(want_y).astype(np.float32)) * 2.0**16  # bfloat16's: 2**16 float32 ulps
  assert np.all(np.abs(y - want_y) <= ulp)
  assert np.mean(y != want_y) <= 0.01, f"{np.mean(y != want_y):.3%} of y differ"


@cases("rank,group_size,tile", rows=GROUP_ROWS, spread={("3d", (2, 1, 2), (2, 1, 2)): "on_wait"})
def test_float32_statistics_and_outputs_match_float64(impl, dma, rank, group_size, tile):
  """Group statistics over a tile, and the normalized rows, equal those of the tile's
  gathered batch (float32 normal activations, 6 rows of 4 channels per replica)."""
  mesh, axes = _axes(rank)
  shape = RANKS[rank]
  x = np.random.default_rng(6).standard_normal((8, 3, 2, 4)).astype(np.float32)
  ones, zeros = jnp.ones(4), jnp.zeros(4)
  y, mean = run(
    impl,
    lambda: harness.per_device(
      lambda v: tc.batch_norm(
        v, ones, zeros, axis_name=axes, group_size=group_size, implementation=impl
      )[:2],
      mesh,
      x,
    ),
    dma,
  )
  grid = x.reshape(*shape, 6, 4).astype(np.float64)
  for c, box in _boxes(shape, tile):
    rows = grid[box].reshape(-1, 4)
    want = (grid[c] - rows.mean(0)) / np.sqrt(rows.var(0) + 1e-5)
    d = np.ravel_multi_index(c, shape)
    np.testing.assert_allclose(np.asarray(mean[d]), rows.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y[d]).reshape(6, 4), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- gradients


def _reference_total_loss(x, weights, scale, bias, shape, tile, relu):
  """Sum of all replicas' losses, each group normalized on its gathered batch (jnp)."""
  per_replica = x.reshape(*shape, -1, *x.shape[1:]).astype(jnp.float32)
  total = 0.0
  for corner in itertools.product(*(range(0, n, t) for n, t in zip(shape, tile))):
    group = per_replica[tuple(slice(c, c + t) for c, t in zip(corner, tile))]
    reduce = tuple(range(group.ndim - 1))
    mean = jnp.mean(group, axis=reduce)
    var = jnp.mean((group - mean) ** 2, axis=reduce)
    y = (group - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias
    y = jnp.maximum(y, 0) if relu else y
    total += loss(y.astype(x.dtype), weights)
  return total


# (rank, group_size, tile, relu)
GRADIENT_GROUPS = [
  ("1d", 2, (2,), True),
  ("1d", 4, (4,), False),
  ("2d", 2, (1, 2), True),
  ("2d", 4, (1, 4), False),
  ("2d", (2, 2), (2, 2), True),
  ("3d", 2, (1, 1, 2), True),
  ("3d", (2, 1, 2), (2, 1, 2), False),
]


@cases(
  "rank,group_size,tile,relu,dtype",
  rows=[(*g, dtype) for g in GRADIENT_GROUPS for dtype in (jnp.float32, jnp.bfloat16)],
  spread={("2d", 2, (1, 2), True, jnp.float32): "on_wait"},
)
def test_gradients_match_gathered_reference(impl, dma, rank, group_size, tile, relu, dtype):
  mesh, axes = _axes(rank)
  x, weights, scale, bias = inputs(dtype, offset=3.0)

  def body(x, scale, bias):
    def total(x, scale, bias):
      y, _, _ = batch_norm(
        x, scale, bias, axis_name=axes, group_size=group_size, relu=relu, implementation=impl
      )
      return loss(y, weights)

    return jax.grad(total, (0, 1, 2))(x, scale, bias)

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(), P()), out_specs=(P(axes), P(), P()))
  )
  got = run(impl, lambda: f(x, scale, bias), dma)
  want = jax.grad(_reference_total_loss, (0, 2, 3))(
    x, weights, scale, bias, RANKS[rank], tile, relu
  )
  count = x.size // C // mesh.size * math.prod(tile)
  for a, b in zip(got, want):
    assert_close(a, b, dtype, count)


# ---------------------------------------------------------------------- tiles


@cases("rank", RANKS)
def test_group_statistics_are_identical_within_a_tile(impl, dma, rank):
  """Group 2 is a pair of neighbours along the last axis: the two replicas of a pair share
  mean and var bit for bit, and neighbouring pairs do not."""
  mesh, axes = _axes(rank)
  x, _, scale, bias = inputs(jnp.float32, offset=100.0)
  f = jax.shard_map(
    lambda x: tuple(
      s[None]
      for s in batch_norm(x, scale, bias, axis_name=axes, group_size=2, implementation=impl)[1:]
    ),
    mesh=mesh,
    in_specs=P(axes),
    out_specs=(P(axes), P(axes)),
  )
  for stat in run(impl, lambda: jax.jit(f)(x), dma):
    stat = np.asarray(stat).reshape(-1, 2, C)  # pairs of consecutive replicas: the tiles
    np.testing.assert_array_equal(stat[:, 0], stat[:, 1])
    assert not np.array_equal(stat[0::2, 0], stat[1::2, 0])


# Aligned tiles of each torus, for the statistics sum.
SUM_TILES = {
  "1d": [(8,), (4,), (2,), (1,)],
  "2d": [(2, 4), (1, 4), (2, 2), (1, 2), (2, 1)],
  "3d": [(2, 2, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 2), (2, 1, 1)],
}


@pytest.mark.parametrize(
  "rank,tile",
  [(rank, tile) for rank in RANKS for tile in SUM_TILES[rank]],
  ids=[f"{rank}-{'x'.join(map(str, tile))}" for rank in RANKS for tile in SUM_TILES[rank]],
)
def test_group_sums_over_tiles(rank, tile):
  """The batch-norm statistics sum (``tc.group_sum``, on the collectives' "auto"): each
  replica gets the sum over its aligned tile."""
  mesh, axes = _axes(rank)
  shape = RANKS[rank]
  x = harness.small_integers((8, 4), np.float32, seed=5)
  got = np.asarray(harness.per_device(lambda v: tc.group_sum(v, axes, tile), mesh, x))
  grid = x.reshape(*shape, 4)
  for c, box in _boxes(shape, tile):
    np.testing.assert_array_equal(got.reshape(*shape, 4)[c], grid[box].reshape(-1, 4).sum(0))


@pytest.mark.parametrize("tile", [(1, 3), (2,), (2, 4, 1), (1, 0)], ids=str)
def test_group_sum_refuses_what_is_not_a_tile(tile):
  """An extent that does not divide its axis, or a tile of another rank, would sum wrong
  groups: refused before any work, naming ``resolve_tile``; its nearest tile is summed."""
  mesh, axes = _axes("2d")
  x = harness.small_integers((8, 4), np.float32, seed=5)
  with pytest.raises(ValueError, match=r"is not a tile of axes .*tc\.resolve_tile"):
    harness.per_device(lambda v: tc.group_sum(v, axes, tile), mesh, x)
  harness.per_device(lambda v: tc.group_sum(v, axes, (1, 4)), mesh, x)


# (mesh shape, group_size, tile)
RESOLVED = [
  ((8,), None, (8,)),
  ((8,), 2, (2,)),
  ((8,), 8, (8,)),
  ((2, 4), None, (2, 4)),
  ((2, 4), 1, (1, 1)),
  ((2, 4), 2, (1, 2)),
  ((2, 4), 4, (1, 4)),
  ((2, 4), 8, (2, 4)),
  ((2, 4), (2, 2), (2, 2)),
  ((2, 2, 4), 2, (1, 1, 2)),
  ((2, 2, 4), 4, (1, 1, 4)),
  ((2, 2, 4), 8, (1, 2, 4)),
  ((2, 2, 4), 16, (2, 2, 4)),
  ((2, 2, 2), (2, 1, 2), (2, 1, 2)),
]


@pytest.mark.parametrize("shape,group_size,tile", RESOLVED)
def test_resolve_tile_fills_the_last_axis_first(shape, group_size, tile):
  assert groups.resolve_tile(group_size, shape) == tile


# ---------------------------------------------------------------------- the base itself


def test_every_registered_implementation_is_parametrized():
  """A registered batch-norm implementation missing from the parametrization fails here;
  every test runs each implementation without kernels, and an implementation with kernels
  runs them on every rank somewhere."""
  registered = {n for n, b in registry.BACKENDS.items() if "batch_norm" in b.ops}
  assert set(IMPLEMENTATIONS) == registered
  tests = {n: f for n, f in globals().items() if n.startswith("test_") and callable(f)}
  for name, test in tests.items():
    found = harness.parametrized_implementations(test)
    if found:
      assert {i for i in registered if not harness.kernels(i)} <= found, name
  for impl in filter(harness.kernels, registered):
    ranks = {
      p.values[2]
      for test in tests.values()
      for m in getattr(test, "pytestmark", [])
      if m.name == "parametrize" and m.args[0].startswith("impl,dma,rank")
      for p in m.args[1]
      if p.values[0] == impl and p.values[1] is not None
    }
    assert ranks == set(RANKS), f"{impl} runs its kernels on {ranks} only"
