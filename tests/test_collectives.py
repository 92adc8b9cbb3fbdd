"""Conformance of tc.reduce_scatter / all_gather / all_reduce with jax.lax.

Every case runs our op and the lax op in the same shard_map on the same per-device data,
on simulated CPU meshes. Small-integer inputs make every summation order exact, so those
cases demand bitwise equality; random floats are checked against a float64 reference with
a bound on the rounding error.
"""

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import per_device, small_integers
from jax import lax

import torus_collectives as tc
from torus_collectives import registry
from torus_collectives.axes import names as axis_names

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32]
AXES = {"xy": ("x", "y"), "yx": ("y", "x"), "x": "x", "y": "y"}


def _size(mesh, axis_name):
  names = axis_names(axis_name)
  return math.prod(mesh.shape[a] for a in names)


def _all_ops(axis_name, tiled, impl, dims):
  """Our ops and lax's on one local array of shape (a, b, c), for the given dimensions."""

  def fn(x):
    ours, ref = [], []
    for dim in dims["scatter"] if tiled else (0,):
      ours.append(
        tc.reduce_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled, implementation=impl)
      )
      ref.append(lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled))
    for axis in dims["gather"]:
      ours.append(tc.all_gather(x, axis_name, axis=axis, tiled=tiled, implementation=impl))
      ref.append(lax.all_gather(x, axis_name, axis=axis, tiled=tiled))
    ours.append(tc.all_reduce(x, axis_name, implementation=impl))
    ref.append(lax.psum(x, axis_name))
    return ours, ref

  return fn


# Every dimension, negative ones included, on the main mesh; two elsewhere.
ALL_DIMS = {"scatter": (0, 1, -1), "gather": (0, 1, 2, -1, -3)}
SOME_DIMS = {"scatter": (0, -1), "gather": (0, -1)}


def _local_shape(n, tiled):
  # Untiled reduce-scatter needs the leading dimension to equal the axis size n.
  return (2 * n, n, 2 * n) if tiled else (n, 3, 5)


