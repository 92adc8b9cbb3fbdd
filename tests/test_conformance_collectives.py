"""The conformance base of the collective family: tc.psum / pmean / psum_scatter /
all_gather against jax.lax, for every registered implementation.

One base, parametrized at collection time over ``registry.BACKENDS`` plus "auto" (so a
backend registered before collection, such as the stand-ins of
``test_conformance_registry.py``, is run by its record alone) × torus rank (a ring (8,), a
2-D torus (2, 4), a 3-D torus (2, 2, 2)) × dtype × op. Each behaviour runs the same program
through ``tc`` with the implementation under test and through ``lax``, and demands
bitwise-equal results: the inputs are small integers (``harness.small_integers``), exact in
every dtype and every summation order. Where an implementation's record says it does not
run a request (its dtypes, ``replica_groups``, ``max_torus_axes``, ``gather_to``,
``unreduced_inputs``, ``partial_manual``), the expected clear error is derived from those
fields here (``refusal``), not asked of ``registry.unsupported``; records with
``lax_reference``, and "auto", must equal lax everywhere (where lax refuses, they raise what
lax raises). The ground mirrors jax's own tests of these collectives (shard_map_test.py,
pmap_test.py): pytrees, Python scalars, every dtype (the 64-bit ones too), replica groups
that are tiles and ones that are not, ``to=``, vmap and pmap axes, forward and reverse mode
to second order, ``scan``, unreduced inputs, unbound axes, zero-size buffers, partially
manual meshes, every order of the axis names, and the exception types; random floats are
checked against a float64 sum within a rounding bound.

Depth, and how it was chosen. Compiling dominates: on 2 CPU cores a "shard_map" collective
(its ppermute schedule) compiles in about a second on the 2-D and 3-D tori, a "lax_torus"
one in a fifth of that, lax's in less, and a "pallas" kernel runs for seconds in TPU
interpret mode. So:

* The matrix, ``test_op_matches_lax``: 5 implementations × 3 ranks × 11 dtypes (8, and 3
  64-bit ones under ``jax_enable_x64``) × 4 ops = 660 combinations. "auto", "xla",
  "shard_map" and "lax_torus" run all 132 of theirs (528). "pallas" runs the 78 in which its
  record or lax refuses the request (int8, uint32, complex64, the 64-bit dtypes, boolean
  gathers and scatters: trace-time errors, no kernel) and launches kernels in the 4 of
  ``PALLAS_MATRIX``, which between them cover each rank, each of the four dtypes its
  kernels take, each op and both DMA execution modes; 610 cases in all.
* The behaviours run for every implementation without kernels, on every rank where the
  torus can change the outcome (replica groups, ``to=``, vmap axes mixed into mesh axes,
  gradients and gradient summation, rounding bounds, unreduced and unbound axes, errors,
  zero-size buffers; partially manual meshes on 2-D and 3-D), on the 2-D torus where it
  cannot (``TORUS_FREE``: pytree packing, jvp and second-order autodiff, scan, lists of
  axis names, replicated inputs), without a mesh where there is none (vmap alone, pmap),
  and on a 4-D mesh for ``max_torus_axes``. Axis orders and dimensions: int32 in all 6
  orders and float32 and bfloat16 in 2 on the 3-D torus, and the ring (the 2-D orders and
  dimensions, on five 2-D meshes, are test_collectives.py's); lax-like implementations run
  the natural order and the one rotated right (they hand the names to lax as given).
* An implementation with ``pallas_kernels`` runs every case in which no kernel is launched
  (refusals, constants, vmap-only axes, zero-size buffers, unbound axes) and, on the 2-D
  torus, the spread the previous 2-D base ran: pytrees, the invariant gather's gradient in
  both axis orders, vmap axes inside shard_map, jvp. The kernels themselves (every
  collective, mesh and DMA mode, ragged sizes, rounding bounds, 2-D and 3-D) are
  test_kernels_interpret.py's.
* The 2x2x4 torus (16 devices) runs in a subprocess (``test_2x2x4_in_a_subprocess``, slow)
  for the implementations with a schedule of their own ("shard_map", "lax_torus").

With the built-in registry that is 1005 cases: 217 each for "auto" and "xla", 222 each for
"shard_map" and "lax_torus", 125 for "pallas", and 2 checks of the base itself. The cases
of one test (the matrix: of one implementation, rank and dtype width) that share a mesh
compile as one program (``harness.group_result``), which cuts their compile time by more
than half; if that program fails, each case runs alone.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import types

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_count_subprocess import run_as_script
from harness import RANKS, small_integers
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import registry

# Read at collection time: "auto" and every registered backend.
IMPLEMENTATIONS = registry.implementations()
OPS = ("psum", "pmean", "psum_scatter", "all_gather")
FAMILY = {
  "psum": "all_reduce",
  "pmean": "all_reduce",
  "psum_scatter": "reduce_scatter",
  "all_gather": "all_gather",
}
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
WIDE_DTYPES = [np.float64, np.int64, np.complex128]  # traced and run with jax_enable_x64
ALL_DTYPES = DTYPES + WIDE_DTYPES
FAMILY_OPS = ("psum_scatter", "all_gather", "psum")  # one op of each family, in that order
MARKER = "2x2x4 matches lax"


def _name(dtype) -> str:
  return np.dtype(dtype).name


# ---------------------------------------------------------------------- the records


def record(impl: str) -> registry.Backend | None:
  """The record of a concrete implementation; None for "auto"."""
  return None if impl == "auto" else registry.BACKENDS[impl]


def lax_like(impl: str) -> bool:
  """Equals lax on every request: the lax reference itself, and "auto" (never stricter
  than lax; on CPU, with no tuning table, it is lax)."""
  return impl == "auto" or record(impl).lax_reference


kernels = harness.kernels
run = harness.run


def request_dtype(op: str, dtype) -> np.dtype:
  """The dtype the implementation is asked for: sums take booleans as int32, as lax does."""
  dtype = np.dtype(dtype)
  return np.dtype(np.int32) if op in ("psum", "pmean") and dtype == np.bool_ else dtype


def refusal(
  impl: str,
  op: str,
  *,
  dtypes=(np.float32,),
  mesh_axes: int = 1,
  groups: str | None = None,
  to: str = "varying",
  unreduced: bool = False,
  partial_manual: bool = False,
):
  """The (exception type, message pattern) ``impl``'s record documents for this request,
  or None where it runs it. ``groups`` is None, "tile" or "other"; ``mesh_axes`` how many
  named axes are mesh axes."""
  if lax_like(impl):
    return None
  backend = record(impl)
  family = FAMILY[op]
  name = f'implementation="{impl}"'
  for dtype in dtypes:
    dtype = request_dtype(op, dtype)
    if not backend.supports(family, dtype):
      return ValueError, f"dtype {dtype.name} is not supported by {family} {name}"
  if backend.max_torus_axes is not None and mesh_axes > backend.max_torus_axes:
    return NotImplementedError, f"at most {backend.max_torus_axes} mesh axes.*auto"
  if groups is not None and (found := groups_refusal(backend, groups)) is not None:
    return found
  if op == "all_gather" and backend.gather_to is not None and to not in backend.gather_to:
    return ValueError, f"to={to!r}.*auto"
  if unreduced and not backend.unreduced_inputs:
    return ValueError, "unreduced or reduced inputs.*auto"
  if partial_manual and not backend.partial_manual:
    return ValueError, "needs every mesh axis manual"
  return None


def groups_refusal(backend, groups: str):
  """The refusal ``backend``'s record documents for replica groups ("tile" or "other")."""
  if backend.replica_groups == "none":
    return ValueError, 'axis_index_groups not at all.*aligned tiles.*implementation="auto"'
  if backend.replica_groups == "tiles" and groups == "other":
    return ValueError, 'only when they are aligned tiles.*implementation="auto"'
  return None


