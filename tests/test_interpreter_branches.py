"""The sharded-update interpreter (``weight_update.sharded_eval``), branch by branch.

Each case is a small function of whole leaves, traced on their full shapes and run by
``Interpreter`` on this device's 1/p slice of each leaf (``Shards.cut``, as
``sharded_update`` gives it the reduce-scattered gradients), in the same program as the
plain function on the whole leaves on every device. The values are small integers (in
float32 too), so every sum is exact in any order and the two must agree bitwise: a
sharded result reassembled from the devices' slices, a replicated one on every device (a
reduction left shard-local differs from device to device). Every refusal
(``UnshardableTransformError``, raised while tracing) stands beside its nearest accepted
input: a transpose that keeps the order of a leaf's non-unit axes beside one that
reorders them, a reduction over every non-unit axis beside one over some, a contraction
of every axis beside a partial one, a size-preserving broadcast beside a larger one, a
branch on a replicated value beside one on a sharded value, a collective over another
axis beside one over the sharding axes, and each layout-dependent operation on a
replicated value beside the same on a leaf.

The mesh is 2x4, sharded over both axes (p = 8) unless a case says otherwise. A leaf of
20 elements has slices of 3 with 4 padding positions (device 6 holds the last 2
elements, device 7 none); one of 24 has none. The padding holds zeros when cut, and
whatever elementwise arithmetic makes of them (``x + 1``: ones), so a reduction that did
not mask it with its identity would be off.
"""

import functools
import math

import harness
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.weight_update.sharded_eval import (
  Interpreter,
  Sharded,
  Shards,
  Uniform,
  UnshardableTransformError,
  replicated,
)

MESH_AXES = ("x", "y")
FIX = "Fix: run this transformation unsharded"


@functools.cache
def _mesh():
  return harness.mesh((2, 4))


def _kind(value) -> str:
  if isinstance(value, Sharded):
    return "sharded"
  return "uniform" if isinstance(value, Uniform) else "replicated"


@functools.cache
def _program(fn, n_leaves: int, axes=MESH_AXES):
  """``(*leaves, *others) -> (interpreted, reference)`` as one jitted shard_map, and the
  kinds of the interpreted outputs (known once traced). ``leaves`` are sharded over
  ``axes`` (leaf ``i`` named ``['leaf{i}']`` in errors), ``others`` replicated; every
  output comes back with a leading axis of one entry per device: a sharded one as this
  device's slice."""
  kinds = []
  p = math.prod(_mesh().shape[a] for a in axes)

  def body(*args):
    shards = Shards(tuple(axes), p)
    cut = [shards.cut(v, v.shape, f"['leaf{i}']") for i, v in enumerate(args[:n_leaves])]
    outs = Interpreter(shards).run(jax.make_jaxpr(fn)(*args), [*cut, *args[n_leaves:]])
    kinds[:] = [_kind(o) for o in outs]
    ours = [o.local if isinstance(o, Sharded) else jnp.asarray(replicated(o)) for o in outs]
    ref = jax.tree.leaves(fn(*args))
    return [o[None] for o in ours], [r[None] for r in ref]

  spec = P(MESH_AXES)
  run = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P(), out_specs=(spec, spec)))
  return run, kinds, p


