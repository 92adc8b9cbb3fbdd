"""Conformance with jax.lax on 3-D tori: the fallback over three named axes.

2x2x2 runs in this process (8 devices); 2x2x4, which needs 16, re-runs this file in a
subprocess. Every order of the three axes is checked exactly on small integers; floats are
checked against a float64 reference with a bound on the rounding error, and gradients
against lax's. On 2x2x4 the collectives also run over replica groups that tile part of an
axis (rings over 2 of the 4 devices along z), against lax's ``axis_index_groups``.
"""

import functools
import itertools
import math
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_cases import mesh_of, per_device, small_integers
from device_count_subprocess import run_as_script
from jax import lax

import torus_collectives as tc

ORDERS = list(itertools.permutations(("x", "y", "z")))
MARKER = "2x2x4 matches lax"


def _ops(axes, tiled):
  """Ours and lax's reduce-scatter (dims 0, -1), all-gather (dims 0, -1) and all-reduce."""

  def fn(x):
    ours, ref = [], []
    for dim in (0, -1) if tiled else (0,):
      kw = dict(scatter_dimension=dim, tiled=tiled)
      ours.append(tc.reduce_scatter(x, axes, implementation="shard_map", **kw))
      ref.append(lax.psum_scatter(x, axes, **kw))
    for dim in (0, -1):
      ours.append(tc.all_gather(x, axes, axis=dim, tiled=tiled, implementation="shard_map"))
      ref.append(lax.all_gather(x, axes, axis=dim, tiled=tiled))
    ours.append(tc.all_reduce(x, axes, implementation="shard_map"))
    ref.append(lax.psum(x, axes))
    return ours, ref

  return fn


def check_exact(mesh_name, axes, dtype):
  mesh = mesh_of(mesh_name)
  p = math.prod(mesh.shape[a] for a in axes)
  for tiled in (True, False):
    shape = (2 * p, 3, 2 * p) if tiled else (p, 3, 5)
    x = small_integers((mesh.size,) + shape, dtype, seed=p)
    ours, ref = per_device(_ops(axes, tiled), mesh, x)
    for o, r in zip(ours, ref):
      assert o.shape == r.shape and o.dtype == r.dtype
      np.testing.assert_array_equal(np.asarray(o, np.float64), np.asarray(r, np.float64))


