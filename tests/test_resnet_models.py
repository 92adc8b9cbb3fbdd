"""The ResNet's norm is a field: flax.linen.BatchNorm (the benchmarks' baseline) and
torus_collectives.nn.BatchNorm over the whole mesh make the same variables and outputs."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import models

MESH_SHAPE = (2, 4)


def _tiny(**fields):
  return models.create_model(
    'resnet_tiny', num_classes=5, dtype=jnp.float32, axis_name=('x', 'y'), **fields
  )


def _train_forward(model, variables, images, mesh):
  apply = functools.partial(model.apply, train=True, mutable=['batch_stats'])
  return jax.jit(
    jax.shard_map(
      apply, mesh=mesh, in_specs=(P(), P(mesh.axis_names)), out_specs=(P(mesh.axis_names), P())
    )
  )(variables, images)


def test_flax_batch_norm_as_the_norm_field_matches_the_torus_batch_norm():
  mesh = tc.make_torus_mesh(MESH_SHAPE)
  ours, flax_bn = _tiny(), _tiny(norm=nn.BatchNorm)
  images = jax.random.normal(jax.random.key(0), (16, 16, 16, 3))
  variables = ours.init(jax.random.key(1), images[:1], train=False)
  assert jax.tree.structure(variables) == jax.tree.structure(
    jax.eval_shape(functools.partial(flax_bn.init, train=False), jax.random.key(1), images[:1])
  )
  (logits, stats), (flax_logits, flax_stats) = (
    _train_forward(m, variables, images, mesh) for m in (ours, flax_bn)
  )
  np.testing.assert_allclose(logits, flax_logits, rtol=1e-4, atol=1e-5)
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6), stats, flax_stats
  )