# Every mesh with the torus tuple in its natural order; both orders and the single axes
# where the two axes differ in size; "auto" (lax on CPU) once.
CASES = [("2x4", a, "shard_map") for a in AXES] + [
  ("4x2", "xy", "shard_map"),
  ("4x2", "yx", "shard_map"),
  ("1x8", "xy", "shard_map"),
  ("8x1", "yx", "shard_map"),
  ("2x2", "xy", "shard_map"),
  ("2x4", "xy", "auto"),
  # The schedule's phases on lax's per-axis collectives: both orders, a long axis, one axis.
  ("2x4", "xy", "lax_torus"),
  ("4x2", "yx", "lax_torus"),
  ("1x8", "xy", "lax_torus"),
  ("2x4", "y", "lax_torus"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("mesh_name,axes,impl", CASES)
def test_exact_against_lax(mesh_name, axes, dtype, impl):
  mesh = harness.mesh(tuple(int(n) for n in mesh_name.split("x")))
  axis_name = AXES[axes]
  n = _size(mesh, axis_name)
  for tiled in (True, False):
    x = small_integers((mesh.size,) + _local_shape(n, tiled), dtype, seed=n)
    dims = ALL_DIMS if (mesh_name, axes) == ("2x4", "xy") else SOME_DIMS
    ours, ref = per_device(_all_ops(axis_name, tiled, impl, dims), mesh, x)
    for o, r in zip(ours, ref):
      assert o.shape == r.shape and o.dtype == r.dtype
      np.testing.assert_array_equal(np.asarray(o, np.float64), np.asarray(r, np.float64))


@pytest.mark.parametrize("impl", ["shard_map", "lax_torus"])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
  "dtype,eps", [(jnp.float32, 2.0**-23), (jnp.bfloat16, 2.0**-8)], ids=["f32", "bf16"]
)
def test_random_floats_within_rounding_bound(dtype, eps, check_vma, impl):
  """|ours - exact| <= p * eps * sum_i |x_i|: at most p roundings of partial sums."""
  mesh = harness.mesh((2, 4))
  p = mesh.size
  x = np.random.default_rng(1).standard_normal((p, 4 * p, 33)).astype(np.float32)
  x = np.asarray(jnp.asarray(x, dtype), np.float64)  # exact values of the inputs
  fn = lambda v: (
    tc.all_reduce(v, ("x", "y"), implementation=impl),
    tc.reduce_scatter(v, ("x", "y"), tiled=True, implementation=impl),
  )
  summed, scattered = per_device(fn, mesh, jnp.asarray(x, dtype), check_vma=check_vma)
  exact = x.sum(0)
  bound = p * eps * np.abs(x).sum(0)
  for d in range(p):
    assert np.all(np.abs(np.asarray(summed[d], np.float64) - exact) <= bound)
    rows = slice(d * 4, (d + 1) * 4)
    assert np.all(np.abs(np.asarray(scattered[d], np.float64) - exact[rows]) <= bound[rows])


@pytest.mark.parametrize("impl", ["shard_map", "lax_torus"])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_reduce"])
def test_gradients_match_lax(op, check_vma, impl):
  mesh = harness.mesh((2, 4))
  p, axis_name = mesh.size, ("x", "y")
  x = jnp.asarray(small_integers((p, 2 * p, 3), np.float32, seed=3))
  weights = jnp.asarray(small_integers((p, 2 * p, 3), np.float32, seed=4))

  def loss(x, ours):
    def body(x, w):
      if op == "reduce_scatter":
        out = (
          tc.reduce_scatter(x, axis_name, tiled=True, implementation=impl)
          if ours
          else lax.psum_scatter(x, axis_name, tiled=True)
        )
        return jnp.sum(out * w[: out.shape[0]])
      if op == "all_gather":
        out = (
          tc.all_gather(x, axis_name, tiled=True, implementation=impl)
          if ours
          else lax.all_gather(x, axis_name, tiled=True)
        )
        return jnp.sum(out * jnp.tile(w, (p, 1)))
      out = tc.all_reduce(x, axis_name, implementation=impl) if ours else lax.psum(x, axis_name)
      return jnp.sum(out * w)

    losses = per_device(lambda a, b: body(a, b), mesh, x, weights, check_vma=check_vma)
    return jnp.sum(losses)

  g_ours = jax.jit(jax.grad(lambda v: loss(v, True)))(x)
  g_lax = jax.jit(jax.grad(lambda v: loss(v, False)))(x)
  np.testing.assert_array_equal(np.asarray(g_ours), np.asarray(g_lax))


def test_all_reduce_result_is_invariant_under_check_vma():
  """Like lax.psum, the result can be returned as replicated (out_specs=P())."""
  mesh = harness.mesh((2, 4))
  x = jnp.asarray(small_integers((8, 6), np.float32))
  spec = jax.P(("x", "y"))
  f = jax.shard_map(
    lambda v: tc.all_reduce(v, ("x", "y"), implementation="shard_map"),
    mesh=mesh,
    in_specs=spec,
    out_specs=jax.P(),
  )
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(x).sum(0, keepdims=True))


def test_auto_is_xla_on_cpu():
  assert registry.auto_implementation() == "xla"


def test_lax_torus_runs_the_split_schedule_as_two_per_axis_chains():
  """x-then-y and y-then-x, each a reduce-scatter and an all-gather per axis, from
  schedule.py; directions are lax's business, so the four streams make two chains."""
  from torus_collectives.backends import lax_torus

  rs, ag = "reduce_scatter", "all_gather"
  assert lax_torus.chains("all_reduce", (2, 4)) == (
    ((rs, 0), (rs, 1), (ag, 1), (ag, 0)),
    ((rs, 1), (rs, 0), (ag, 0), (ag, 1)),
  )
  assert lax_torus.chains("all_reduce", (8,)) == (((rs, 0), (ag, 0)),)
  mesh = harness.mesh((2, 4))
  f = jax.shard_map(
    lambda v: tc.all_reduce(v, ("x", "y"), implementation="lax_torus"),
    mesh=mesh,
    in_specs=jax.P(("x", "y")),
    out_specs=jax.P(("x", "y")),
  )
  program = jax.jit(f).lower(jnp.zeros(8 * 64)).as_text()
  assert program.count("stablehlo.reduce_scatter") == 4
  assert program.count("stablehlo.all_gather") == 4
  assert "stablehlo.all_reduce" not in program and "collective_permute" not in program
