"""tc.psum / pmean / psum_scatter / all_gather against jax.lax, for every implementation.

One shared, parametrized base: each behaviour runs the same program twice, once through
``tc`` with the implementation under test and once through ``lax``, and demands identical
results (bitwise: the inputs are small integers, exact in every dtype and summation
order) or, where a torus implementation does not run a request, the clear error it
documents. The ground mirrors jax's own tests of these collectives (shard_map_test.py,
pmap_test.py): pytrees, Python scalars, every dtype, ``axis_index_groups``, ``to=``, vmap
and pmap axes, forward and reverse mode to second order, ``scan``, unreduced inputs, one to
three axis names, and the exception types.

"auto" and "xla" must equal lax everywhere; "shard_map" must equal lax or raise the
documented error; "pallas" (TPU interpret mode, seconds per kernel) runs a spread.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_cases import small_integers
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import torus_collectives as tc

LAX_LIKE = ["auto", "xla"]
TORUS = ["shard_map"]
IMPLS = LAX_LIKE + TORUS
PALLAS = pytest.param("pallas", marks=pytest.mark.interpret)
WITH_PALLAS = IMPLS + [PALLAS]


def _mesh(shape, names=("x", "y")):
  devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def _ops(impl):
  """The four ops with ``implementation=impl``, or lax's own for impl None."""
  if impl is None:
    return lax
  return type(
    "Ops",
    (),
    {
      name: staticmethod(functools.partial(getattr(tc, name), implementation=impl))
      for name in ("psum", "pmean", "psum_scatter", "all_gather")
    },
  )


def _run(impl, build):
  """``build(ops)`` (a callable) run with tc's ops for ``impl`` ("pallas" in TPU interpret
  mode)."""
  fn = build(_ops(impl))
  if impl != "pallas":
    return jax.block_until_ready(fn())
  params = pltpu.InterpretParams(detect_races=True)
  try:
    with pltpu.force_tpu_interpret_mode(params):
      return jax.block_until_ready(fn())
  except Exception:
    pltpu.reset_tpu_interpret_mode_state()
    raise


def _assert_same(ours, ref):
  assert jax.tree.structure(ours) == jax.tree.structure(ref)
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    o, r = np.asarray(o), np.asarray(r)
    assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
    np.testing.assert_array_equal(o, r)


def check(impl, build, *, torus_error=None):
  """``build(ops)`` with tc for ``impl`` equals it with lax, or, on a torus implementation
  given ``torus_error=(type, match)``, raises that error."""
  if torus_error is not None and impl not in LAX_LIKE:
    with pytest.raises(torus_error[0], match=torus_error[1]):
      _run(impl, build)
    return
  _assert_same(_run(impl, build), _run(None, build))


def _shard_map(fn, mesh, x, *, check_vma=True, out_specs=None):
  spec = P(tuple(mesh.axis_names))
  return jax.jit(
    jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=spec,
      out_specs=spec if out_specs is None else out_specs,
      check_vma=check_vma,
    )
  )(x)


def _local(fn):
  """``fn`` applied to the device-local row; outputs get a leading axis of one."""
  return lambda v: jax.tree.map(lambda o: jnp.asarray(o)[None], fn(v[0]))


MESH = (2, 4)
XY = ("x", "y")


def _data(shape=(8, 8, 3), dtype=np.float32, seed=0):
  return jnp.asarray(small_integers(shape, dtype, seed))


# Pytrees, scalars and dtypes.


@pytest.mark.parametrize("impl", WITH_PALLAS)
def test_pytree_all_ops(impl):
  """One collective per dtype bucket; "pallas" (seconds per kernel) runs two of the ops."""
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    def body(v):
      tree = {"a": v, "b": (v.astype(jnp.int32), v[:2, :1])}
      if impl == "pallas":
        return ops.psum(tree, XY), ops.all_gather(tree["b"][1], XY, axis=1, tiled=True)
      return (
        ops.psum(tree, XY),
        ops.pmean(tree, "y"),
        ops.psum_scatter(tree["a"], XY, tiled=True),
        ops.all_gather(tree, XY, axis=1, tiled=True),
      )

    return lambda: _shard_map(_local(body), mesh, x)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_python_scalars(impl):
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    return lambda: _shard_map(
      lambda v: (ops.psum(1, XY), ops.psum(2.0, "x"), ops.pmean(3, "y")),
      mesh,
      x,
      out_specs=P(),
    )

  check(impl, build)


