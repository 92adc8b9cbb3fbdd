"""What "auto" promises about values, and keeps.

* Where no table entry applies, "auto" is lax: the same program, bitwise the same result.
* Where a table picks a torus implementation, its result is lax's within
  ``registry.auto_rounding_bound`` (bitwise for all-gathers and integers).
* ``tc.bitwise_as_lax()`` / ``TORUS_COLLECTIVES_BITWISE=1`` keep floating dtypes on lax.

The inputs are normally distributed, not small integers: rounding must happen for the
bound to be tested. Tables here are written by hand (no timing).
"""

import os
import subprocess
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import sharded
from jax import lax

import torus_collectives as tc
from torus_collectives import registry
from torus_collectives.tuning import tables

MiB = 2**20
AXES = ("x", "y")
P = 8  # devices of the 2x4 mesh
BUCKET = tables.size_bucket(MiB)  # the tables' one size: 1 MiB and up
OPS = {  # tc op -> the op a table is keyed by
  "psum": "all_reduce",
  "pmean": "all_reduce",
  "psum_scatter": "reduce_scatter",
  "all_gather": "all_gather",
}


pytestmark = pytest.mark.usefixtures("isolated_tables")  # tests/conftest.py


def _use(choice: str, dtypes=("float32", "bfloat16", "int32")) -> None:
  """A table whose every (op, dtype) of 1 MiB and up on 2x4 runs ``choice``."""
  entries = [
    harness.measured_entry("2x4", op, dtype, BUCKET, choice)
    for op in sorted(set(OPS.values()))
    for dtype in dtypes
  ]
  tables.use_table(tables.Table("cpu", "hand-written", tables.now(), entries))


def _body(op: str, ops):
  f = getattr(ops, op)
  if op == "psum_scatter":
    return lambda v: f(v, AXES, tiled=True)
  if op == "all_gather":
    return lambda v: f(v, AXES, tiled=True)
  return lambda v: f(v, AXES)


def _inputs(op: str, dtype, seed=0) -> np.ndarray:
  """(devices, n) normal values: a full buffer of 1 MiB per device (gathered: 1 MiB)."""
  n = MiB // jnp.dtype(dtype).itemsize
  if op == "all_gather":
    n //= P
  rng = np.random.default_rng(seed)
  if jnp.issubdtype(dtype, jnp.integer):
    return rng.integers(-(2**20), 2**20, (P, n)).astype(dtype)
  return rng.normal(size=(P, n)).astype(dtype)


def _tc(op, x):
  return sharded(_body(op, tc), harness.mesh((2, 4)))(x)


def _lax(op, x):
  return sharded(_body(op, lax), harness.mesh((2, 4)))(x)


def _jaxpr(op, ops, x) -> str:
  return str(jax.make_jaxpr(sharded(_body(op, ops), harness.mesh((2, 4))))(x))