@pytest.mark.parametrize("axes", ORDERS, ids="".join)
def test_every_axis_order_exact_int32(axes):
  check_exact("2x2x2", axes, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("axes", [("x", "y", "z"), ("z", "x", "y")], ids="".join)
def test_exact_floats(axes, dtype):
  check_exact("2x2x2", axes, dtype)


@pytest.mark.parametrize(
  "dtype,eps", [(jnp.float32, 2.0**-23), (jnp.bfloat16, 2.0**-8)], ids=["f32", "bf16"]
)
def test_random_floats_within_rounding_bound(dtype, eps):
  """|ours - exact| <= p * eps * sum_i |x_i|: at most p roundings of partial sums."""
  mesh, axes = mesh_of("2x2x2"), ("y", "z", "x")
  p = mesh.size
  x = np.random.default_rng(2).standard_normal((p, 2 * p, 17)).astype(np.float32)
  x = np.asarray(jnp.asarray(x, dtype), np.float64)
  fn = lambda v: (
    tc.all_reduce(v, axes, implementation="shard_map"),
    tc.reduce_scatter(v, axes, tiled=True, implementation="shard_map"),
    lax.axis_index(axes),
  )
  summed, scattered, index = per_device(fn, mesh, jnp.asarray(x, dtype))
  exact = x.sum(0)
  bound = p * eps * np.abs(x).sum(0)
  for d in range(p):
    assert np.all(np.abs(np.asarray(summed[d], np.float64) - exact) <= bound)
    rows = slice(int(index[d]) * 2, int(index[d]) * 2 + 2)
    assert np.all(np.abs(np.asarray(scattered[d], np.float64) - exact[rows]) <= bound[rows])


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_reduce"])
def test_gradients_match_lax(op):
  mesh, axes = mesh_of("2x2x2"), ("z", "y", "x")
  p = mesh.size
  x = jnp.asarray(small_integers((p, 2 * p, 3), np.float32, seed=3))
  w = jnp.asarray(small_integers((p, p * 2 * p, 3), np.float32, seed=4))
  ours_op = {
    "reduce_scatter": lambda v: tc.reduce_scatter(v, axes, tiled=True, implementation="shard_map"),
    "all_gather": lambda v: tc.all_gather(v, axes, tiled=True, implementation="shard_map"),
    "all_reduce": lambda v: tc.all_reduce(v, axes, implementation="shard_map"),
  }[op]
  lax_op = {
    "reduce_scatter": lambda v: lax.psum_scatter(v, axes, tiled=True),
    "all_gather": lambda v: lax.all_gather(v, axes, tiled=True),
    "all_reduce": lambda v: lax.psum(v, axes),
  }[op]

  def loss(x, fn):
    body = lambda v, u: jnp.sum(fn(v) * u[: fn(v).shape[0]])
    return jnp.sum(per_device(body, mesh, x, w))

  g_ours = jax.jit(jax.grad(lambda v: loss(v, ours_op)))(x)
  g_lax = jax.jit(jax.grad(lambda v: loss(v, lax_op)))(x)
  np.testing.assert_array_equal(np.asarray(g_ours), np.asarray(g_lax))


def test_gradient_summation_over_three_axes():
  mesh, axes = mesh_of("2x2x2"), ("x", "y", "z")
  tree = {"a": small_integers((8, 5, 3), np.float32, 1), "b": small_integers((8, 7), np.float32, 2)}
  ours, ref = per_device(
    lambda t: (
      tc.all_reduce_gradients(t, axes, mean=False, implementation="shard_map"),
      jax.tree.map(lambda v: lax.psum(v, axes), t),
    ),
    mesh,
    tree,
  )
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


@pytest.mark.parametrize("tile", [(2, 2, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 2), (2, 1, 1)])
def test_group_sums_over_3d_tiles(tile):
  """The batch-norm statistics sum: each replica gets the sum over its aligned tile."""
  mesh, axes = mesh_of("2x2x2"), ("x", "y", "z")
  x = small_integers((8, 4), np.float32, seed=5)
  got = per_device(lambda v: tc.group_sum(v, axes, tile), mesh, x)
  grid = x.reshape(2, 2, 2, 4)
  for c in np.ndindex(2, 2, 2):
    box = tuple(slice(i // t * t, i // t * t + t) for i, t in zip(c, tile))
    want = grid[box].reshape(-1, 4).sum(0)
    np.testing.assert_array_equal(np.asarray(got).reshape(2, 2, 2, 4)[c], want)


@pytest.mark.parametrize(
  "group_size,tile", [(4, (1, 2, 2)), ((2, 1, 2), (2, 1, 2)), (8, (2, 2, 2))]
)
def test_batch_norm_over_3d_tiles(group_size, tile):
  """Group statistics over a 3-D tile equal those of the tile's gathered batch."""
  mesh, axes = mesh_of("2x2x2"), ("x", "y", "z")
  x = np.random.default_rng(6).standard_normal((8, 3, 2, 4)).astype(np.float32)
  ones, zeros = jnp.ones(4), jnp.zeros(4)
  y, mean = per_device(
    lambda v: tc.batch_norm(
      v, ones, zeros, axis_name=axes, group_size=group_size, implementation="xla"
    )[:2],
    mesh,
    x,
  )
  grid = x.reshape(2, 2, 2, 6, 4).astype(np.float64)
  for c in np.ndindex(2, 2, 2):
    box = tuple(slice(i // t * t, i // t * t + t) for i, t in zip(c, tile))
    rows = grid[box].reshape(-1, 4)
    want = (grid[c] - rows.mean(0)) / np.sqrt(rows.var(0) + 1e-5)
    d = np.ravel_multi_index(c, (2, 2, 2))
    np.testing.assert_allclose(np.asarray(mean[d]), rows.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y[d]).reshape(6, 4), want, rtol=1e-5, atol=1e-5)


def tile_groups(sizes, tile):
  """The replica groups of the aligned ``tile`` boxes of a mesh of ``sizes``: linear device
  indices (row-major over the axes), each group listed row-major within its box."""
  grid = np.arange(math.prod(sizes)).reshape(sizes)
  corners = itertools.product(*(range(0, n, t) for n, t in zip(sizes, tile)))
  return [
    grid[tuple(slice(c, c + t) for c, t in zip(corner, tile))].reshape(-1).tolist()
    for corner in corners
  ]


def check_tile_groups(mesh_name, axes, tile, dtype=jnp.float32):
  """psum, pmean, psum_scatter (tiled and not) and all_gather over the replica groups of
  ``tile`` equal lax's exactly on small integers (lax takes groups only without check_vma)."""
  mesh = mesh_of(mesh_name)
  groups = tile_groups(tuple(mesh.shape[a] for a in axes), tile)
  g = math.prod(tile)
  kw = dict(axis_index_groups=groups)

  names = ("psum", "pmean", "psum_scatter", "all_gather")
  ours = types.SimpleNamespace(
    **{n: functools.partial(getattr(tc, n), implementation="shard_map") for n in names}
  )

  def fn(x, u):
    ops = lambda m: (
      m.psum(x, axes, **kw),
      m.pmean(x, axes, **kw),
      m.psum_scatter(x, axes, tiled=True, **kw),
      m.psum_scatter(u, axes, scatter_dimension=1, **kw),
      m.all_gather(x, axes, axis=1, **kw),
      m.all_gather(x, axes, tiled=True, **kw),
    )
    return ops(ours), ops(lax)

  x = small_integers((mesh.size, 2 * g, 3), dtype, seed=g)
  u = small_integers((mesh.size, 3, g), dtype, seed=g + 1)
  ours, ref = per_device(fn, mesh, x, u, check_vma=False)
  for o, r in zip(ours, ref):
    assert o.shape == r.shape and o.dtype == r.dtype
    np.testing.assert_array_equal(np.asarray(o, np.float64), np.asarray(r, np.float64))


def test_tile_groups_lists_aligned_boxes():
  assert tile_groups((2, 2, 4), (1, 1, 2))[:3] == [[0, 1], [2, 3], [4, 5]]
  assert tile_groups((2, 2, 4), (2, 1, 2))[0] == [0, 1, 8, 9]


def test_group_sizes_name_3d_tiles_filled_along_the_last_axis():
  tiles = [tc.resolve_tile(g, (2, 2, 4)) for g in (2, 4, 8, 16)]
  assert tiles == [(1, 1, 2), (1, 1, 4), (1, 2, 4), (2, 2, 4)]


@pytest.mark.slow
def test_2x2x4_in_a_subprocess():
  run_as_script(__file__, 16, MARKER)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  for axes, dtype in [
    (("x", "y", "z"), jnp.float32),
    (("z", "y", "x"), jnp.int32),
    (("y", "x", "z"), jnp.bfloat16),
  ]:
    check_exact("2x2x4", axes, dtype)
  # Replica groups over part of an axis: each ring spans 2 of the 4 devices along z.
  for axes, tile in [
    (("x", "y", "z"), (1, 1, 2)),
    (("x", "y", "z"), (2, 1, 2)),
    (("x", "y", "z"), (1, 2, 2)),
    (("x", "y", "z"), (2, 2, 2)),
    (("z", "x"), (2, 1)),
    (("y", "z"), (2, 2)),
  ]:
    check_tile_groups("2x2x4", axes, tile)
  check_tile_groups("2x2x4", ("x", "y", "z"), (2, 2, 2), jnp.int32)
  print(MARKER)