def first_refusal(impl: str, requests):
  """The refusal of the first of ``requests`` (dicts of ``refusal``'s arguments, in program
  order) that ``impl`` refuses, or None."""
  for request in requests:
    found = refusal(impl, **request)
    if found is not None:
      return found
  return None


# ---------------------------------------------------------------------- parametrization

# Behaviours whose outcome does not depend on the torus (the public layer's packing of
# pytrees, the primitives' autodiff and batching rules, the parsing of axis names) run on
# the 2-D torus; the matrix and every behaviour that does depend on it run on every rank.
TORUS_FREE = {"2d": RANKS["2d"]}
cases = functools.partial(harness.implementation_cases, IMPLEMENTATIONS)


# ---------------------------------------------------------------------- running


def ops_for(impl: str | None):
  """The four ops with ``implementation=impl``, or lax's own for None."""
  if impl is None:
    return lax
  return types.SimpleNamespace(
    **{name: functools.partial(getattr(tc, name), implementation=impl) for name in OPS}
  )


def assert_same(ours, ref):
  assert jax.tree.structure(ours) == jax.tree.structure(ref)
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    o, r = np.asarray(o), np.asarray(r)
    assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
    np.testing.assert_array_equal(o, r)


def check(impl, build, *, expected=None, dma=None):
  """``build(ops)()`` with tc for ``impl`` equals it with lax, or raises ``expected``
  (an exception type and a message pattern)."""
  if expected is not None:
    with pytest.raises(expected[0], match=expected[1]):
      run(impl, build(ops_for(impl)), dma)
    return
  assert_same(run(impl, build(ops_for(impl)), dma), run(None, build(lax)))


def check_grouped(impl, group, case, builds, *, dma=None):
  """``check(impl, builds[case])``, with every case of ``builds`` ({case: build}), tc's and
  lax's, compiled as one program for the group (``harness.group_result``); an
  implementation with kernels runs its case alone."""
  if kernels(impl):
    check(impl, builds[case], dma=dma)
    return

  def run_all():
    fn = lambda: {c: (b(ops_for(impl))(), b(lax)()) for c, b in builds.items()}
    return jax.block_until_ready(jax.jit(fn)())

  run_one = lambda c: (run(impl, builds[c](ops_for(impl))), run(None, builds[c](lax)))
  assert_same(*harness.group_result((group, impl), case, run_all, run_one))


def shard_mapped(fn, mesh, *args, check_vma=True, out_specs=None, in_specs=None):
  spec = P(tuple(mesh.axis_names))
  return jax.jit(
    jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=spec if in_specs is None else in_specs,
      out_specs=spec if out_specs is None else out_specs,
      check_vma=check_vma,
    )
  )(*args)


def local(fn):
  """``fn`` applied to the device-local rows; outputs get a leading axis of one."""
  return lambda *v: jax.tree.map(lambda o: jnp.asarray(o)[None], fn(*(a[0] for a in v)))


def torus(rank: str):
  """(mesh, its axis names, device count) of a rank."""
  mesh = harness.mesh(RANKS[rank])
  return mesh, tuple(mesh.axis_names), mesh.size


def data(shape, dtype=np.float32, seed=0):
  return jnp.asarray(small_integers(shape, dtype, seed))


def rotated_right(axes):
  """The axis names with the last first: a second order (yx, zxy) for every rank."""
  return axes[-1:] + axes[:-1]


def rotated_left(axes):
  return axes[1:] + axes[:1]


# ---------------------------------------------------------------------- the matrix

# Where an implementation with Pallas kernels launches them in the matrix: (rank, dtype, op)
# -> DMA execution mode. Each rank, each dtype the kernels take, each op and both modes.
PALLAS_MATRIX = {
  ("1d", jnp.bfloat16, "psum"): "eager",
  ("2d", np.int32, "psum_scatter"): "on_wait",
  ("2d", np.float16, "all_gather"): "eager",
  ("3d", np.float32, "pmean"): "on_wait",
}


def _matrix_op(ops, op, v, axes):
  """What the matrix runs of ``op``: over every axis of the torus, tiled where it scatters."""
  if op == "psum_scatter":
    return ops.psum_scatter(v, axes, tiled=True)
  return getattr(ops, op)(v, axes)


def _lax_refuses(op, dtype) -> bool:
  """lax itself refuses the request (it scatters no booleans)."""
  return op == "psum_scatter" and np.dtype(dtype) == np.bool_


def _matrix_refusal(impl, rank, dtype, op):
  """The record's refusal, or where lax refuses, the record's dtype error or lax's type."""
  if _lax_refuses(op, dtype):
    return refusal(impl, op, dtypes=(dtype,)) or (TypeError, "does not accept dtype bool")
  return refusal(impl, op, dtypes=(dtype,), mesh_axes=len(RANKS[rank]))