def _check(fn, leaves, others=(), *, kinds=None, axes=MESH_AXES):
  """Runs ``fn`` interpreted and plain; asserts they agree bitwise (and in dtype and
  shape), and the interpreted outputs' kinds where ``kinds`` is given."""
  run, got_kinds, p = _program(fn, len(leaves), axes)
  ours, ref = run(*map(jnp.asarray, leaves), *map(jnp.asarray, others))
  if kinds is not None:
    assert got_kinds == list(kinds)
  for i, (o, r, kind) in enumerate(zip(ours, ref, got_kinds, strict=True)):
    o, r = np.asarray(o), np.asarray(r)
    if kind == "sharded":  # slices of groups of p devices: whole values
      n = math.prod(r.shape[1:])
      whole = o.reshape(-1, p * o.shape[1])[:, :n].reshape(-1, *r.shape[1:])
      o = np.repeat(whole, r.shape[0] // whole.shape[0], axis=0)
    np.testing.assert_array_equal(o, r, strict=True, err_msg=f"output {i} ({kind})")
  return ours, ref


def _refused(fn, leaves, others=(), *, primitive, why, leaf="['leaf0']", axes=MESH_AXES):
  run, _, _ = _program(fn, len(leaves), axes)
  with pytest.raises(UnshardableTransformError, match=f"`{primitive}` to leaf ") as error:
    jax.eval_shape(run, *map(jnp.asarray, leaves), *map(jnp.asarray, others))
  message = str(error.value)
  assert f"to leaf {leaf}" in message and why in message and FIX in message, message


def _leaf(shape, dtype=np.float32, *, top=10, bottom=4):
  """Values 2..8 but a single 9 at flat index ``top`` (device 3's slice of a padded
  leaf of 20) and a single 1 at ``bottom`` (device 1's): each extreme on one shard."""
  flat = 2 + (np.arange(math.prod(shape)) * 3) % 7
  flat[top], flat[bottom] = 9, 1
  return flat.reshape(shape).astype(dtype)


PADDED, WHOLE = (4, 5), (2, 3, 4)  # 20 elements: 4 padding positions; 24: none


# Whole-leaf reductions: the local reduction completed over the devices.


def _reductions(x):
  return {
    "sum": jnp.sum(x),
    "sum_padded_ones": jnp.sum(x + 1),  # the padding holds ones: masked with zeros
    "max": jnp.max(x),  # 9: on device 3 only
    "max_negative": jnp.max(-x),  # -1, below the padding's zeros: they must be masked
    "min": jnp.min(x),  # 1, above the padding's zeros: they must be masked
    "min_negative": jnp.min(-x),  # -9: on device 3 only
    "all": jnp.all(x > 0),  # True: the padding's zeros are not > 0
    "all_but_one": jnp.all(x != 9),  # False on device 3 only
    "any_one": jnp.any(x == 9),  # True on device 3 only
    "any": jnp.any(x > 9),  # False: the padding must not count
    "mean": jnp.mean(x + 1),
    "vdot_padded_ones": jnp.vdot(x + 1, x + 1),  # dot_general over every axis
  }


@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=["float32", "int32"])
@pytest.mark.parametrize("shape", [PADDED, WHOLE], ids=["padded", "whole"])
def test_whole_leaf_reductions(shape, dtype):
  x = _leaf(shape, dtype)
  fn = lambda x: (_reductions(x), x / (1 + jnp.max(x) - jnp.min(x)))
  _, ref = _check(fn, [x], kinds=["replicated"] * 12 + ["sharded"])
  values = dict(zip(sorted(_reductions(x)), (np.asarray(r[0]) for r in ref)))
  # The values tell the kinds apart.
  assert len({values[k].item() for k in ("sum", "max", "min", "max_negative")}) == 4
  assert values["all"] and not values["all_but_one"] and values["any_one"] and not values["any"]


def test_reductions_over_every_non_unit_axis_and_keepdims():
  """A reduction over all axes but unit ones is whole-leaf (the accepted twin of a
  partial reduction); ``keepdims`` reshapes the replicated result."""
  x = _leaf((4, 1, 5))
  fn = lambda x: (
    jnp.sum(x + 1, axis=(0, 2)),
    jnp.max(-x, axis=(0, 2)),
    jnp.min(x, keepdims=True),
    jnp.any(x == 9, axis=(0, 2)),
  )
  _check(fn, [x], kinds=["replicated", "replicated", "uniform", "replicated"])


