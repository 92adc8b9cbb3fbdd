"""What the batch-norm tests share: their activations and the size-scaled tolerance."""

import math

import jax
import jax.numpy as jnp
import numpy as np

REPLICAS = 8
C = 16


def inputs(dtype, batch=2 * REPLICAS, hw=4, offset=0.0, seed=0):
  """(x, weights of the loss, scale, bias): x of ``batch`` NHWC images, spread 2."""
  kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
  x = (offset + 2.0 * jax.random.normal(kx, (batch, hw, hw, C))).astype(dtype)
  weights = jax.random.normal(kw, (hw, hw, C), jnp.float32)  # makes the loss non-trivial
  scale = 1.0 + 0.1 * jax.random.normal(ks, (C,))
  bias = jnp.linspace(-0.5, 0.5, C)
  return x, weights, scale, bias


def assert_close(actual, expected, dtype, count):
  """Max error relative to the largest |expected|, within a size-scaled bound.

  Two roundings of the result (``dtype``) plus float32 sums of ``count`` terms on each
  side, whose error grows like sqrt(count).
  """
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  tol = 2 * float(jnp.finfo(dtype).eps) + 4 * float(jnp.finfo(jnp.float32).eps) * math.sqrt(count)
  err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def loss(y, weights):
  return jnp.sum(y.astype(jnp.float32) ** 2 * weights)
