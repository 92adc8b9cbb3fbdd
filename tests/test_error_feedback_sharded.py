"""Error feedback under weight-update sharding: the state's shapes and types, and the
residual against the one the unsharded summation carries.

``sharded_update(..., transport_dtype=jnp.int8, error_feedback=True)`` reduce-scatters
the gradients with block-scaled transport and keeps, per device, what its quantizations
took off every gradient leaf (whole leaves, float32). Unsharded, ``all_reduce_gradients``
with ``residual=`` runs the same reduce-scatter as the first half of its all-reduce and
then quantizes each device's reduced chunk once more for the gather. Where the two lay a
leaf out alike (a leaf of p chunks of one padded width each), their residuals are the
same bits off this device's own chunk; on it the sharded residual is zero (the weights'
all-gather is exact) and the unsharded one is the gather's quantization error, which is
what the unsharded mean lost against the sharded one.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.weight_update.sharded_update import ErrorFeedbackState

AXES = ("x", "y")


def _error_feedback(tx):
  return tc.sharded_update(
    tx, AXES, transport_dtype=jnp.int8, error_feedback=True, implementation="shard_map"
  )


def test_state_shapes_and_types():
  """Literal shapes of the state on a 2x4 mesh (8 devices), whatever the parameters'
  dtype; typed varying like the step's, so that it is a loop carry under check_vma."""
  mesh = harness.mesh((2, 4))
  params = {
    "kernel": jnp.zeros((3, 5), jnp.float32),
    "bias": jnp.zeros((7,), jnp.bfloat16),
    "scale": jnp.zeros((), jnp.float32),
  }
  sharded = _error_feedback(optax.sgd(0.1, momentum=0.9))

  def init_and_steps(params):
    state = sharded.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * lax.axis_index(AXES).astype(p.dtype), params)
    step = lambda _, carry: sharded.apply_gradients(grads, carry[1], carry[0])
    return state, lax.fori_loop(0, 2, step, (params, state))[1]

  run = jax.jit(jax.shard_map(init_and_steps, mesh=mesh, in_specs=P(), out_specs=P(AXES)))
  first, last = run(params)
  for state in (first, last):
    assert isinstance(state, ErrorFeedbackState)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state.residual)
    assert shapes == {
      "kernel": ((8, 3, 5), jnp.float32),  # [1, 3, 5] per device: whole leaves
      "bias": ((8, 7), jnp.float32),
      "scale": ((8,), jnp.float32),
    }
    (trace, _) = state.inner
    # Momentum is sharded: [1, ceil(n / 8)] per device.
    assert jax.tree.map(lambda x: x.shape, trace.trace) == {
      "kernel": (8, 2),
      "bias": (8, 1),
      "scale": (8, 1),
    }
  for leaf in jax.tree.leaves(first.residual):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
  # The gradients differ per device: some quantization lost something.
  assert np.abs(np.asarray(last.residual["kernel"])).max() > 0


# Each device's chunk of the leaf is exactly one padded width of the 2x2 torus's
# block-scaled reduce-scatter (4 streams x 2 blocks of 128), so the sharded layout
# (ceil(n / p) per device) and the all-reduce's (whole widths) coincide.
P_ = 4
SHAPE = (32, 128)
CHUNK = SHAPE[0] * SHAPE[1] // P_


def _own(flat_index, device):
  return flat_index // CHUNK == device


def test_residual_equals_the_unsharded_one_off_the_own_chunk():
  """Two steps of SGD (learning rate 1, from zero weights) sharded against
  ``all_reduce_gradients`` with a residual, both on the same backend. Step 1: the sharded
  residual is the unsharded one with the own chunk zeroed, bit for bit, and the unsharded
  own chunk is what its mean lost (p times the difference of the two means). Step 2, the
  unsharded summation given the sharded residual: the same bits again off the own chunk,
  so the sharded step added the residual to the gradients as the unsharded one does."""
  mesh = harness.mesh((2, 2))
  params = {"kernel": jnp.zeros(SHAPE, jnp.float32)}
  g1 = {"kernel": harness.random_floats((P_, *SHAPE), seed=3)}
  g2 = {"kernel": harness.random_floats((P_, *SHAPE), seed=4)}
  sharded = _error_feedback(optax.sgd(1.0))

  def both(g1, g2):
    state = sharded.init(params)
    new1, state1 = sharded.apply_gradients(g1, state, params)
    _, state2 = sharded.apply_gradients(g2, state1, new1)
    first = jax.tree.map(lambda r: r[0], state1.residual)
    zeros = jax.tree.map(lambda r: jnp.zeros_like(r[0]), state.residual)
    reduce = lambda g, r: tc.all_reduce_gradients(
      g, AXES, transport_dtype=jnp.int8, residual=r, implementation="shard_map"
    )
    mean1, unsharded1 = reduce(g1, zeros)
    _, unsharded2 = reduce(g2, first)
    return new1, mean1, first, unsharded1, jax.tree.map(lambda r: r[0], state2.residual), unsharded2

  outs = harness.per_device(both, mesh, g1, g2)
  new1, mean1, sharded1, unsharded1, sharded2, unsharded2 = (
    np.asarray(o["kernel"]).reshape(P_, -1) for o in outs
  )
  index = np.arange(new1.shape[1])
  for d in range(P_):
    own = _own(index, d)
    for ours, theirs in ((sharded1, unsharded1), (sharded2, unsharded2)):
      np.testing.assert_array_equal(ours[d][~own], theirs[d][~own], err_msg=f"device {d}")
      np.testing.assert_array_equal(ours[d][own], 0, err_msg=f"device {d}")
    # The unsharded own chunk: the reduced sum (p times the sharded mean, -new1) minus
    # what its gather delivered (p times its mean); both scalings by p = 4 are exact.
    lost = np.float32(-P_) * new1[d][own] - np.float32(P_) * mean1[d][own]
    np.testing.assert_array_equal(unsharded1[d][own], lost, err_msg=f"device {d}")
  assert np.abs(unsharded1[:, :CHUNK]).max() > 0 and np.abs(sharded1).max() > 0