def _wide(dtype) -> bool:
  return np.dtype(dtype) in tuple(map(np.dtype, WIDE_DTYPES))


def _matrix_input(rank, dtype):
  p = math.prod(RANKS[rank])
  return small_integers((p, 2 * p, 3), np.int8, seed=p).astype(dtype)


def _matrix_program(impl, rank, requests, dma=None):
  """tc's and lax's results of ``requests`` ((dtype, op) pairs), each on its dtype's input,
  in one program: {(dtype name, op): (ours, lax's)}."""
  mesh, axes, _ = torus(rank)
  dtypes = list(dict.fromkeys(d for d, _ in requests))
  with jax.enable_x64(any(map(_wide, dtypes))):
    inputs = [jnp.asarray(_matrix_input(rank, d)) for d in dtypes]

    def body(*vs):
      by_dtype = dict(zip(map(_name, dtypes), vs))
      return {
        f"{_name(d)}/{op}": (
          _matrix_op(ops_for(impl), op, by_dtype[_name(d)], axes),
          _matrix_op(lax, op, by_dtype[_name(d)], axes),
        )
        for d, op in requests
      }

    return run(impl, lambda: shard_mapped(local(body), mesh, *inputs), dma)


def _matrix_requests(impl, rank, wide):
  """Every (dtype, op) of a rank that runs (64-bit dtypes apart: they need x64)."""
  return [
    (d, op)
    for d in (WIDE_DTYPES if wide else DTYPES)
    for op in OPS
    if _matrix_refusal(impl, rank, d, op) is None
  ]


@cases("rank,dtype,op", RANKS, ALL_DTYPES, OPS, spread=PALLAS_MATRIX, refuses=_matrix_refusal)
def test_op_matches_lax(impl, dma, rank, dtype, op):
  """Every op on every dtype, over all the torus's axes, equals lax bitwise; where the
  record does not take the dtype, its dtype error; where lax refuses (no boolean
  psum_scatter), lax's error type (or the record's dtype error, raised first)."""
  mesh, axes, _ = torus(rank)
  expected = _matrix_refusal(impl, rank, dtype, op)
  if expected is not None:
    with jax.enable_x64(_wide(dtype)):
      x = jnp.asarray(_matrix_input(rank, dtype))
      if _lax_refuses(op, dtype):
        with pytest.raises(TypeError):  # lax's own refusal, whose type the others share
          shard_mapped(local(lambda v: _matrix_op(lax, op, v, axes)), mesh, x)
      ours = ops_for(impl)
      with pytest.raises(expected[0], match=expected[1]):
        run(impl, lambda: shard_mapped(local(lambda v: _matrix_op(ours, op, v, axes)), mesh, x))
    return
  key = f"{_name(dtype)}/{op}"
  run_one = lambda key: _matrix_program(impl, rank, [(dtype, op)], dma)[key]
  if kernels(impl):  # a spread of single cases: each launches its own kernels
    assert_same(*run_one(key))
    return
  wide = _wide(dtype)
  group = ("matrix", impl, rank, wide)
  run_all = lambda: _matrix_program(impl, rank, _matrix_requests(impl, rank, wide))
  assert_same(*harness.group_result(group, key, run_all, run_one))


# ---------------------------------------------------------------------- axis orders, dims

ORDERS = {
  rank: [tuple(o) for o in itertools.permutations(harness.AXIS_NAMES[: len(shape)])]
  for rank, shape in RANKS.items()
}
# On the 3-D torus: int32 in every order of the axis names, floats in the natural order
# and rotated right; on the ring, its one order (the 2-D orders and dimensions, on five
# 2-D meshes, are test_collectives.py's). Lax-like implementations hand the names to lax
# as given, so the order is no property of theirs: they run the natural order and the one
# rotated right.
ORDER_CASES = [("3d", order, np.int32) for order in ORDERS["3d"]] + [
  ("3d", order, dtype)
  for dtype in (np.float32, jnp.bfloat16)
  for order in (("x", "y", "z"), ("z", "x", "y"))
]
ORDER_CASES += [("1d", ("x",), np.int32)]


def _orders_and_dims(ops, axes):
  """On a tiled input (2p, 3, 2p) and an untiled one (p, 3, 5): reduce-scatter (dims 0, -1;
  untiled 0), all-gather (dims 0, -1) and all-reduce."""

  def fn(tiled_x, untiled_x):
    out = []
    for x, tiled in ((tiled_x, True), (untiled_x, False)):
      for dim in (0, -1) if tiled else (0,):
        out.append(ops.psum_scatter(x, axes, scatter_dimension=dim, tiled=tiled))
      for dim in (0, -1):
        out.append(ops.all_gather(x, axes, axis=dim, tiled=tiled))
      out.append(ops.psum(x, axes))
    return out

  return fn


def _exact_program(mesh, impl, cases):
  """``_orders_and_dims`` for each (axes, dtype) of ``cases``, tc's and lax's, as one
  program: {(axes, dtype name): (ours, lax's)}."""
  inputs = []
  for axes, dtype in cases:
    p = math.prod(mesh.shape[a] for a in axes)
    tiled = small_integers((mesh.size, 2 * p, 3, 2 * p), dtype, seed=p)
    untiled = small_integers((mesh.size, p, 3, 5), dtype, seed=p)
    inputs += [tiled, untiled]

  def body(*vs):
    out = {}
    for i, (axes, dtype) in enumerate(cases):
      v = vs[2 * i : 2 * i + 2]
      ours, ref = _orders_and_dims(ops_for(impl), axes)(*v), _orders_and_dims(lax, axes)(*v)
      out[(axes, _name(dtype))] = (ours, ref)
    return out

  return harness.per_device(body, mesh, *inputs)


def assert_exact(ours, ref):
  for o, r in zip(ours, ref):
    assert o.shape == r.shape and o.dtype == r.dtype
    np.testing.assert_array_equal(np.asarray(o, np.float64), np.asarray(r, np.float64))


def check_exact(mesh, axes, dtype, impl):
  """``_orders_and_dims`` over ``axes`` equals lax's exactly, in one program."""
  assert_exact(*_exact_program(mesh, impl, [(axes, dtype)])[(axes, _name(dtype))])


