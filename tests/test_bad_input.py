"""Every bad request fails before any device work, with a message that names the fix."""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import per_device

import torus_collectives as tc


def _run(fn, local_shape=(8, 3), dtype=jnp.float32):
  mesh = harness.mesh((2, 4))
  return per_device(fn, mesh, jnp.zeros((8,) + local_shape, dtype))


# "auto" and "xla" raise what lax raises (tests/test_conformance_collectives.py); these are
# the torus implementations' own checks.
TORUS = "shard_map"


def test_unknown_axis_name():
  with pytest.raises(NameError, match="unbound axis name: z"):
    _run(lambda x: tc.all_reduce(x, "z", implementation=TORUS))


def test_called_outside_shard_map():
  with pytest.raises(NameError, match="unbound axis name: x"):
    tc.all_reduce(jnp.zeros(4), "x", implementation=TORUS)


def test_repeated_axis():
  with pytest.raises(ValueError, match="names an axis twice"):
    _run(lambda x: tc.all_reduce(x, ("x", "x"), implementation=TORUS))


def test_untiled_size_must_equal_axis_size():
  with pytest.raises(ValueError, match="to equal the group size 8"):
    _run(lambda x: tc.reduce_scatter(x, ("x", "y"), implementation=TORUS), local_shape=(4, 3))


def test_tiled_size_must_be_a_multiple():
  with pytest.raises(ValueError, match="multiple of 8"):
    _run(
      lambda x: tc.reduce_scatter(x, ("x", "y"), tiled=True, implementation=TORUS),
      local_shape=(12, 3),
    )


def test_scatter_dimension_out_of_range():
  with pytest.raises(ValueError, match="scatter_dimension=2 is out of range"):
    _run(lambda x: tc.reduce_scatter(x, ("x", "y"), scatter_dimension=2, implementation=TORUS))


def test_scatter_dimension_must_be_an_int():
  with pytest.raises(TypeError, match="scatter_dimension must be an int"):
    _run(lambda x: tc.psum_scatter(x, "y", scatter_dimension=1.0, implementation=TORUS))


def test_gather_axis_out_of_range():
  with pytest.raises(ValueError, match="axis=3 is out of range"):
    _run(lambda x: tc.all_gather(x, ("x", "y"), axis=3, implementation=TORUS))


def test_unsupported_dtype():
  """Checked from the registry's table before any platform check or device work."""
  with pytest.raises(ValueError, match='dtype uint8 is not supported.*"auto"'):
    _run(lambda x: tc.all_reduce(x, "y", implementation="pallas"), dtype=jnp.uint8)


def test_unknown_implementation():
  with pytest.raises(ValueError, match="unknown implementation='nccl'"):
    _run(lambda x: tc.all_reduce(x, "y", implementation="nccl"))


def test_gradients_must_be_floating_point():
  with pytest.raises(ValueError, match="must be floating point"):
    _run(lambda x: tc.all_reduce_gradients({"steps": x.astype(jnp.int32)}, "y"))


@pytest.mark.parametrize("bucket_bytes", [0, float("nan"), float("inf")])
def test_bucket_bytes_must_be_positive_and_finite(bucket_bytes):
  with pytest.raises(ValueError, match="must be a positive, finite number of bytes"):
    _run(lambda x: tc.all_reduce_gradients(x, "y", bucket_bytes=bucket_bytes))


def test_torus_mesh_needs_matching_device_count():
  with pytest.raises(ValueError, match="needs 6 devices but 8"):
    tc.make_torus_mesh((2, 3))


def test_torus_mesh_rank():
  with pytest.raises(ValueError, match="1 to 3 axes"):
    tc.make_torus_mesh((2, 2, 2, 1), axis_names=("a", "b", "c", "d"))


def test_torus_mesh_is_auto_typed():
  mesh = tc.make_torus_mesh((2, 4))
  assert mesh.axis_names == ("x", "y") and dict(mesh.shape) == {"x": 2, "y": 4}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  np.testing.assert_array_equal(
    np.vectorize(lambda d: d.id)(mesh.devices), np.arange(8).reshape(2, 4)
  )


def test_torus_mesh_shape_must_be_positive():
  with pytest.raises(ValueError, match="at least one device"):
    tc.make_torus_mesh((-2, -4))


@pytest.mark.parametrize("group_size", [2.0, True, (1, 2.0)])
def test_group_size_must_be_ints(group_size):
  with pytest.raises(TypeError, match="group_size must be None, an int"):
    tc.resolve_tile(group_size, (2, 4))


def test_batch_norm_of_an_empty_batch():
  with pytest.raises(ValueError, match="at least one row"):
    tc.batch_norm(jnp.ones((0, 3)), jnp.ones(3), jnp.zeros(3))