DTYPES = [
  np.float32,
  jnp.bfloat16,
  np.float16,
  np.int32,
  np.int8,
  np.uint32,
  np.complex64,
  np.bool_,
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype(impl, dtype):
  mesh = _mesh(MESH)
  x = _data((8, 8, 2), np.int8).astype(dtype)
  summable = np.dtype(dtype) != np.bool_

  def build(ops):
    def body(v):
      outs = [ops.psum(v, XY), ops.all_gather(v, XY)]
      if summable:
        outs.append(ops.psum_scatter(v, XY, tiled=True))
      return outs

    return lambda: _shard_map(_local(body), mesh, x)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_64_bit_dtypes(impl):
  with jax.enable_x64(True):
    mesh = _mesh(MESH)
    for dtype in (np.float64, np.int64, np.complex128):

      def build(ops, dtype=dtype):
        def body(v):
          return ops.psum(v, XY), ops.psum_scatter(v, "y", tiled=True), ops.all_gather(v, "x")

        x = _data((8, 8, 2), np.int8).astype(dtype)
        return lambda: _shard_map(_local(body), mesh, x)

      check(impl, build)


# Groups and to=.

TILE_GROUPS = [[0, 1], [2, 3], [4, 5], [6, 7]]  # (1, 2) tiles of the 2x4 torus
COLUMN_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]  # (2, 1) tiles
STRIDED_GROUPS = [[0, 2], [1, 3], [4, 6], [5, 7]]  # not tiles


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [TILE_GROUPS, COLUMN_GROUPS], ids=["rows", "columns"])
def test_tile_groups(impl, groups):
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    def body(v):
      return (
        ops.psum(v, XY, axis_index_groups=groups),
        ops.pmean(v, XY, axis_index_groups=groups),
        ops.psum_scatter(v, XY, axis_index_groups=groups, tiled=True),
        ops.all_gather(v, XY, axis_index_groups=groups),
      )

    return lambda: _shard_map(_local(body), mesh, x, check_vma=False)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_groups_that_are_not_tiles(impl):
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    return lambda: _shard_map(
      _local(lambda v: ops.psum(v, XY, axis_index_groups=STRIDED_GROUPS)),
      mesh,
      x,
      check_vma=False,
    )

  check(impl, build, torus_error=(ValueError, 'aligned tiles.*implementation="auto"'))


@pytest.mark.parametrize("impl", IMPLS)
def test_tile_groups_under_check_vma(impl):
  """lax refuses groups under check_vma=True; the torus runs them (and agrees with lax
  without the check)."""
  mesh, x = _mesh(MESH), _data()
  body = lambda ops: _local(lambda v: ops.psum(v, XY, axis_index_groups=TILE_GROUPS))
  if impl in LAX_LIKE:
    with pytest.raises(NotImplementedError):
      _shard_map(body(_ops(impl)), mesh, x)
    return
  ours = _shard_map(body(_ops(impl)), mesh, x)
  _assert_same(ours, _shard_map(body(lax), mesh, x, check_vma=False))


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_to_invarying(impl):
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    return lambda: _shard_map(
      lambda v: ops.all_gather(v[0], XY, to="invarying"), mesh, x, out_specs=P()
    )

  check(impl, build)


@pytest.mark.parametrize("impl", WITH_PALLAS)
@pytest.mark.parametrize("axes", [XY, ("y", "x")], ids=["xy", "yx"])
def test_grad_of_gather_to_invarying(impl, axes):
  """The transpose of an invariant gather is this device's own chunk of the cotangent: with a
  different weight on every chunk, the gradient on each device names its position in the
  row-major order over ``axes`` (a transpose that walks the axes in the other order hands
  device (i, j) the weight of another device)."""
  mesh, x = _mesh(MESH), _data((8, 3), seed=5)
  weights = jnp.asarray(small_integers((8, 3), np.float32, seed=6)) + 10 * jnp.arange(8.0)[:, None]

  def build(ops):
    def body(v):
      loss = lambda u: jnp.sum(weights * ops.all_gather(u, axes, to="invarying"))
      return jax.grad(loss)(v[0])[None]

    return lambda: _shard_map(body, mesh, x)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_to_reduced(impl):
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    def body(v):
      return lax.pcast(ops.all_gather(v, XY, to="reduced"), XY, to="varying")

    return lambda: _shard_map(_local(body), mesh, x)

  check(impl, build, torus_error=(ValueError, "to='reduced'.*auto"))


# Axes bound by vmap and pmap; one to three axis names.