@pytest.mark.parametrize(
  "fn, primitive",
  [
    (lambda x: jnp.sum(x, axis=1), "reduce_sum"),
    (lambda x: jnp.max(x, axis=0), "reduce_max"),
    (lambda x: jnp.min(x, axis=(0, 1)), "reduce_min"),
    (lambda x: jnp.all(x > 0, axis=2), "reduce_and"),
    (lambda x: jnp.any(x > 0, axis=0), "reduce_or"),
    (lambda x: jnp.sum(x.reshape(5, 4), axis=1), "reduce_sum"),  # rows of a reshaped leaf
  ],
  ids=["sum", "max", "min", "and", "or", "reshaped_rows"],
)
def test_partial_reductions_are_refused(fn, primitive):
  """Beside ``test_reductions_over_every_non_unit_axis_and_keepdims`` (the same leaf) and
  ``test_order_keeping_shape_changes`` (its reshape alone keeps the flat order)."""
  _refused(fn, [_leaf((4, 1, 5))], primitive=primitive, why="reduces over part of a leaf's axes")


def test_reductions_share_one_collective_per_kind_and_dtype():
  """Independent reductions wait for each other: one collective per (kind, dtype); a
  reduction of a reduced value waits for the first collective."""
  x, y = _leaf(PADDED), _leaf(WHOLE, np.int32)

  independent = lambda x, y: (
    jnp.sum(x) + jnp.sum(x * x) + jnp.max(x) - jnp.min(x) + jnp.sum(y) + jnp.max(y),
    jnp.all(x > 0),
    jnp.any(y > 8),
  )
  # One psum after another: sum(x) goes with the first.
  chained = lambda x, y: jnp.sum(x / jnp.sum(x * x)) + jnp.sum(x)
  run, _, _ = _program(independent, 2)
  counts = _collectives(jax.make_jaxpr(run)(x, y).jaxpr)
  # sum: f32 and i32; max: f32, i32 and `any`; min: f32 and `all`.
  assert counts == {"psum": 2, "pmax": 3, "pmin": 2}, counts
  run, _, _ = _program(chained, 2)
  assert _collectives(jax.make_jaxpr(run)(x, y).jaxpr) == {"psum": 2}
  _check(lambda x, y: (independent(x, y), chained(x, y)), [x, y])


def _collectives(jaxpr) -> dict[str, int]:
  counts: dict[str, int] = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name.replace("_invariant", "")
    if name in ("psum", "pmax", "pmin"):
      counts[name] = counts.get(name, 0) + 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          for k, v in _collectives(sub).items():
            counts[k] = counts.get(k, 0) + v
  return counts


# Contractions.


def test_full_contractions():
  """Both operands sharded, or one replicated (cut to the slice), padding masked."""
  x = _leaf(PADDED)
  r = _leaf(PADDED, top=0, bottom=19)[::-1].copy()
  fn = lambda x, r: (
    jnp.vdot(x + 1, x + 1),
    jnp.tensordot(x + 1, r, axes=2),
    jnp.tensordot(r, x + 1, axes=2),
    jnp.vdot(x.astype(jnp.int32) + 1, x.astype(jnp.int32)),
  )
  _check(fn, [x], [r], kinds=["replicated"] * 4)


def test_partial_contractions_are_refused():
  """A contraction over some axes, with a batch axis, or pairing axes in another order,
  beside the same leaves contracted over every axis in order (sum_ij a_ij b_ij)."""
  a, b = _leaf((4, 4)), _leaf((4, 4), top=2, bottom=13)
  v = np.arange(4, dtype=np.float32)
  dot = lambda dims: lambda a, b, v: lax.dot_general(a, b + 1, dims)
  why = "contracts only part of a leaf"
  for fn in (
    lambda a, b, v: a @ v,
    lambda a, b, v: jnp.einsum("ij,ij->i", a, b),
    dot((((0, 1), (1, 0)), ((), ()))),  # sum_ij a_ij b_ji pairs different slices
    dot((((1, 0), (1, 0)), ((), ()))),
  ):
    _refused(fn, [a, b], [v], primitive="dot_general", why=why)
  _check(dot((((0, 1), (0, 1)), ((), ()))), [a, b], [v], kinds=["replicated"])


# Elementwise arithmetic and broadcasts: every kind of operand beside a slice.


