"""``scale_by_trust_ratio`` and ``lars`` (``weight_update.trust_ratio``) on sharded leaves whose
norm is zero, against optax.

optax's trust ratio is 1 where the parameter norm or the update norm is zero, so a leaf
with zero parameters (a bias at initialization) still moves and a leaf with a zero update
stays finite. The sharded transforms sum each leaf's squared norm over the shards and must
keep that rule: the comparison is with optax run on the whole, unsharded leaves.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from torus_collectives.weight_update import trust_ratio

AXES = ("x", "y")


def _trees():
  """Leaves of 8 rows, one row per device: a zero parameter leaf, a zero update leaf, a leaf
  zero in both, a leaf zero on only some shards, and an ordinary one."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  zeros = jnp.zeros((8, 3), jnp.float32)
  partly = normal(8, 3).at[:5].set(0.0)
  params = {"zero_param": zeros, "zero_update": normal(8, 3), "both": zeros}
  params |= {"partly": partly, "plain": normal(8, 5)}
  updates = {"zero_param": normal(8, 3), "zero_update": zeros, "both": zeros}
  updates |= {"partly": normal(8, 3).at[2:].set(0.0), "plain": normal(8, 5)}
  return params, updates


def _sharded_update(transform, params, updates):
  """One ``transform.update`` inside shard_map, each device holding one row of every leaf."""
  mesh = harness.mesh((2, 4))
  spec = P(AXES)

  def body(u, p):
    state = transform.init(p)
    out, _ = transform.update(u, state, p)
    return out

  fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
  return jax.jit(fn)(updates, params)


def _assert_close(ours, ref):
  for name in ref:
    o, r = np.asarray(ours[name]), np.asarray(ref[name])
    assert np.all(np.isfinite(o)), name
    # Norms summed over 8 shards instead of one array: a few float32 ulps in the ratio.
    np.testing.assert_allclose(o, r, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("min_norm, eps", [(0.0, 0.0), (0.0, 1e-3)])
def test_scale_by_trust_ratio_with_zero_norm_leaves_matches_optax(min_norm, eps):
  params, updates = _trees()
  transform = trust_ratio.scale_by_trust_ratio(min_norm=min_norm, eps=eps, axis_name=AXES)
  ours = _sharded_update(transform, params, updates)
  ref, _ = optax.scale_by_trust_ratio(min_norm=min_norm, eps=eps).update(updates, None, params)
  _assert_close(ours, ref)
  # The rule itself: a ratio of 1 where either norm is zero.
  np.testing.assert_array_equal(np.asarray(ours["zero_param"]), np.asarray(updates["zero_param"]))


def test_lars_with_zero_norm_leaves_matches_optax():
  params, updates = _trees()
  kwargs = dict(learning_rate=0.1, weight_decay=0.0, trust_coefficient=0.001, momentum=0.9)
  ours = _sharded_update(trust_ratio.lars(**kwargs, axis_name=AXES), params, updates)
  opt = optax.lars(**kwargs)
  ref, _ = opt.update(updates, opt.init(params), params)
  _assert_close(ours, ref)
