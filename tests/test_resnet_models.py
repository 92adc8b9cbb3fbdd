"""The ResNet's norm is a field: flax.linen.BatchNorm (the benchmarks' baseline) and
torus_collectives.norm.linen.BatchNorm over the whole mesh make the same variables and outputs."""

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
    "resnet_tiny", num_classes=5, dtype=jnp.float32, axis_name=("x", "y"), **fields
  )


def _train_forward(model, variables, images, mesh):
  apply = functools.partial(model.apply, train=True, mutable=["batch_stats"])
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
  # Both compute each batch statistic in float32 over R <= 16 * 16 * 16 = 4096 rows of
  # unit-scale activations, in different orders and formulas: a mean differs by about
  # sqrt(R) * u = 64 * 6e-8 = 4e-6 of the activations' scale, and the running mean keeps 0.1 of
  # it (atol 5e-7); a running variance is about 1, where rtol 1e-6 is 8 ulps. The logits
  # (|l| < 0.5, ulp 3e-8) inherit those few-ulp differences through 17 norms: atol 1e-6,
  # about 30 ulps of the largest logit. (Measured: 3e-7 on the logits, 2 ulps on the stats.)
  np.testing.assert_allclose(logits, flax_logits, rtol=1e-6, atol=1e-6)
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=5e-7), stats, flax_stats
  )
