"""Two behaviours jax's own collective tests (``tests/shard_map_test.py``) found in the
explicit implementations, pinned for every implementation.

1. ``vmap`` of a ``shard_map`` on an Explicit-axes mesh (jax's ``test_vmap_shmap_psum``):
   the batch dimension is sharded over an axis that is not manual inside the body, so a
   collective's batching rule cannot fold it into a flat buffer. Results and output
   sharding must equal lax's. (jax 0.12's own ``psum_scatter`` and ``all_gather`` fail
   in this setting, so there is no reference for them; ``psum`` and ``pmean`` are
   pinned.)
2. A collective over an axis nothing binds raises lax's own ``NameError``, word for word,
   so code that matches lax's message keeps working.

Both run for every implementation registered at collection time ("auto" and
``registry.BACKENDS``); what an implementation does in the first is read off its record.
"""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import registry

IMPLEMENTATIONS = registry.implementations()
OPS = {
  "psum": (lambda x, axis, **kw: tc.psum(x, axis, **kw), lambda x, axis: lax.psum(x, axis)),
  "psum_scatter": (
    lambda x, axis, **kw: tc.psum_scatter(x, axis, tiled=True, **kw),
    lambda x, axis: lax.psum_scatter(x, axis, tiled=True),
  ),
  "all_gather": (
    lambda x, axis, **kw: tc.all_gather(x, axis, tiled=True, **kw),
    lambda x, axis: lax.all_gather(x, axis, tiled=True),
  ),
}


def _needs_every_axis_manual(implementation: str) -> bool:
  """The record refuses a shard_map that leaves some mesh axes automatic."""
  if implementation == "auto":
    return False
  backend = registry.BACKENDS[implementation]
  return not backend.lax_reference and not backend.partial_manual


VMAPPED = {
  "psum": OPS["psum"],
  "pmean": (lambda x, axis, **kw: tc.pmean(x, axis, **kw), lambda x, axis: lax.pmean(x, axis)),
}


@pytest.mark.parametrize("op", sorted(VMAPPED))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_of_shard_map_on_an_explicit_mesh_equals_lax(implementation, op):
  ours_fn, lax_fn = VMAPPED[op]
  mesh = harness.mesh((2, 2), axis_types=AxisType.Explicit)

  def outputs(collective):
    @functools.partial(
      jax.shard_map,
      in_specs=P("y"),
      out_specs=P(None),
    )
    def f(x):
      return collective(x, "y")

    with jax.set_mesh(mesh):
      values = jnp.arange(2 * 256, dtype=jnp.float32).reshape(2, 256) % 7  # exact sums
      arr = jax.device_put(values, P("x", "y"))
      return jax.jit(jax.vmap(f))(arr)

  ours_collective = functools.partial(ours_fn, implementation=implementation)
  if _needs_every_axis_manual(implementation):  # the mesh's x stays automatic: it says so
    with pytest.raises(ValueError, match="needs every mesh axis manual"):
      outputs(ours_collective)
    return
  ours = outputs(ours_collective)
  ref = outputs(lax_fn)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
  assert ours.sharding == ref.sharding
  assert ours.sharding.spec[0] == "x"
  assert isinstance(ours.sharding, NamedSharding)


def _lax_error(op) -> str:
  with pytest.raises(NameError) as error:
    jax.jit(lambda x: OPS[op][1](x, "x"))(jnp.ones(8))
  return str(error.value)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unbound_axis_raises_lax_own_name_error(implementation, op):
  expected = _lax_error(op)
  with pytest.raises(NameError) as error:
    jax.jit(lambda x: OPS[op][0](x, "x", implementation=implementation))(jnp.ones(8))
  assert str(error.value) == expected


def test_lax_message_names_the_fix_for_psum():
  """The message pinned above is lax's full text, not a stand-in."""
  assert _lax_error("psum").startswith("Found an unbound axis name: x. To fix this")