def _orders_refusal(impl, rank, axes, dtype):
  return first_refusal(
    impl, [dict(op=op, dtypes=(dtype,), mesh_axes=len(axes)) for op in FAMILY_OPS]
  )


def _keep_order(impl, rank, axes, dtype):
  """Lax-like implementations hand the names to lax as given: the two orders of the floats
  suffice for them."""
  return not lax_like(impl) or axes in (ORDERS[rank][0], rotated_right(ORDERS[rank][0]))


@cases("rank,axes,dtype", rows=ORDER_CASES, refuses=_orders_refusal, keep=_keep_order)
def test_axis_orders_and_dimensions(impl, dma, rank, axes, dtype):
  """Chunks row-major over the axis names in every order, scattered and gathered along
  the first and last dimension, tiled and untiled: exactly lax's."""
  mesh = torus(rank)[0]
  expected = _orders_refusal(impl, rank, axes, dtype)
  if expected is not None:
    with pytest.raises(expected[0], match=expected[1]):
      run(impl, lambda: check_exact(mesh, axes, dtype, impl), dma)
    return
  if kernels(impl):
    run(impl, lambda: check_exact(mesh, axes, dtype, impl), dma)
    return
  group = [
    (a, d)
    for r, a, d in ORDER_CASES
    if r == rank and _keep_order(impl, r, a, d) and _orders_refusal(impl, r, a, d) is None
  ]
  run_one = lambda case: _exact_program(mesh, impl, [(axes, dtype)])[case]
  run_all = lambda: _exact_program(mesh, impl, group)  # keys: (axes, dtype name)
  key = (axes, _name(dtype))
  assert_exact(*harness.group_result(("orders", impl, rank), key, run_all, run_one))


# Machine epsilon of each dtype the rounding bound is checked in.
EPS = {np.dtype(np.float32): 2.0**-23, np.dtype(jnp.bfloat16): 2.0**-8}


def _rounding_refusal(impl, rank, dtype):
  return first_refusal(
    impl, [dict(op=op, dtypes=(dtype,), mesh_axes=len(RANKS[rank])) for op in FAMILY_OPS[::2]]
  )


@cases("rank,dtype", RANKS, [np.float32, jnp.bfloat16], refuses=_rounding_refusal)
def test_random_floats_within_rounding_bound(impl, dma, rank, dtype):
  """|ours - exact| <= p * eps * sum_i |x_i|: at most p roundings of partial sums."""
  expected = _rounding_refusal(impl, rank, dtype)
  if expected is not None:
    with pytest.raises(expected[0], match=expected[1]):
      _rounding_bound(impl, rank, dtype, dma)
    return
  _rounding_bound(impl, rank, dtype, dma)


def _rounding_inputs(rank, dtype):
  p = math.prod(RANKS[rank])
  return harness.random_floats((p, 2 * p, 17), dtype, seed=2).astype(np.float64)


def _rounding_program(impl, rank, dtypes, dma=None):
  """tc's all-reduce and tiled reduce-scatter of random floats of each of ``dtypes``, over
  the axes rotated left, and each device's position in that order: {dtype name: ...}."""
  mesh, names, _ = torus(rank)
  axes = rotated_left(names)
  fn = lambda *vs: {
    _name(d): (
      tc.all_reduce(v, axes, implementation=impl),
      tc.reduce_scatter(v, axes, tiled=True, implementation=impl),
      lax.axis_index(axes),
    )
    for d, v in zip(dtypes, vs)
  }
  values = [jnp.asarray(_rounding_inputs(rank, d), d) for d in dtypes]
  return run(impl, lambda: harness.per_device(fn, mesh, *values), dma)


def _rounding_bound(impl, rank, dtype, dma):
  eps = EPS[np.dtype(dtype)]
  p = math.prod(RANKS[rank])
  x = _rounding_inputs(rank, dtype)
  run_one = lambda name: _rounding_program(impl, rank, [dtype], dma)[name]
  if kernels(impl):
    summed, scattered, index = run_one(_name(dtype))
  else:
    dtypes = [d for d in EPS if _rounding_refusal(impl, rank, d) is None]
    run_all = lambda: _rounding_program(impl, rank, dtypes)
    group = ("rounding", impl, rank)
    summed, scattered, index = harness.group_result(group, _name(dtype), run_all, run_one)
  exact = x.sum(0)
  bound = p * eps * np.abs(x).sum(0)
  for d in range(p):
    assert np.all(np.abs(np.asarray(summed[d], np.float64) - exact) <= bound)
    rows = slice(int(index[d]) * 2, int(index[d]) * 2 + 2)
    assert np.all(np.abs(np.asarray(scattered[d], np.float64) - exact[rows]) <= bound[rows])


GRADIENT_OPS = {
  "reduce_scatter": (
    lambda impl, axes: lambda v: tc.reduce_scatter(v, axes, tiled=True, implementation=impl),
    lambda axes: lambda v: lax.psum_scatter(v, axes, tiled=True),
  ),
  "all_gather": (
    lambda impl, axes: lambda v: tc.all_gather(v, axes, tiled=True, implementation=impl),
    lambda axes: lambda v: lax.all_gather(v, axes, tiled=True),
  ),
  "all_reduce": (
    lambda impl, axes: lambda v: tc.all_reduce(v, axes, implementation=impl),
    lambda axes: lambda v: lax.psum(v, axes),
  ),
}


def _gradient(impl, rank, op):
  """The gradient of a weighted loss of ``op`` (tc's with ``impl``, lax's for None), over
  the axes in reverse order."""
  mesh, names, p = torus(rank)
  axes = names[::-1]
  x = jnp.asarray(small_integers((p, 2 * p, 3), np.float32, seed=3))
  w = jnp.asarray(small_integers((p, p * 2 * p, 3), np.float32, seed=4))
  fn = GRADIENT_OPS[op][1](axes) if impl is None else GRADIENT_OPS[op][0](impl, axes)

  def loss(x):
    body = lambda v, u: jnp.sum(fn(v) * u[: fn(v).shape[0]])
    return jnp.sum(harness.per_device(body, mesh, x, w))

  return jax.jit(jax.grad(loss))(x)


