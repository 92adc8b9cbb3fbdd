"""weight_update.xla_collectives: sharded_update's reduce-scatter and all-gather on lax.

``reduce_scatter_rows`` must hand each device the same shard as ``lax.psum_scatter`` of
the flattened rows, and ``all_gather_shards`` the same buffer as ``lax.all_gather``:
bitwise on small integers (every partial sum exact), and on random floats bitwise too,
since each is one XLA collective over the same devices in the same order.
``sharded_update`` on "xla", one bucket in whole tiles and one flat, must still equal
the unsharded step bitwise (momentum: no norm, no reordered sum). Compiled ahead of time
for each TPU generation, the step's gradient summation must be one ``reduce-scatter``
and its weight gather one ``all-gather`` in the scheduled program, where the plain lax
forms are all-reduces: compiler output, not a run.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.gradients import GRADIENT_SCOPE, WEIGHT_GATHER_SCOPE
from torus_collectives.weight_update import xla_collectives

AXES = ("x", "y")


@pytest.mark.parametrize(
  "m, dtype, padded",
  [
    (1024, jnp.float32, 1024),  # whole tiles already
    (8198, jnp.float32, 9216),  # pads 1018 elements
    (1000, jnp.float32, 1024),
    (5, jnp.float32, None),  # a tile would be 200 times the row
    (4000, jnp.bfloat16, 4096),  # 16-bit tiles are 16 rows: 2048 elements
    (1000, jnp.bfloat16, None),  # 2048 pads more than half
    (30721, jnp.float32, 32768),  # 31 tiles: 32, a multiple of 16
    (17408, jnp.float32, None),  # 17 tiles: 32 pads more than half
    (25600, jnp.float32, 32768),  # 25 tiles: 32
  ],
)
def test_tiled_row_length(m, dtype, padded):
  assert xla_collectives.tiled_row_length(m, dtype) == padded


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
  "m, dtype", [(1024, np.float32), (8198, np.float32), (5, np.float32), (4000, jnp.bfloat16)]
)
def test_each_device_gets_lax_psum_scatters_shard(m, dtype, check_vma):
  mesh = harness.mesh((2, 4), AXES)
  p = mesh.size
  ours = lambda rows: xla_collectives.reduce_scatter_rows(rows, AXES)
  lax_ = lambda rows: lax.psum_scatter(rows.reshape(-1), AXES, scatter_dimension=0, tiled=True)
  for values in (harness.small_integers, harness.random_floats):
    rows = values((p, p, m), dtype)  # a [p, m] buffer per device
    got = harness.per_device(ours, mesh, rows, check_vma=check_vma)
    want = harness.per_device(lax_, mesh, rows, check_vma=check_vma)
    assert got.shape == (p, m)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("m, dtype", [(1001, np.float32), (4000, jnp.bfloat16)])
def test_each_device_gets_lax_all_gathers_buffer(m, dtype, check_vma):
  mesh = harness.mesh((2, 4), AXES)
  ours = lambda shard: xla_collectives.all_gather_shards(shard, AXES)
  lax_ = lambda shard: lax.all_gather(shard, AXES, tiled=True)
  shards = harness.random_floats((mesh.size, m), dtype)
  got = harness.per_device(ours, mesh, shards, check_vma=check_vma)
  want = harness.per_device(lax_, mesh, shards, check_vma=check_vma)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got[0]), shards.reshape(-1))


def _momentum_steps(mesh, params, steps: int, *, sharded: bool):
  """``steps`` of SGD with momentum on per-replica gradients, weight-update sharded on
  "xla" or all-reduced; returns the parameters."""
  tx = optax.sgd(0.1, momentum=0.9)
  if sharded:
    # The kernel (262,500 bytes) fills a bucket; the bias gets one of its own.
    tx = tc.sharded_update(tx, AXES, implementation="xla", bucket_bytes=262_500)

  def body(params, state, step):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), step), lax.axis_index(AXES))
    grads = jax.tree.map(lambda w, k: w + jax.random.normal(k, w.shape), params, _keys(key, params))
    if sharded:
      return tx.apply_gradients(grads, state, params)
    grads = tc.all_reduce_gradients(grads, AXES, implementation="xla")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state_spec = P(AXES) if sharded else P()
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_spec))
  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(), state_spec, P()), out_specs=(P(), state_spec))
  )
  state = init(params)
  for i in range(steps):
    params, state = step(params, state, jnp.int32(i))
  return params


def _keys(key, tree):
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def test_sharded_update_on_xla_with_a_tiled_leaf_equals_the_unsharded_step():
  mesh = harness.mesh((2, 4), AXES)
  # 65,625 weights: a shard of 8,204, padded to 9,216 in the reduce-scatter; the bias's
  # bucket (7 weights) keeps the flat lax.psum_scatter.
  assert xla_collectives.tiled_row_length(-(-65625 // 8), jnp.float32) == 9216
  assert xla_collectives.tiled_row_length(1, jnp.float32) is None
  shapes = {"kernel": (3, 7, 3125), "bias": (7,)}
  params = {
    k: jnp.asarray(harness.random_floats(s, seed=i)) for i, (k, s) in enumerate(shapes.items())
  }
  ours = _momentum_steps(mesh, params, 2, sharded=True)
  ref = _momentum_steps(mesh, params, 2, sharded=False)
  for name in shapes:
    np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(ref[name]))
    assert not np.array_equal(np.asarray(ours[name]), np.asarray(params[name]))


@pytest.mark.aot
@pytest.mark.parametrize(
  "topology, dtype",
  [
    ("v5e:2x2", jnp.float32),
    ("v5e:2x2", jnp.bfloat16),
    ("v6e:2x2", jnp.float32),
    ("v5p:2x2x1", jnp.float32),
    ("v4:2x2x1", jnp.float32),
  ],
)
def test_the_gradient_reduce_scatter_compiles_to_a_reduce_scatter(topology, dtype):
  import aot_skip

  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from torus_collectives.testing.aot import topology_mesh
  from torus_collectives.testing.hlo_schedule import entry_ops

  mesh = topology_mesh(topology)
  p = mesh.size
  shape = (3, 7, 3000)  # a shard of 15,750 elements, padded to 16 whole tiles
  tx = tc.sharded_update(optax.sgd(0.1), AXES, implementation="xla")

  def step(params, x):  # the gradient computed on the device, as a backward pass would
    grads = jnp.tanh(params * x.reshape(shape)).astype(dtype)
    new, _ = tx.apply_gradients(grads, tx.init(params), params)
    return new

  program = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXES)), out_specs=P(), check_vma=False)
  )
  params = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((p * 3, 7, 3000), dtype, sharding=NamedSharding(mesh, P(AXES)))
  ops = entry_ops(program.lower(params, x).compile().as_text())
  # Every collective but the weights' all-gather: the flat form's all-reduce carries no
  # op_name, so it is told by what it is not.
  summation = [op for op in ops if op.collective and WEIGHT_GATHER_SCOPE not in op.op_name]
  assert [op.collective for op in summation] == ["reduce-scatter"], summation
  assert GRADIENT_SCOPE in summation[0].op_name
  gather = [op.collective for op in ops if op.collective and WEIGHT_GATHER_SCOPE in op.op_name]
  assert gather == ["all-gather"], gather


@pytest.mark.aot
@pytest.mark.parametrize(
  "tiles, dtype", [(1, jnp.float32), (16, jnp.float32), (31, jnp.float32), (47, jnp.bfloat16)]
)
def test_every_padded_row_compiles_to_a_reduce_scatter_on_a_16x16_torus(tiles, dtype):
  """Over v5e:16x16, 17 or 31 tiles a device fail to compile ("no feasible span
  count"): the padded rows round such counts up to a multiple of 16."""
  import aot_skip

  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from torus_collectives.testing.aot import topology_mesh
  from torus_collectives.testing.hlo_schedule import entry_ops

  mesh = topology_mesh("v5e:16x16")
  p = mesh.size
  m = tiles * xla_collectives.sublanes(dtype) * 128 - 3  # a row of `tiles` tiles, padded
  assert xla_collectives.tiled_row_length(m, dtype) is not None
  program = jax.jit(
    jax.shard_map(
      lambda v: xla_collectives.reduce_scatter_rows(jnp.tanh(v), AXES),
      mesh=mesh,
      in_specs=P(AXES),
      out_specs=P(AXES),
      check_vma=False,
    )
  )
  rows = jax.ShapeDtypeStruct((p * p, m), dtype, sharding=NamedSharding(mesh, P(AXES)))
  ops = entry_ops(program.lower(rows).compile().as_text())
  assert [op.collective for op in ops if op.collective] == ["reduce-scatter"]
