"""all_reduce_gradients, and a data-parallel training loop that must track lax.psum's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_cases import mesh_of, per_device, sharded, small_integers
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
  mesh = mesh_of("2x4")
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
  mesh = mesh_of("2x4")
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
  mesh = mesh_of("2x4")
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