@cases("rank,op", RANKS, GRADIENT_OPS)
def test_gradients_match_lax(impl, dma, rank, op):
  """The gradient of a weighted loss of each op, over the axes in reverse order."""
  if kernels(impl):
    g_ours, g_lax = run(impl, lambda: _gradient(impl, rank, op), dma), _gradient(None, rank, op)
  else:
    run_all = lambda: jax.jit(
      lambda: {o: (_gradient(impl, rank, o), _gradient(None, rank, o)) for o in GRADIENT_OPS}
    )()
    run_one = lambda o: (_gradient(impl, rank, o), _gradient(None, rank, o))
    g_ours, g_lax = harness.group_result(("gradients", impl, rank), op, run_all, run_one)
  np.testing.assert_array_equal(np.asarray(g_ours), np.asarray(g_lax))


@cases("rank", RANKS)
def test_gradient_summation(impl, dma, rank):
  """``all_reduce_gradients`` of a two-leaf tree over every axis is lax's psum per leaf."""
  mesh, axes, p = torus(rank)
  tree = {"a": small_integers((p, 5, 3), np.float32, 1), "b": small_integers((p, 7), np.float32, 2)}
  ours, ref = harness.per_device(
    lambda t: (
      tc.all_reduce_gradients(t, axes, mean=False, implementation=impl),
      jax.tree.map(lambda v: lax.psum(v, axes), t),
    ),
    mesh,
    tree,
  )
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


# ---------------------------------------------------------------------- pytrees, scalars


@cases("rank", TORUS_FREE, spread={("2d",): "on_wait"})
def test_pytree_all_ops(impl, dma, rank):
  """One collective per dtype bucket; "pallas" (seconds per kernel) runs two of the ops."""
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    def body(v):
      tree = {"a": v, "b": (v.astype(jnp.int32), v[:2, :1])}
      if kernels(impl):
        return ops.psum(tree, axes), ops.all_gather(tree["b"][1], axes, axis=1, tiled=True)
      return (
        ops.psum(tree, axes),
        ops.pmean(tree, axes[-1]),
        ops.psum_scatter(tree["a"], axes, tiled=True),
        ops.all_gather(tree, axes, axis=1, tiled=True),
      )

    return lambda: shard_mapped(local(body), mesh, x)

  check(impl, build, dma=dma)