@pytest.mark.parametrize("impl", WITH_PALLAS)
def test_vmap_axis_inside_shard_map(impl):
  """Without check_vma: lax refuses to mix a vmap axis with varying mesh axes under it."""
  mesh, x = _mesh(MESH), _data((8, 4, 8, 3))

  def build(ops):
    def body(v):  # v: (4, 8, 3) per device, vmapped over its first axis as "i"
      def per_row(r):
        outs = (
          ops.psum(r, ("i", "y")),
          ops.psum(r, ("x", "i", "y")),
          ops.psum_scatter(r, "i", tiled=True),
          ops.all_gather(r, "i"),
        )
        return outs if impl == "pallas" else outs + (ops.psum(r, "y"),)

      return jax.vmap(per_row, axis_name="i")(v)

    return lambda: _shard_map(_local(body), mesh, x, check_vma=False)

  check(impl, build)


@pytest.mark.parametrize("impl", TORUS)
def test_vmap_and_mesh_axes_in_one_gather_or_scatter(impl):
  """lax.all_gather / psum_scatter refuse a tuple mixing vmap and mesh axes; the torus
  ops run it, and agree with lax composed axis by axis (chunks row-major over the tuple)."""
  mesh, x = _mesh(MESH), _data((8, 4, 8, 3))

  def per_row(ops):
    def f(r):
      if ops is not lax:
        return ops.all_gather(r, ("i", "x")), ops.psum_scatter(r, ("x", "i"), tiled=True)
      gathered = lax.all_gather(lax.all_gather(r, "i"), "x", axis=1).reshape((8,) + r.shape)
      total = lax.psum(lax.psum(r, "i"), "x")
      own = lax.axis_index("x") * 4 + lax.axis_index("i")
      return gathered, lax.dynamic_slice_in_dim(total, own, 1)

    return f

  run = lambda ops: _shard_map(
    _local(jax.vmap(per_row(ops), axis_name="i")), mesh, x, check_vma=False
  )
  _assert_same(run(_ops(impl)), run(lax))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_alone_and_unbatched_inputs(impl):
  x = _data((4, 4, 3))

  def build(ops):
    def per_row(r, c):
      return (
        ops.psum(r, "i"),
        ops.psum(c, "i"),
        ops.psum_scatter(c, "i"),
        ops.all_gather(r, "i", axis=1, tiled=True),
      )

    return lambda: jax.jit(jax.vmap(per_row, in_axes=(0, None), axis_name="i"))(x, x[0])

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_pmap_axes(impl):
  x = _data((4, 2, 4, 3))

  def build(ops):
    def body(v):
      inner = jax.vmap(
        lambda r: (ops.psum(r, ("i", "j")), ops.all_gather(r, "i"), ops.pmean(r, "j")),
        axis_name="j",
      )
      return inner(v), ops.psum_scatter(v, "i", scatter_dimension=1, tiled=True)

    return lambda: jax.pmap(body, axis_name="i", devices=jax.devices()[:4])(x)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_three_mesh_axes(impl):
  mesh, x = _mesh((2, 2, 2), ("a", "b", "c")), _data()

  def build(ops):
    return lambda: _shard_map(
      _local(lambda v: (ops.psum(v, ("a", "b", "c")), ops.all_gather(v, ("c", "a", "b")))),
      mesh,
      x,
    )

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_four_mesh_axes(impl):
  mesh, x = _mesh((2, 2, 2, 1), ("a", "b", "c", "d")), _data()

  def build(ops):
    return lambda: _shard_map(_local(lambda v: ops.psum(v, ("a", "b", "c", "d"))), mesh, x)

  check(impl, build, torus_error=(NotImplementedError, "at most 3 mesh axes.*auto"))


@pytest.mark.parametrize("impl", IMPLS)
def test_list_of_axis_names(impl):
  """lax.psum takes a list of names (lax.all_gather does not; the torus ops do)."""
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    return lambda: _shard_map(
      _local(lambda v: (ops.psum(v, ["y", "x"]), ops.pmean(v, ["x"]))), mesh, x
    )

  check(impl, build)


# Autodiff and control flow.


def _sum_of_ops(ops, axes=XY):
  """A polynomial of the collectives: on small integers every derivative is exact."""

  def f(v):
    s = ops.psum(v * v, axes)
    g = ops.all_gather(2 * v, axes, tiled=True)
    r = ops.psum_scatter(g * g, axes, tiled=True)
    return jnp.sum(s * s) + jnp.sum(r * v)

  return f


@pytest.mark.parametrize("impl", WITH_PALLAS)
def test_jvp_and_linearize(impl):
  """ "pallas" (seconds per kernel) differentiates one all-reduce forward."""
  mesh = _mesh(MESH)
  x, t = _data((8, 8), seed=1), _data((8, 8), seed=2)

  def build(ops):
    if impl == "pallas":
      f = lambda v: jnp.sum(ops.psum(v * v, XY) * v)
    else:
      f = _sum_of_ops(ops)

    def body(v, dv):
      y, dy = jax.jvp(f, (v[0],), (dv[0],))
      if impl == "pallas":
        return y[None], dy[None]
      _, lin = jax.linearize(f, v[0])
      return y[None], dy[None], lin(dv[0])[None]

    spec = P(XY)
    return lambda: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x, t)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("check_vma", [True, False])
