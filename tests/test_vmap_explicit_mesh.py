"""``jax.vmap`` of a ``shard_map`` on an Explicit-axes 2x2 mesh, called without ``jit``.

The program: a ``shard_map`` over ``in_specs=P("y")`` whose body runs a collective over
``"y"``, vmapped over an array sharded ``P("x", "y")``, so that the batch dimension is
sharded over ``"x"``, an axis that stays Explicit (not manual) inside the body. With
``lax.psum`` it works called eagerly as well as under ``jit``; the torus implementations
once raised "shard_map ... not evenly divisible" when it ran eagerly: their batching rule
folds such a batch dimension inside a ``shard_map`` over ``"x"``, and jax's eager
evaluation of a ``shard_map`` nested in a running one misplaces a vmapped value's
dimensions (``test_lax_defects.py`` runs the jitted program).

Each implementation registered at collection time runs the program eagerly and under
``jit``, for each op, on small integers (every sum exact), and must give lax's outcome:
its values, shape and sharding, or, where lax itself fails (jax 0.12's ``psum_scatter``
here), the values a numpy reference computes; "auto" and the lax reference give lax's
outcome whatever it is. An implementation whose record refuses a ``shard_map`` that leaves
some mesh axes automatic ("pallas": its remote DMAs address every mesh axis) must raise
that refusal, in TPU interpret mode too, rather than answer.
"""

import functools

import harness
import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import registry

IMPLEMENTATIONS = registry.implementations()
BATCH, WIDTH = 2, 8  # the global array: BATCH rows over "x", WIDTH columns over "y"
VALUES = harness.small_integers((BATCH, WIDTH), np.float32)


def _halves_summed(v):
  return v[:, : WIDTH // 2] + v[:, WIDTH // 2 :]


# op -> (tc call, lax call, out_specs, the numpy result of the vmapped program)
OPS = {
  "psum": (tc.psum, lax.psum, P(), _halves_summed),
  "pmean": (tc.pmean, lax.pmean, P(), lambda v: _halves_summed(v) / 2),
  "psum_scatter": (
    functools.partial(tc.psum_scatter, tiled=True),
    functools.partial(lax.psum_scatter, tiled=True),
    P("y"),
    _halves_summed,  # the scattered chunks, concatenated over "y", are the whole sum
  ),
  "all_gather": (
    functools.partial(tc.all_gather, tiled=True),
    functools.partial(lax.all_gather, tiled=True),
    P("y"),
    lambda v: np.concatenate([v, v], axis=1),  # each "y" device holds the whole row
  ),
  "all_gather_invarying": (
    functools.partial(tc.all_gather, tiled=True, to="invarying"),
    functools.partial(lax.all_gather, tiled=True, to="invarying"),
    P(),
    lambda v: v,
  ),
}


def _mesh():
  return jax.make_mesh(
    (2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
  )


def program(collective, out_specs, jitted: bool):
  """The vmapped shard_map, run to completion: eagerly, or under ``jit``."""
  mesh = _mesh()

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("y"), out_specs=out_specs)
  def f(x):
    return collective(x, "y")

  arr = jax.device_put(VALUES, NamedSharding(mesh, P("x", "y")))
  batched = jax.vmap(f)
  return jax.block_until_ready((jax.jit(batched) if jitted else batched)(arr))


def _outcome(fn):
  """("value", result) or ("error", exception)."""
  try:
    return "value", fn()
  except Exception as error:  # noqa: BLE001 (lax's own failure is an outcome to match)
    return "error", error


def _refuses_partial_manual(impl: str) -> bool:
  if impl == "auto":
    return False
  backend = registry.BACKENDS[impl]
  return not backend.lax_reference and not backend.partial_manual


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_vmap_of_shard_map_equals_lax(impl, op, jitted):
  ours_fn, lax_fn, out_specs, reference = OPS[op]
  ours = functools.partial(ours_fn, implementation=impl)
  run = functools.partial(program, out_specs=out_specs, jitted=jitted)
  if _refuses_partial_manual(impl):  # "x" stays Explicit in the body: it says so
    with pytest.raises(ValueError, match="needs every mesh axis manual"):
      harness.run(impl, lambda: run(ours))
    return
  kind, expected = _outcome(lambda: run(lax_fn))
  if impl == "auto" or registry.BACKENDS[impl].lax_reference:
    got_kind, got = _outcome(lambda: harness.run(impl, lambda: run(ours)))
    assert got_kind == kind, got
    if kind == "error":
      assert type(got) is type(expected) and str(got) == str(expected)
      return
  else:
    got = harness.run(impl, lambda: run(ours))
  np.testing.assert_array_equal(np.asarray(got), reference(VALUES))
  assert isinstance(got.sharding, NamedSharding)
  assert got.sharding.spec[0] == "x"  # the batch stays sharded over "x"
  if kind == "value":
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert got.sharding == expected.sharding