@cases("rank", RANKS, kernel_free=True)
def test_python_scalars(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    return lambda: shard_mapped(
      lambda v: (ops.psum(1, axes), ops.psum(2.0, axes[0]), ops.pmean(3, axes[-1])),
      mesh,
      x,
      out_specs=P(),
    )

  check(impl, build)


# ---------------------------------------------------------------------- groups and to=

# Aligned tiles of each torus, as replica groups (linear device indices, each group
# row-major within its tile), and groups that are no tiles.
TILES = {"1d": [(2,), (4,)], "2d": [(1, 2), (2, 1)], "3d": [(1, 1, 2), (2, 1, 2)]}
NOT_TILES = {
  "1d": [[0, 2], [1, 3], [4, 6], [5, 7]],  # strided
  "2d": [[0, 2], [1, 3], [4, 6], [5, 7]],  # strided along y
  "3d": [[0, 3], [1, 2], [4, 7], [5, 6]],  # diagonals of the yz faces
}


def tile_groups(sizes, tile):
  """The replica groups of the aligned ``tile`` boxes of a mesh of ``sizes``: linear device
  indices (row-major over the axes), each group listed row-major within its box."""
  grid = np.arange(math.prod(sizes)).reshape(sizes)
  corners = itertools.product(*(range(0, n, t) for n, t in zip(sizes, tile)))
  return [
    grid[tuple(slice(c, c + t) for c, t in zip(corner, tile))].reshape(-1).tolist()
    for corner in corners
  ]


def test_tile_groups_lists_aligned_boxes():
  assert tile_groups((2, 2, 4), (1, 1, 2))[:3] == [[0, 1], [2, 3], [4, 5]]
  assert tile_groups((2, 2, 4), (2, 1, 2))[0] == [0, 1, 8, 9]
  assert tile_groups((2, 4), (1, 2)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert tile_groups((2, 4), (2, 1)) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _group_ops(ops, axes, groups):
  def body(v):
    return (
      ops.psum(v, axes, axis_index_groups=groups),
      ops.pmean(v, axes, axis_index_groups=groups),
      ops.psum_scatter(v, axes, axis_index_groups=groups, tiled=True),
      ops.all_gather(v, axes, axis_index_groups=groups),
    )

  return body


def _tile_refusal(impl, rank, tile):
  return refusal(impl, "psum", groups="tile", mesh_axes=len(RANKS[rank]))


@cases(
  "rank,tile", rows=[(rank, tile) for rank in RANKS for tile in TILES[rank]], refuses=_tile_refusal
)
def test_tile_groups(impl, dma, rank, tile):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(tile):
    groups = tile_groups(RANKS[rank], tile)
    return lambda ops: (
      lambda: shard_mapped(local(_group_ops(ops, axes, groups)), mesh, x, check_vma=False)
    )

  expected = _tile_refusal(impl, rank, tile)
  if expected is not None:
    check(impl, build(tile), expected=expected)
    return
  check_grouped(impl, ("tiles", rank), tile, {t: build(t) for t in TILES[rank]}, dma=dma)


def _not_tile_refusal(impl, rank):
  return refusal(impl, "psum", groups="other", mesh_axes=len(RANKS[rank]))


@cases("rank", RANKS, refuses=_not_tile_refusal)
def test_groups_that_are_not_tiles(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    return lambda: shard_mapped(
      local(lambda v: ops.psum(v, axes, axis_index_groups=NOT_TILES[rank])),
      mesh,
      x,
      check_vma=False,
    )

  check(impl, build, expected=_not_tile_refusal(impl, rank))


@cases("rank", RANKS, refuses=lambda impl, rank: _tile_refusal(impl, rank, None))
def test_tile_groups_under_check_vma(impl, dma, rank):
  """lax refuses groups under check_vma=True; an implementation that runs tiles runs them
  (and agrees with lax without the check)."""
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))
  groups = tile_groups(RANKS[rank], TILES[rank][0])
  body = lambda ops: local(lambda v: ops.psum(v, axes, axis_index_groups=groups))
  if lax_like(impl):
    with pytest.raises(NotImplementedError):
      shard_mapped(body(ops_for(impl)), mesh, x)
    return
  expected = _tile_refusal(impl, rank, None)
  if expected is not None:
    with pytest.raises(expected[0], match=expected[1]):
      run(impl, lambda: shard_mapped(body(ops_for(impl)), mesh, x), dma)
    return
  ours = run(impl, lambda: shard_mapped(body(ops_for(impl)), mesh, x), dma)
  assert_same(ours, shard_mapped(body(lax), mesh, x, check_vma=False))


@cases("rank", RANKS)
def test_gather_to_invarying(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    return lambda: shard_mapped(
      lambda v: ops.all_gather(v[0], axes, to="invarying"), mesh, x, out_specs=P()
    )

  check(impl, build, expected=refusal(impl, "all_gather", to="invarying"), dma=dma)


def end_orders(rank: str) -> tuple:
  """The natural order of ``rank``'s axis names and the last of ``ORDERS[rank]``, once each."""
  return tuple(dict.fromkeys([ORDERS[rank][0], ORDERS[rank][-1]]))


@cases(
  "rank,order",
  rows=[(r, o) for r in RANKS for o in end_orders(r)],
  spread={("2d", ("x", "y")): "on_wait", ("2d", ("y", "x")): "eager"},
)
def test_grad_of_gather_to_invarying(impl, dma, rank, order):
  """The transpose of an invariant gather is this device's own chunk of the cotangent: with a
  different weight on every chunk, the gradient on each device names its position in the
  row-major order over the axes (a transpose that walks the axes in the other order hands
  a device the weight of another device)."""
  mesh, _, p = torus(rank)
  x = data((p, 3), seed=5)
  weights = (
    jnp.asarray(small_integers((p, 3), np.float32, seed=6)) + 10 * jnp.arange(p * 1.0)[:, None]
  )

  def build(order):
    def with_ops(ops):
      def body(v):
        loss = lambda u: jnp.sum(weights * ops.all_gather(u, order, to="invarying"))
        return jax.grad(loss)(v[0])[None]

      return lambda: shard_mapped(body, mesh, x)

    return with_ops

  check_grouped(impl, ("invarying", rank), order, {o: build(o) for o in end_orders(rank)}, dma=dma)


def _reduced_refusal(impl, rank):
  return refusal(impl, "all_gather", to="reduced", mesh_axes=len(RANKS[rank]))


@cases("rank", RANKS, refuses=_reduced_refusal)
def test_gather_to_reduced(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    def body(v):
      return lax.pcast(ops.all_gather(v, axes, to="reduced"), axes, to="varying")

    return lambda: shard_mapped(local(body), mesh, x)

  check(impl, build, expected=_reduced_refusal(impl, rank))


# ---------------------------------------------------------------------- vmap and pmap axes


@cases("rank", RANKS, spread={("2d",): "on_wait"})
def test_vmap_axis_inside_shard_map(impl, dma, rank):
  """Without check_vma: lax refuses to mix a vmap axis with varying mesh axes under it."""
  mesh, axes, p = torus(rank)
  x = data((p, 4, 8, 3))
  mixed = (axes[0], "i") + axes[1:]

  def build(ops):
    def body(v):  # v: (4, 8, 3) per device, vmapped over its first axis as "i"
      def per_row(r):
        outs = (
          ops.psum(r, ("i", axes[-1])),
          ops.psum(r, mixed),
          ops.psum_scatter(r, "i", tiled=True),
          ops.all_gather(r, "i"),
        )
        return outs if kernels(impl) else outs + (ops.psum(r, axes[-1]),)

      return jax.vmap(per_row, axis_name="i")(v)

    return lambda: shard_mapped(local(body), mesh, x, check_vma=False)

  check(impl, build, dma=dma)


@cases("rank", RANKS)
def test_vmap_and_mesh_axes_in_one_gather_or_scatter(impl, dma, rank):
  """lax.all_gather / psum_scatter refuse a tuple mixing vmap and mesh axes (so "xla" and
  "auto" raise lax's error); the torus ops run it, and agree with lax composed axis by axis
  (chunks row-major over the tuple)."""
  mesh, axes, p = torus(rank)
  first = axes[0]
  n = RANKS[rank][0]
  x = data((p, 4, 4 * n, 3))

  def direct(ops):
    return lambda r: (
      ops.all_gather(r, ("i", first)),
      ops.psum_scatter(r, (first, "i"), tiled=True),
    )

  def composed(r):
    gathered = lax.all_gather(lax.all_gather(r, "i"), first, axis=1).reshape((4 * n,) + r.shape)
    total = lax.psum(lax.psum(r, "i"), first)
    own = lax.axis_index(first) * 4 + lax.axis_index("i")
    return gathered, lax.dynamic_slice_in_dim(total, own, 1)

  run_with = lambda f: (
    lambda: shard_mapped(local(jax.vmap(f, axis_name="i")), mesh, x, check_vma=False)
  )
  if lax_like(impl):
    with pytest.raises(Exception) as lax_error:
      run_with(direct(lax))()
    with pytest.raises(lax_error.type):
      run_with(direct(ops_for(impl)))()
    return
  assert_same(run(impl, run_with(direct(ops_for(impl))), dma), run_with(composed)())


@cases("", kernel_free=True)
def test_vmap_alone_and_unbatched_inputs(impl, dma):
  """No mesh: a vmap axis alone (the same for every rank)."""
  x = data((4, 4, 3))

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


@cases("")
def test_pmap_axes(impl, dma):
  """pmap over 4 devices, a vmap axis inside (no mesh of these ranks)."""
  x = data((4, 2, 4, 3))

  def build(ops):
    def body(v):
      inner = jax.vmap(
        lambda r: (ops.psum(r, ("i", "j")), ops.all_gather(r, "i"), ops.pmean(r, "j")),
        axis_name="j",
      )
      return inner(v), ops.psum_scatter(v, "i", scatter_dimension=1, tiled=True)

    return lambda: jax.pmap(body, axis_name="i", devices=jax.devices()[:4])(x)

  check(impl, build, dma=dma)


def _four_axes_refusal(impl):
  return refusal(impl, "psum", mesh_axes=4)


@cases("", refuses=_four_axes_refusal)
def test_four_mesh_axes(impl, dma):
  """A 4-D mesh: beyond the torus ranks, the record's ``max_torus_axes`` decides."""
  mesh, x = harness.mesh((2, 2, 2, 1), ("a", "b", "c", "d")), data((8, 8, 3))

  def build(ops):
    return lambda: shard_mapped(local(lambda v: ops.psum(v, ("a", "b", "c", "d"))), mesh, x)

  check(impl, build, expected=_four_axes_refusal(impl), dma=dma)


@cases("rank", TORUS_FREE)
def test_list_of_axis_names(impl, dma, rank):
  """lax.psum takes a list of names (lax.all_gather does not; the torus ops do)."""
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    return lambda: shard_mapped(
      local(lambda v: (ops.psum(v, list(axes[::-1])), ops.pmean(v, [axes[0]]))), mesh, x
    )

  check(impl, build, dma=dma)


# ---------------------------------------------------------------------- autodiff, control flow


def _sum_of_ops(ops, axes):
  """A polynomial of the collectives: on small integers every derivative is exact."""

  def f(v):
    s = ops.psum(v * v, axes)
    g = ops.all_gather(2 * v, axes, tiled=True)
    r = ops.psum_scatter(g * g, axes, tiled=True)
    return jnp.sum(s * s) + jnp.sum(r * v)

  return f


@cases("rank", TORUS_FREE, spread={("2d",): "eager"})
def test_jvp_and_linearize(impl, dma, rank):
  """ "pallas" (seconds per kernel) differentiates one all-reduce forward."""
  mesh, axes, p = torus(rank)
  x, t = data((p, 8), seed=1), data((p, 8), seed=2)

  def build(ops):
    if kernels(impl):
      f = lambda v: jnp.sum(ops.psum(v * v, axes) * v)
    else:
      f = _sum_of_ops(ops, axes)

    def body(v, dv):
      y, dy = jax.jvp(f, (v[0],), (dv[0],))
      if kernels(impl):
        return y[None], dy[None]
      _, lin = jax.linearize(f, v[0])
      return y[None], dy[None], lin(dv[0])[None]

    spec = P(axes)
    return lambda: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x, t)

  check(impl, build, dma=dma)


@cases("rank,check_vma", TORUS_FREE, [True, False])
def test_jacfwd_and_second_order_grad(impl, dma, rank, check_vma):
  mesh, axes, p = torus(rank)
  x = data((p, 8), seed=3)

  def build(check_vma):
    def with_ops(ops):
      f = _sum_of_ops(ops, axes)

      def body(v):
        v = v[0]
        hvp = jax.grad(lambda u: jnp.sum(jax.grad(f)(u) * u))(v)
        return jax.jacfwd(lambda u: ops.psum(u, axes))(v)[None], hvp[None]

      return lambda: shard_mapped(body, mesh, x, check_vma=check_vma)

    return with_ops

  builds = {c: build(c) for c in (True, False)}
  check_grouped(impl, ("jacfwd", rank), check_vma, builds, dma=dma)


@cases("rank", TORUS_FREE)
def test_vmap_of_grad_and_scan(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 3, 8), seed=4)

  def build(ops):
    f = _sum_of_ops(ops, axes)

    def body(v):
      grads = jax.vmap(jax.grad(f))(v[0])

      def step(carry, row):
        return carry + ops.psum(row, axes[-1]), ops.all_gather(row, axes[0], tiled=True)

      total, gathered = lax.scan(step, jnp.zeros_like(v[0, 0]), v[0])
      return grads[None], total[None], gathered[None]

    return lambda: shard_mapped(body, mesh, x)

  check(impl, build, dma=dma)


# ---------------------------------------------------------------------- vma, errors, edges


def _unreduced_refusal(impl, rank):
  return refusal(impl, "psum", unreduced=True, mesh_axes=len(RANKS[rank]))


@cases("rank", RANKS, refuses=_unreduced_refusal)
def test_unreduced_input(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    def body(v):
      return ops.psum(lax.pcast(v, axes, to="unreduced"), axes)

    return lambda: shard_mapped(body, mesh, x, out_specs=P())

  check(impl, build, expected=_unreduced_refusal(impl, rank), dma=dma)


@cases("rank", TORUS_FREE)
def test_replicated_input_is_summed_as_lax_does(impl, dma, rank):
  """With jax_auto_pcast (the default) lax sums an input invariant over the axes."""
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    return lambda: shard_mapped(
      lambda v: ops.psum(jnp.ones(3), axes), mesh, x, out_specs=P(), check_vma=True
    )

  check(impl, build, dma=dma)


@cases("rank,check_vma", RANKS, [True, False], kernel_free=True)
def test_unbound_axis_name(impl, dma, rank, check_vma):
  """Lax-like implementations raise what lax raises (NameError, or lax.psum's
  AssertionError under check_vma=True); the others raise NameError."""
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))
  for op in ("psum", "psum_scatter", "all_gather"):
    build = lambda ops, op=op: (
      lambda: shard_mapped(local(lambda v: getattr(ops, op)(v, "w")), mesh, x, check_vma=check_vma)
    )
    with pytest.raises(Exception) as lax_error:
      run(None, build(lax))
    expected = lax_error.type if lax_like(impl) else NameError
    with pytest.raises(expected):
      run(impl, build(ops_for(impl)))
    with pytest.raises(NameError, match="unbound axis name: x"):
      getattr(tc, op)(jnp.ones(8), "x", implementation=impl)