def test_elementwise_with_every_kind_of_operand():
  """Literals, a replicated scalar, a replicated scalar broadcast (kept uniform), a
  replicated whole array (cut to the slice), a replicated row broadcast to the leaf's
  shape, a size-one array broadcast, and a select on a sharded predicate."""
  x = _leaf(PADDED)
  full = _leaf(PADDED, top=0, bottom=19)[::-1].copy()
  scalar, row, one = np.float32(3), np.arange(5, dtype=np.float32) - 2, np.float32([5])

  def fn(x, scalar, full, row, one):
    uniform = jnp.full(x.shape, scalar)
    return (
      x * 2 + 1,
      x * scalar,
      x + uniform,
      x - full,
      x * row,  # row: (1, 5), which lax's mul broadcasts to (4, 5) implicitly
      x + jnp.broadcast_to(row, x.shape),  # a larger replicated broadcast
      x * one,  # (1,) broadcast to (4, 5): a size-one broadcast, uniform
      jnp.where(x > 4, x, full),
      lax.clamp(scalar, x, full + 4),
      uniform * 2 + full,  # uniform with a whole array: replicated
      uniform * 2,  # uniform with a literal: still uniform
      (jnp.ones(x.shape) * one) - scalar,  # size-one broadcasts all the way
      scalar * 2,
    )

  kinds = ["sharded"] * 9 + ["replicated", "uniform", "uniform", "replicated"]
  _check(fn, [x], [scalar, full, row, one], kinds=kinds)


def test_broadcasts_of_a_leaf():
  """A broadcast that keeps a leaf's size only relabels it (here of a leaf of 20, and of
  a one-element leaf: device 0 holds it, the others padding); one to a larger shape would
  need every element on every device and is refused."""
  x, single = _leaf(PADDED), np.float32([7])
  fn = lambda x, s: (
    jnp.broadcast_to(x, (1, 4, 5)) + 1,
    jnp.max(x[None]),
    jnp.broadcast_to(s, (1, 1)) * 2,
    jnp.sum(jnp.broadcast_to(s, (1,)) + 1),
  )
  _check(fn, [x, single], kinds=["sharded", "replicated", "sharded", "replicated"])
  larger = "broadcasts a leaf to a larger shape"
  _refused(lambda x: jnp.broadcast_to(x, (2, 4, 5)), [x], primitive="broadcast_in_dim", why=larger)
  _refused(lambda s: jnp.broadcast_to(s, (3,)), [single], primitive="broadcast_in_dim", why=larger)


def test_implicit_broadcasts_of_size_one_axes():
  """lax's binary operations broadcast size-one axes themselves (``mul f32[4,5]
  f32[1,5]``): a replicated operand is broadcast before it is cut, a leaf so broadcast is
  refused like an explicit broadcast."""
  x, row, single = _leaf(PADDED), _leaf((1, 5), top=3, bottom=1), np.float32([7])
  rows = np.arange(4, dtype=np.float32).reshape(4, 1) - 1
  fn = lambda x, row, rows: (x * row, jnp.where(x > 4, row, x), x - rows, jnp.max(x + row))
  _check(fn, [x], [row, rows], kinds=["sharded", "sharded", "sharded", "replicated"])
  larger = "broadcasts a leaf to a larger shape"
  _refused(lambda x, row: x * row, [x, row], primitive="mul", why=larger, leaf="['leaf0']")
  _refused(lambda s: s * jnp.ones(3), [single], primitive="mul", why=larger)


# Shape changes: relabelled when they keep the flat order, refused otherwise.


def test_order_keeping_shape_changes():
  x = _leaf((4, 1, 5))
  fn = lambda x: (
    x.reshape(5, 4) + 1,
    jnp.squeeze(x, 1),
    jnp.expand_dims(x, 0),
    jnp.transpose(x, (1, 0, 2)),  # moves the unit axis only
    jnp.transpose(x, (0, 2, 1)),  # (4, 5, 1): the non-unit axes in order
    jnp.transpose(x.reshape(20, 1)),  # (20, 1) -> (1, 20)
    jnp.max(jnp.transpose(x, (1, 0, 2)).reshape(20) - 10 * (x.reshape(20) == 9)),
  )
  _check(fn, [x], kinds=["sharded"] * 6 + ["replicated"])