def test_jacfwd_and_second_order_grad(impl, check_vma):
  mesh, x = _mesh(MESH), _data((8, 8), seed=3)

  def build(ops):
    f = _sum_of_ops(ops)

    def body(v):
      v = v[0]
      hvp = jax.grad(lambda u: jnp.sum(jax.grad(f)(u) * u))(v)
      return jax.jacfwd(lambda u: ops.psum(u, XY))(v)[None], hvp[None]

    return lambda: _shard_map(body, mesh, x, check_vma=check_vma)

  check(impl, build)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_of_grad_and_scan(impl):
  mesh, x = _mesh(MESH), _data((8, 3, 8), seed=4)

  def build(ops):
    f = _sum_of_ops(ops)

    def body(v):
      grads = jax.vmap(jax.grad(f))(v[0])

      def step(carry, row):
        return carry + ops.psum(row, "y"), ops.all_gather(row, "x", tiled=True)

      total, gathered = lax.scan(step, jnp.zeros_like(v[0, 0]), v[0])
      return grads[None], total[None], gathered[None]

    return lambda: _shard_map(body, mesh, x)

  check(impl, build)


# Unreduced inputs, vma rules and exception types.


@pytest.mark.parametrize("impl", IMPLS)
def test_unreduced_input(impl):
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    def body(v):
      return ops.psum(lax.pcast(v, XY, to="unreduced"), XY)

    return lambda: _shard_map(body, mesh, x, out_specs=P())

  check(impl, build, torus_error=(ValueError, "unreduced or reduced inputs.*auto"))


@pytest.mark.parametrize("impl", IMPLS)
def test_replicated_input_is_summed_as_lax_does(impl):
  """With jax_auto_pcast (the default) lax sums an input invariant over the axes."""
  mesh, x = _mesh(MESH), _data()

  def build(ops):
    return lambda: _shard_map(
      lambda v: ops.psum(jnp.ones(3), XY), mesh, x, out_specs=P(), check_vma=True
    )

  check(impl, build)


@pytest.mark.parametrize("impl", WITH_PALLAS)
@pytest.mark.parametrize("check_vma", [True, False])
def test_unbound_axis_name(impl, check_vma):
  """ "auto"/"xla" raise what lax raises (NameError, or lax.psum's AssertionError under
  check_vma=True); the torus implementations raise NameError."""
  mesh, x = _mesh(MESH), _data()
  for op in ("psum", "psum_scatter", "all_gather"):
    build = lambda ops, op=op: (
      lambda: _shard_map(_local(lambda v: getattr(ops, op)(v, "z")), mesh, x, check_vma=check_vma)
    )
    with pytest.raises(Exception) as lax_error:
      _run(None, build)
    expected = lax_error.type if impl in LAX_LIKE else NameError
    with pytest.raises(expected):
      _run(impl, build)
    with pytest.raises(NameError, match="unbound axis name: x"):
      getattr(tc, op)(jnp.ones(8), "x", implementation=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_pmap_without_axis_name_keeps_the_user_name(impl):
  with pytest.raises(NameError, match="unbound axis name: i"):
    jax.pmap(lambda v: tc.psum(v, "i", implementation=impl), devices=jax.devices()[:2])(
      jnp.ones((2, 3))
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_scatter_dimension_is_a_type_error(impl):
  mesh, x = _mesh(MESH), _data()
  with pytest.raises(TypeError):
    _shard_map(
      _local(lambda v: tc.psum_scatter(v, "y", scatter_dimension=1.0, implementation=impl)),
      mesh,
      x,
    )


@pytest.mark.parametrize("impl", ["shard_map", PALLAS])
def test_zero_size_and_partial_manual(impl):
  """Empty buffers skip the device work; "pallas" inside a partly manual shard_map is a
  clear error, where "shard_map" runs."""
  mesh = _mesh(MESH)

  def build(ops):
    return lambda: _shard_map(_local(lambda v: ops.psum(v[:0], XY)), mesh, _data())

  check(impl, build)
  x = _data((8, 8, 3))
  partial = lambda ops: (
    lambda: jax.jit(
      jax.shard_map(
        lambda v: ops.psum(v, "y"), mesh=mesh, in_specs=P("y"), out_specs=P(), axis_names={"y"}
      )
    )(x)
  )
  if impl == "pallas":
    with pytest.raises(ValueError, match="every mesh axis manual"):
      _run(impl, partial)
  else:
    check(impl, partial)