@cases("", kernel_free=True)
def test_pmap_without_axis_name_keeps_the_user_name(impl, dma):
  with pytest.raises(NameError, match="unbound axis name: i"):
    jax.pmap(lambda v: tc.psum(v, "i", implementation=impl), devices=jax.devices()[:2])(
      jnp.ones((2, 3))
    )


@cases("rank", RANKS, kernel_free=True)
def test_bad_scatter_dimension_is_a_type_error(impl, dma, rank):
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))
  with pytest.raises(TypeError):
    shard_mapped(
      local(lambda v: tc.psum_scatter(v, axes[-1], scatter_dimension=1.0, implementation=impl)),
      mesh,
      x,
    )


@cases("rank", RANKS, kernel_free=True)
def test_zero_size(impl, dma, rank):
  """Empty buffers skip the device work."""
  mesh, axes, p = torus(rank)
  x = data((p, 8, 3))

  def build(ops):
    return lambda: shard_mapped(local(lambda v: ops.psum(v[:0], axes)), mesh, x)

  check(impl, build)


PARTIAL_RANKS = [rank for rank, shape in RANKS.items() if len(shape) > 1]


def _partial_refusal(impl, rank):
  return refusal(impl, "psum", partial_manual=True, mesh_axes=len(RANKS[rank]) - 1)