@pytest.mark.parametrize(
  "shape, permutation",
  [((4, 1, 5), (2, 1, 0)), ((4, 1, 5), (2, 0, 1)), ((4, 5), (1, 0)), ((2, 3, 4), (0, 2, 1))],
  ids=["415_210", "415_201", "45_10", "234_021"],
)
def test_transposes_that_reorder_axes_are_refused(shape, permutation):
  """Beside ``test_order_keeping_shape_changes``' transposes of a (4, 1, 5) leaf."""
  _refused(
    lambda x: jnp.transpose(x, permutation) * 2,
    [_leaf(shape)],
    primitive="transpose",
    why="reorders a leaf's axes",
  )


# Control flow.


def test_branches_on_a_replicated_index():
  """``lax.switch`` on a replicated index (each branch taken, in one program); the
  branches mix sharded and uniform results and reduce; an index computed from a
  whole-leaf reduction is replicated too."""
  x = _leaf(PADDED)

  def fn(x, k):
    branches = [
      lambda x: (x * 2, jnp.sum(x)),
      lambda x: (jnp.zeros_like(x), jnp.float32(0)),  # uniform, replicated
      lambda x: (x / jnp.max(x + 1), jnp.min(x)),
    ]
    picked = lax.switch(k, branches, x)
    reduced = lax.cond(jnp.sum(x) > 100, lambda x: x - 1, lambda x: x + 1, x)
    return picked, reduced

  for k in range(3):  # one program: _program is cached
    _check(fn, [x], [np.int32(k)], kinds=["sharded", "replicated", "sharded"])


def test_branches_on_a_sharded_value_are_refused():
  """A one-element leaf is sharded: device 0 alone holds it."""
  _refused(
    lambda s, x: lax.cond(s[0] > 0, lambda x: x, lambda x: -x, x),
    [np.float32([2]), _leaf(PADDED)],
    primitive="cond",
    why="branches on a sharded value",
  )


def test_loops_run_on_replicated_values_only():
  x, r = _leaf(PADDED), np.float32([1, 2, 3])
  loop = lambda v: lax.fori_loop(0, 3, lambda i, v: v * 2 + i, v)
  _check(lambda x, r: x * loop(r).sum(), [x], [r], kinds=["sharded"])
  _refused(
    lambda x, r: loop(x), [x], [r], primitive="scan", why="depends on the whole leaf's layout"
  )


# Layout-dependent operations: exact on a replicated value, refused on a leaf.

LAYOUT = {
  "sort": (lambda v: jnp.sort(v, axis=None), "sort"),
  "cumsum": (lambda v: jnp.cumsum(v), "cumsum"),
  "argmax": (lambda v: jnp.argmax(v), "argmax"),
  "argmin": (lambda v: jnp.argmin(v), "argmin"),
  "top_k": (lambda v: lax.top_k(v.reshape(-1), 3)[0], "top_k"),
  "slice": (lambda v: v[1:], "slice"),
  "gather": (lambda v: v[jnp.array([2, 0])], "gather"),
  "dynamic_slice": (lambda v: lax.dynamic_slice_in_dim(v, 1, 2), "dynamic_slice"),
  "concatenate": (lambda v: jnp.concatenate([v, v]), "concatenate"),
  "flip": (lambda v: jnp.flip(v), "rev"),
  "pad": (lambda v: jnp.pad(v, 1), "pad"),
  "prod": (lambda v: jnp.prod(v), "reduce_prod"),
}


def test_layout_dependent_operations_on_replicated_values():
  x = _leaf(PADDED)
  fn = lambda x, r: [x * 2 + jnp.sum(op(r)) for op, _ in LAYOUT.values()]
  _check(fn, [x], [x[::-1].copy()], kinds=["sharded"] * len(LAYOUT))


