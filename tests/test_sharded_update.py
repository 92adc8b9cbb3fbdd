"""sharded_update: reduce-scatter, optimizer on 1/p, all-gather, against the unsharded run.

The reference is ``all_reduce_gradients`` followed by the same optax transformation on
every replica. The two compute the same elementwise arithmetic on the same mean gradient;
they can differ only in summation order: the torus schedule may add the 8 replicas'
gradients in another order in its reduce-scatter than in its all-reduce, and LARS sums its
norms per shard and then over shards. Each such difference is a few float32 ulps of values
of order 1 (2**-24 ~ 6e-8 relative); over 5 steps the largest seen is 3.6e-7, so parameters
must agree to ``rtol=atol=1e-6``. Where no sum is reordered (lax's reduce-scatter sums as its
all-reduce does; momentum and Adam have no norms) they must agree bitwise.
"""

import math
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import sharded_update_cases as cases
from jax.sharding import PartitionSpec as P
from two_processes import run_two

import torus_collectives as tc

TOL = dict(rtol=1e-6, atol=1e-6)
WORKER = Path(__file__).with_name("sharded_update_worker.py")


def _assert_trees_close(ours, ref, bitwise: bool):
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    if bitwise:
      np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
    else:
      np.testing.assert_allclose(np.asarray(o), np.asarray(r), **TOL)


@pytest.mark.parametrize(
  "name, implementation",
  [(name, impl) for impl in ("xla", "shard_map") for name in ("lars", "momentum", "adam")]
  + [("lars", "auto")],  # auto is xla off TPU: once is enough here
)
def test_matches_unsharded_optimizer(name, implementation):
  mesh = harness.mesh((2, 4))
  ours, _ = cases.run(mesh, name, cases.STEPS, sharded=True, implementation=implementation)
  ref, _ = cases.run(mesh, name, cases.STEPS, sharded=False, implementation=implementation)
  reordered = name == "lars" or implementation == "shard_map"
  _assert_trees_close(ours, ref, bitwise=not reordered)
  assert not any(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(cases.initial_params(mesh)))
  )


@pytest.mark.parametrize("gather", ["updates", "deferred"])
def test_every_way_of_gathering_is_the_same_step(gather):
  """``update`` + ``optax.apply_updates``, and the new weights kept as shards and gathered
  at the start of the next step (buckets in forward order), are the same steps as
  ``apply_gradients``: bitwise, since a gather moves values without arithmetic."""
  mesh = harness.mesh((2, 4))
  ours = cases.run(mesh, "lars", 3, sharded=True, gather=gather)
  params = cases.run(mesh, "lars", 3, sharded=True, gather="params")
  _assert_trees_close(ours, params, bitwise=True)


@pytest.mark.interpret
@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_pallas_in_interpret_mode_matches_unsharded(mode):
  mesh = harness.mesh((2, 4))
  ours = harness.interpreted(
    mode, lambda: cases.run(mesh, "momentum", 1, sharded=True, implementation="pallas")[0]
  )
  ref, _ = cases.run(mesh, "momentum", 1, sharded=False, implementation="xla")
  _assert_trees_close(ours, ref, bitwise=False)


def test_lars_exclusions_act_on_the_same_leaves():
  """With zero gradients, only weight decay moves the parameters: kernels only."""
  mesh = harness.mesh((2, 4))
  tx = tc.sharded_update(cases.transform("lars"), cases.AXES)

  def body(params):
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates

  params = cases.initial_params(mesh)
  updates = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(params)
  for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
    if path[-1].key == "kernel":
      p = jax.tree_util.tree_flatten_with_path(params)[0]
      (w,) = [w for q, w in p if q == path]
      # add_decayed_weights -> trust ratio (update = wd*w, so the ratio is trust/wd) -> lr.
      np.testing.assert_allclose(np.asarray(u), -0.5 * 0.01 * np.asarray(w), rtol=1e-5)
    else:
      np.testing.assert_array_equal(np.asarray(u), 0.0)