@cases("rank", PARTIAL_RANKS, refuses=_partial_refusal)
def test_partial_manual(impl, dma, rank):
  """A shard_map manual over all but the first mesh axis: the record's ``partial_manual``
  says whether it runs (as lax) or refuses clearly."""
  mesh, axes, p = torus(rank)
  manual = axes[1:]
  x = data((p, 8, 3))

  def build(ops):
    return lambda: jax.jit(
      jax.shard_map(
        lambda v: ops.psum(v, manual),
        mesh=mesh,
        in_specs=P(manual),
        out_specs=P(),
        axis_names=set(manual),
      )
    )(x)

  check(impl, build, expected=_partial_refusal(impl, rank))


# ---------------------------------------------------------------------- the base itself


def _required(test_name: str, impl: str) -> bool:
  """Whether a test of the base must run ``impl`` in at least one case: every test runs
  every implementation without kernels (the 2x2x4 subprocess those with a schedule of
  their own); the matrix runs every implementation."""
  if test_name == "test_op_matches_lax":
    return True
  if test_name == "test_2x2x4_in_a_subprocess":
    return not lax_like(impl) and not kernels(impl)
  return not kernels(impl)


def test_every_registered_implementation_is_parametrized():
  """A registered implementation missing from the base's parametrization fails here: one
  registered after collection, or a test that lists implementations of its own."""
  registered = registry.implementations()
  assert set(IMPLEMENTATIONS) == set(registered), (
    f"registered after this module was collected: {set(registered) - set(IMPLEMENTATIONS)}"
  )
  tests = {n: f for n, f in globals().items() if n.startswith("test_") and callable(f)}
  missing = {}
  for name, test in tests.items():
    found = harness.parametrized_implementations(test)
    if not found:
      continue  # not a test of implementations
    lacking = {impl for impl in registered if _required(name, impl)} - found
    if lacking:
      missing[name] = sorted(lacking)
  assert not missing, missing
  matrix = [p for m in test_op_matches_lax.pytestmark if m.name == "parametrize" for p in m.args[1]]
  for impl in filter(kernels, registered):
    ranks = {p.values[2] for p in matrix if p.values[0] == impl and p.values[1] is not None}
    assert ranks == set(RANKS), f"{impl} launches kernels in the matrix on {ranks} only"


# ---------------------------------------------------------------------- 16 devices


def check_tile_groups(mesh, impl, cases):
  """psum, pmean, psum_scatter (tiled and not) and all_gather over the replica groups of
  each (axes, tile, dtype) of ``cases`` equal lax's exactly on small integers (lax takes
  groups only without check_vma), all in one program; or raise the record's refusal."""
  ours = ops_for(impl)
  inputs = []
  for _, tile, dtype in cases:
    g = math.prod(tile)
    inputs.append(small_integers((mesh.size, 2 * g, 3), dtype, seed=g))
    inputs.append(small_integers((mesh.size, 3, g), dtype, seed=g + 1))

  def fn(*vs):
    out = []
    for i, (axes, tile, _) in enumerate(cases):
      x, u = vs[2 * i : 2 * i + 2]
      kw = dict(axis_index_groups=tile_groups(tuple(mesh.shape[a] for a in axes), tile))
      ops = lambda m, axes=axes, x=x, u=u, kw=kw: (
        m.psum(x, axes, **kw),
        m.pmean(x, axes, **kw),
        m.psum_scatter(x, axes, tiled=True, **kw),
        m.psum_scatter(u, axes, scatter_dimension=1, **kw),
        m.all_gather(x, axes, axis=1, **kw),
        m.all_gather(x, axes, tiled=True, **kw),
      )
      out.append((ops(ours), ops(lax)))
    return out

  expected = first_refusal(
    impl, [dict(op="psum", groups="tile", mesh_axes=len(axes)) for axes, _, _ in cases]
  )
  if expected is not None:
    with pytest.raises(expected[0], match=expected[1]):
      harness.per_device(fn, mesh, *inputs, check_vma=False)
    return
  for ours, ref in harness.per_device(fn, mesh, *inputs, check_vma=False):
    assert_exact(ours, ref)


@pytest.mark.slow
@pytest.mark.parametrize(
  "impl", [impl for impl in IMPLEMENTATIONS if not lax_like(impl) and not kernels(impl)]
)
def test_2x2x4_in_a_subprocess(impl):
  """The 2x2x4 torus (a 4-long axis: phases of several steps), in a 16-device process, for
  each implementation with a schedule of its own (the lax-like ones hand the call to lax;
  the kernels' 2x2x4 run is test_kernels_interpret.py's)."""
  run_as_script(__file__, 16, f"{MARKER}: {impl}", args=[impl])


def main(impl: str) -> None:
  mesh = harness.mesh((2, 2, 4))
  exact = [
    (("x", "y", "z"), jnp.float32),
    (("z", "y", "x"), jnp.int32),
    (("y", "x", "z"), jnp.bfloat16),
  ]
  results = _exact_program(mesh, impl, exact)
  for axes, dtype in exact:
    assert_exact(*results[(axes, _name(dtype))])
  # Replica groups over part of an axis: each ring spans 2 of the 4 devices along z.
  tiles = [
    (("x", "y", "z"), (1, 1, 2), jnp.float32),
    (("x", "y", "z"), (2, 1, 2), jnp.float32),
    (("x", "y", "z"), (1, 2, 2), jnp.float32),
    (("x", "y", "z"), (2, 2, 2), jnp.float32),
    (("z", "x"), (2, 1), jnp.float32),
    (("y", "z"), (2, 2), jnp.float32),
    (("x", "y", "z"), (2, 2, 2), jnp.int32),
  ]
  check_tile_groups(mesh, impl, tiles)
  print(f"{MARKER}: {impl}")


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(sys.argv[1])
