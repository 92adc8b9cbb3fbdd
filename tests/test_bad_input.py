"""Every bad request fails before any device work, with a message that names the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_cases import mesh_of, per_device

import torus_collectives as tc


def _run(fn, local_shape=(8, 3), dtype=jnp.float32):
  mesh = mesh_of("2x4")
  return per_device(fn, mesh, jnp.zeros((8,) + local_shape, dtype))


@pytest.mark.parametrize("impl", ["xla", "shard_map"])
def test_unknown_axis_name(impl):
  with pytest.raises(ValueError, match="axis 'z' is not bound"):
    _run(lambda x: tc.all_reduce(x, "z", implementation=impl))


def test_called_outside_shard_map():
  with pytest.raises(ValueError, match="inside jax.shard_map"):
    tc.all_reduce(jnp.zeros(4), "x")


def test_more_than_three_axes():
  with pytest.raises(ValueError, match="tuple of up to 3"):
    _run(lambda x: tc.all_reduce(x, ("x", "y", "x", "y")))


def test_repeated_axis():
  with pytest.raises(ValueError, match="names an axis twice"):
    _run(lambda x: tc.all_reduce(x, ("x", "x")))


def test_untiled_size_must_equal_axis_size():
  with pytest.raises(ValueError, match="to equal the axis size 8"):
    _run(lambda x: tc.reduce_scatter(x, ("x", "y")), local_shape=(4, 3))


def test_tiled_size_must_be_a_multiple():
  with pytest.raises(ValueError, match="multiple of 8"):
    _run(lambda x: tc.reduce_scatter(x, ("x", "y"), tiled=True), local_shape=(12, 3))


def test_scatter_dimension_out_of_range():
  with pytest.raises(ValueError, match="scatter_dimension=2 is out of range"):
    _run(lambda x: tc.reduce_scatter(x, ("x", "y"), scatter_dimension=2))


def test_gather_axis_out_of_range():
  with pytest.raises(ValueError, match="axis=3 is out of range"):
    _run(lambda x: tc.all_gather(x, ("x", "y"), axis=3))


def test_unsupported_dtype():
  with pytest.raises(ValueError, match="dtype uint8 is not supported"):
    _run(lambda x: tc.all_reduce(x, "y", implementation="shard_map"), dtype=jnp.uint8)


def test_unknown_implementation():
  with pytest.raises(ValueError, match="unknown implementation='nccl'"):
    _run(lambda x: tc.all_reduce(x, "y", implementation="nccl"))


def test_gradients_must_be_floating_point():
  with pytest.raises(ValueError, match="must be floating point"):
    _run(lambda x: tc.all_reduce_gradients({"steps": x.astype(jnp.int32)}, "y"))


def test_bucket_bytes_must_be_positive():
  with pytest.raises(ValueError, match="bucket_bytes=0 must be positive"):
    _run(lambda x: tc.all_reduce_gradients(x, "y", bucket_bytes=0))


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