@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_layout_dependent_operations_on_a_leaf_are_refused(name):
  op, primitive = LAYOUT[name]
  x = _leaf(PADDED)
  why = "depends on the whole leaf's layout"
  _refused(lambda x, r: op(x) * 2, [x], [x], primitive=primitive, why=why)


# Collectives and sharding bookkeeping.


def test_collectives_over_the_sharding_axes_are_refused():
  """The leaf sharded over ``y`` only: collectives over ``x`` run as written (the
  reference computes them the same way on every device), those over ``y`` are refused,
  whether they take the leaf (``psum``, ``axes=``) or nothing (``axis_index``,
  ``axis_name=``)."""
  x, r = _leaf(PADDED), np.float32([1, 2, 3])
  other = lambda x, r: (
    x * lax.psum(r, "x").sum(),
    x + lax.axis_index("x").astype(jnp.float32),
    lax.pmax(r * lax.axis_index("x"), "x"),
  )
  _check(other, [x], [r], axes=("y",), kinds=["sharded", "sharded", "replicated"])
  why = "already communicates over ('y',)"
  _refused(
    lambda x, r: lax.psum(x, "y"), [x], [r], axes=("y",), primitive="psum_invariant", why=why
  )
  _refused(
    lambda x, r: lax.pmax(x * r.sum(), ("x", "y")), [x], [r], axes=("y",), primitive="pmax", why=why
  )
  run, _, _ = _program(lambda x, r: x + lax.axis_index("y"), 1, ("y",))
  with pytest.raises(UnshardableTransformError, match=r"`axis_index`.*already communicates"):
    jax.eval_shape(run, x, r)


def test_varying_casts_pass_through():
  x = _leaf(PADDED)
  fn = lambda x: (
    lax.pcast(x, MESH_AXES, to="varying") * 2,
    jnp.sum(lax.pcast(x + 1, "x", to="varying")),
  )
  _check(fn, [x], kinds=["sharded", "replicated"])


# Through sharded_update: a hand-written transformation, its leaves named by their paths.


def _whole_leaf_transformation(reorder: bool):
  """Each update shifted by its leaf's mean and divided by one plus its spread (max -
  min); a transpose that keeps the order (or, ``reorder``, one that reverses it)."""

  def update(updates, state, params=None):
    del params

    def one(u):
      u = (u - jnp.mean(u)) / (1 + jnp.max(u) - jnp.min(u))
      if u.ndim == 2:
        u = u.T.T if reorder else jnp.transpose(u[:, None], (1, 0, 2))[0]
      return u

    return jax.tree.map(one, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def test_through_sharded_update():
  mesh = _mesh()
  params = {"kernel": jnp.asarray(_leaf((3, 5))), "bias": jnp.asarray(_leaf((7,), top=6, bottom=0))}

  def grads(params):  # small integers per replica: their mean is exact
    i = lax.axis_index(MESH_AXES).astype(jnp.float32)
    return jax.tree.map(lambda p: p * (i - 3) + i, params)

  def steps(params):
    tx = _whole_leaf_transformation(reorder=False)
    sharded = tc.sharded_update(tx, MESH_AXES, implementation="xla")
    ours, _ = sharded.apply_gradients(grads(params), sharded.init(params), params)
    updates, _ = tx.update(lax.pmean(grads(params), MESH_AXES), tx.init(params), params)
    return ours, optax.apply_updates(params, updates)

  ours, ref = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=P(), out_specs=P()))(params)
  for name in params:
    np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
    assert not np.array_equal(ours[name], params[name])

  sharded = tc.sharded_update(_whole_leaf_transformation(reorder=True), MESH_AXES)
  refused = lambda params: sharded.apply_gradients(grads(params), sharded.init(params), params)[0]
  step = jax.shard_map(refused, mesh=mesh, in_specs=P(), out_specs=P())
  with pytest.raises(
    tc.UnshardableTransformError, match=r"`transpose` to leaf \['kernel'\].*reorders"
  ):
    jax.eval_shape(step, params)