def _bitwise(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_where_no_entry_applies_auto_is_lax_bitwise(op, dtype):
  _use("lax_torus", dtypes=("float16",))  # a table, but nothing in it for this dtype
  x = _inputs(op, dtype)
  assert _jaxpr(op, tc, x) == _jaxpr(op, lax, x)
  assert _bitwise(_tc(op, x), _lax(op, x))
  tables.use_table(None)  # no table at all
  assert _bitwise(_tc(op, x), _lax(op, x))


@pytest.mark.parametrize("choice", ["lax_torus", "shard_map"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_measured_torus_choice_is_lax_within_the_stated_bound(op, dtype, choice):
  _use(choice)
  x = _inputs(op, dtype)
  assert _jaxpr(op, tc, x) != _jaxpr(op, lax, x)  # the torus implementation runs
  ours, theirs = np.asarray(_tc(op, x)), np.asarray(_lax(op, x))
  assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
  if op == "all_gather":
    assert _bitwise(ours, theirs)
    return
  # Per element, the sum over devices of |x_i| (psum_scatter: the device's own chunk).
  magnitude = np.abs(x.astype(np.float64)).sum(axis=0)
  if op == "psum_scatter":
    ours, theirs = ours.reshape(-1), theirs.reshape(-1)
  else:
    magnitude = np.broadcast_to(magnitude, ours.shape)
  error = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
  bound = registry.auto_rounding_bound(op, dtype, P) * magnitude
  assert np.all(error <= bound), float(np.max(error / bound))


@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_integers_on_a_measured_torus_choice_are_bitwise(op):
  _use("lax_torus")
  x = _inputs(op, jnp.int32)
  assert _jaxpr(op, tc, x) != _jaxpr(op, lax, x)
  assert _bitwise(_tc(op, x), _lax(op, x))


def test_the_bound():
  u = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8}
  for dtype in (jnp.float32, jnp.bfloat16):
    c = registry.auto_rounding_bound("psum", dtype, P)
    assert (P - 1) * 2 * u[dtype] < c < 1.05 * (P - 1) * 2 * u[dtype]  # ~ (p-1) eps
    assert registry.auto_rounding_bound("pmean", dtype, P) > c / P
  assert registry.auto_rounding_bound("all_gather", jnp.float32, P) == 0.0
  assert registry.auto_rounding_bound("psum", jnp.int32, P) == 0.0


# The switch.


def test_bitwise_switch_keeps_floats_on_lax_and_retraces():
  _use("lax_torus")
  x = _inputs("psum", jnp.bfloat16)
  f = sharded(_body("psum", tc), harness.mesh((2, 4)))
  reference = _lax("psum", x)
  assert not _bitwise(f(x), reference)  # bf16 sums in another order: other roundings
  with tc.bitwise_as_lax():
    assert registry.bitwise_requested()
    assert _bitwise(f(x), reference)  # the same jitted function, traced again
    assert _jaxpr("psum", tc, x) == _jaxpr("psum", lax, x)
    for op in OPS:  # every op, floats
      y = _inputs(op, jnp.float32)
      assert _jaxpr(op, tc, y) == _jaxpr(op, lax, y)
    ints = _inputs("psum", jnp.int32)  # integers keep their measured choice: exact anyway
    assert _jaxpr("psum", tc, ints) != _jaxpr("psum", lax, ints)
  assert not registry.bitwise_requested()
  assert not _bitwise(f(x), reference)


def test_bitwise_switch_covers_a_tree_of_floats_and_integers():
  _use("lax_torus")
  tree = (_inputs("psum", jnp.int32), _inputs("psum", jnp.float32))
  mesh = harness.mesh((2, 4))

  def jaxpr(ops):
    return str(jax.make_jaxpr(sharded(lambda t: ops.psum(t, AXES), mesh))(tree))

  assert jaxpr(tc) != jaxpr(lax)
  with tc.bitwise_as_lax():
    assert jaxpr(tc) == jaxpr(lax)


def test_bitwise_switch_for_gradients():
  _use("lax_torus")
  entry = harness.measured_entry("2x4", "all_reduce_gradients", "float32", BUCKET, "lax_torus")
  tables.use_table(tables.Table("cpu", "hand-written", tables.now(), [entry]))
  x = _inputs("psum", jnp.float32)
  mesh = harness.mesh((2, 4))

  def jaxpr(fn):
    return str(jax.make_jaxpr(sharded(fn, mesh))(x))

  ours = lambda v: tc.all_reduce_gradients(v, AXES)
  assert jaxpr(ours) != jaxpr(lambda v: lax.pmean(v, AXES))
  with tc.bitwise_as_lax():
    assert jaxpr(ours) == jaxpr(lambda v: lax.pmean(v, AXES))


@pytest.mark.parametrize("value,expected", [("1", "True"), ("0", "False"), (None, "False")])
def test_bitwise_switch_from_the_environment(value, expected):
  env = {k: v for k, v in os.environ.items() if k != registry.BITWISE_ENV_VAR}
  if value is not None:
    env[registry.BITWISE_ENV_VAR] = value
  code = "from torus_collectives import registry; print(registry.bitwise_requested())"
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == expected