def test_state_is_one_pth_per_device():
  mesh = harness.mesh((2, 4))
  p = mesh.size
  _, sharded = cases.run(mesh, "adam", 1, sharded=True)
  _, full = cases.run(mesh, "adam", 1, sharded=False)
  sizes = [math.prod(s) for s in jax.tree.leaves(cases.SHAPES, is_leaf=lambda s: type(s) is tuple)]
  shard_elements = sum(math.ceil(n / p) for n in sizes)

  def per_device_bytes(tree):
    shards = [leaf.addressable_shards[0].data for leaf in jax.tree.leaves(tree)]
    return sum(s.size * s.dtype.itemsize for s in shards)

  for leaf in jax.tree.leaves(sharded):
    assert leaf.sharding.spec == P(cases.AXES) and leaf.shape[0] == p
    assert leaf.addressable_shards[0].data.shape == (1,) + leaf.shape[1:]
  # Adam: mu and nu, one float32 shard each per leaf, plus a per-device int32 step count.
  assert per_device_bytes(sharded) == 2 * 4 * shard_elements + 4
  assert per_device_bytes(full) == 2 * 4 * sum(sizes) + 4
  # The layout of the real parameters: each moment leaf is [p, ceil(size / p)], one row a device.
  params = cases.initial_params(mesh)
  adam = sharded[0]
  rows = [(p, math.ceil(leaf.size / p)) for leaf in jax.tree.leaves(params)]
  for moment in (adam.mu, adam.nu):
    assert jax.tree.structure(moment) == jax.tree.structure(params)
    assert [leaf.shape for leaf in jax.tree.leaves(moment)] == rows
  assert adam.count.shape == (p,)


def test_orbax_checkpoint_round_trip_resumes_bitwise(tmp_path):
  mesh = harness.mesh((2, 4))
  init, step = cases.step_fn(mesh, "lars", sharded=True)
  params = cases.initial_params(mesh)
  opt_state = init(params)
  params, opt_state = step(params, opt_state, jnp.int32(0))

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
  checkpointer.wait_until_finished()
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    {"params": params, "opt_state": opt_state},
  )
  restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  for a, b in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(opt_state), strict=True):
    assert a.sharding == b.sharding
  _assert_trees_close(restored, {"params": params, "opt_state": opt_state}, bitwise=True)

  resumed = step(restored["params"], restored["opt_state"], jnp.int32(1))
  continued = step(params, opt_state, jnp.int32(1))
  _assert_trees_close(resumed, continued, bitwise=True)


def test_integer_leaves_are_rejected():
  mesh = harness.mesh((2, 4))
  tx = tc.sharded_update(optax.sgd(0.1), cases.AXES)
  params = {"w": jnp.ones((8,)), "count": jnp.zeros((), jnp.int32)}
  fn = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(cases.AXES))
  with pytest.raises(ValueError, match=r"floating-point parameters.*\['count'\]"):
    jax.jit(fn)(params)


def test_unbound_axis_is_rejected():
  mesh = harness.mesh((2, 4))
  tx = tc.sharded_update(optax.sgd(0.1), ("x", "z"))
  fn = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(cases.AXES))
  with pytest.raises(ValueError, match="axis 'z' is not bound"):
    jax.jit(fn)({"w": jnp.ones((8,))})
  with pytest.raises(ValueError, match="not bound"):
    tx.init({"w": jnp.ones((8,))})  # outside shard_map


@pytest.mark.multiprocess
def test_two_processes_equal_one(tmp_path):
  """2 processes x 4 devices give the parameters 1 process x 8 devices gives."""
  out_file = tmp_path / "params.npz"
  run_two(WORKER, str(out_file))
  two = np.load(out_file)
  one, _ = cases.run(
    harness.mesh((2, 4)), "lars", cases.STEPS, sharded=True, implementation="shard_map"
  )
  for path, leaf in jax.tree_util.tree_flatten_with_path(one)[0]:
    np.testing.assert_array_equal(two[jax.tree_util.keystr(path)], np.asarray(leaf))
