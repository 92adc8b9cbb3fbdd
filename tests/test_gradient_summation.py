"""all_reduce_gradients, and a data-parallel training loop that must track lax.psum's."""

import harness
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from harness import per_device, sharded, small_integers
from jax import lax

import torus_collectives as tc


def _tree(seed, dtype=jnp.float32):
  return {
    "w": jnp.asarray(small_integers((8, 5, 3), np.float32, seed), dtype),
    "b": jnp.asarray(small_integers((8, 7), np.float32, seed + 1), dtype),
    "layers": [jnp.asarray(small_integers((8, 2, 2), np.float32, seed + 2), dtype)],
  }


@pytest.mark.parametrize("bucket_bytes", [16, 10**6])  # one leaf per bucket / one bucket
@pytest.mark.parametrize("mean", [True, False])
def test_matches_psum(bucket_bytes, mean):
  mesh = harness.mesh((2, 4))
  tree = _tree(0)

  def fn(t):
    ours = tc.all_reduce_gradients(
      t, ("x", "y"), mean=mean, bucket_bytes=bucket_bytes, implementation="shard_map"
    )
    ref = jax.tree.map(lambda g: (lax.pmean if mean else lax.psum)(g, ("x", "y")), t)
    return ours, ref

  ours, ref = per_device(fn, mesh, tree)
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


def test_bf16_transport_keeps_dtypes_and_sums_exactly_on_small_integers():
  mesh = harness.mesh((2, 4))
  tree = _tree(5)
  fn = lambda t: tc.all_reduce_gradients(
    t, ("x", "y"), mean=False, transport_dtype=jnp.bfloat16, implementation="shard_map"
  )
  out = per_device(fn, mesh, tree)
  for o, leaf in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    assert o.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(leaf).sum(0))


def test_data_parallel_sgd_tracks_psum():
  """Ten SGD steps of a tiny MLP: parameters equal the lax.psum version's."""
  mesh = harness.mesh((2, 4))
  rng = np.random.default_rng(0)
  data = jnp.asarray(rng.standard_normal((8, 16, 4)), jnp.float32)
  labels = jnp.asarray(rng.standard_normal((8, 16, 1)), jnp.float32)
  params = {
    "w1": jnp.asarray(rng.standard_normal((4, 8)) * 0.3, jnp.float32),
    "w2": jnp.asarray(rng.standard_normal((8, 1)) * 0.3, jnp.float32),
  }

  def local_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  def train(params, ours):
    def step(p, x, y):
      g = jax.grad(local_loss)(p, x, y)
      g = (
        tc.all_reduce_gradients(g, ("x", "y"), implementation="shard_map")
        if ours
        else jax.tree.map(lambda v: lax.pmean(v, ("x", "y")), g)
      )
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    replicated = jax.tree.map(lambda v: jnp.broadcast_to(v, (8,) + v.shape), params)
    sharded_step = sharded(step, mesh)
    for _ in range(10):
      replicated = sharded_step(replicated, data, labels)
    return replicated

  ours, ref = train(params, True), train(params, False)
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(o[7]))  # replicas agree


# transport_dtype on every path, against lax, on axes of different sizes (2 and 4).

AXIS_NAMES = ["x", "y", ("x", "y"), ("y", "x")]


@pytest.mark.parametrize("implementation", ["xla", "auto", "shard_map"])
@pytest.mark.parametrize("transport_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("axes", AXIS_NAMES, ids=lambda a: "".join(a))
def test_transport_dtype_matches_lax(implementation, transport_dtype, mean, axes):
  """Sums of up to eight integers in [-4, 4] are exact in every transport dtype, and the
  means divide by 2, 4 or 8 (exact too): the results must equal lax.psum / lax.pmean
  bitwise. Averaging over "x" (2 devices) and "y" (4) tells a division by the wrong axis's
  size, or by the whole mesh's, from the right one."""
  mesh = harness.mesh((2, 4))
  tree = _tree(11)

  def fn(t):
    ours = tc.all_reduce_gradients(
      t, axes, mean=mean, transport_dtype=transport_dtype, implementation=implementation
    )
    ref = jax.tree.map(lambda g: (lax.pmean if mean else lax.psum)(g, axes), t)
    return ours, ref

  ours, ref = per_device(fn, mesh, tree)
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert o.dtype == r.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


@pytest.mark.parametrize("implementation", ["auto", "xla", "shard_map", "lax_torus", "pallas"])
@pytest.mark.parametrize("transport_dtype", [jnp.int32, jnp.uint8, jnp.int16, jnp.bool_])
def test_integer_transport_dtype_is_refused(implementation, transport_dtype):
  """An integer transport dtype other than int8 (block-scaled, see
  test_block_scaled_transport.py) would truncate every gradient to whole numbers: refused
  with a ValueError naming the fix, at trace time (before any device work)."""
  mesh = harness.mesh((2, 4))
  fn = lambda t: tc.all_reduce_gradients(
    t, ("x", "y"), transport_dtype=transport_dtype, implementation=implementation
  )
  with pytest.raises(
    ValueError, match="neither a floating dtype nor a block-scaled.*int8.*bfloat16"
  ):
    per_device(fn, mesh, _tree(0))


# Bucket packing: leaves that exactly fill a bucket share it.


def _count_primitives(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and every jaxpr nested in its params."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _count_primitives(sub.jaxpr, name)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _count_primitives(sub, name)
  return count


@pytest.mark.parametrize(
  "sizes, bucket_bytes, collectives",
  [
    ([4, 4, 4, 4], 32, 2),  # two 16-byte leaves fill each 32-byte bucket exactly
    ([8, 4, 4], 32, 2),  # a leaf of exactly bucket_bytes, then two that fill the next
    ([4, 4, 4, 4], 31, 4),  # one byte short: every leaf alone
    ([4, 4, 4, 4], 64, 1),
  ],
)
def test_bucket_boundaries_in_the_jaxpr(sizes, bucket_bytes, collectives):
  """Greedy packing puts a leaf in the open bucket while the bucket stays within
  ``bucket_bytes`` (boundary included): counted as torus all-reduces in the jaxpr. The sums
  still equal lax.psum's."""
  mesh = harness.mesh((2, 4))
  tree = [
    jnp.asarray(small_integers((8, n), np.float32, seed=i), jnp.float32)
    for i, n in enumerate(sizes)
  ]
  fn = lambda t: tc.all_reduce_gradients(
    t, ("x", "y"), mean=False, bucket_bytes=bucket_bytes, implementation="shard_map"
  )
  program = sharded(fn, mesh)
  assert _count_primitives(jax.make_jaxpr(program)(tree).jaxpr, "torus_all_reduce") == collectives
  for o, leaf in zip(program(tree), tree):
    np.testing.assert_array_equal(np.asarray(o), np.broadcast_to(leaf.sum(0), leaf.shape))
