"""A flax.linen BatchNorm whose statistics span a tile of replicas (needs flax).

``BatchNorm`` keeps flax.linen.BatchNorm's fields, parameter names ('scale', 'bias') and
batch_stats ('mean', 'var'), so checkpoints interchange, and adds ``group_size`` and
``implementation`` (see ``torus_collectives.batch_norm``). Training mode runs the fused
op; ``use_running_average`` normalizes with the stored statistics, as flax does. This
module is the only part of the package that imports flax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes

from torus_collectives import groups
from torus_collectives.batch_norm import batch_norm
from torus_collectives.registry import Implementation


class BatchNorm(nn.Module):
  """Drop-in for flax.linen.BatchNorm with grouped cross-replica statistics.

  Attributes beyond flax's: ``group_size`` (None: all replicas of ``axis_name``; int or
  tile shape: see ``torus_collectives.groups``) and ``implementation``. ``axis`` is one
  feature axis; a non-last one is moved last and back (a transpose each way).
  """

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: nn.initializers.Initializer = nn.initializers.zeros
  scale_init: nn.initializers.Initializer = nn.initializers.ones
  axis_name: str | tuple[str, ...] | None = None
  group_size: groups.GroupSize = None
  implementation: Implementation = "auto"

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    use_running_average = nn.merge_param(
      "use_running_average", self.use_running_average, use_running_average
    )
    if not isinstance(self.axis, int):
      raise NotImplementedError(f"BatchNorm normalizes one feature axis; got axis={self.axis}")
    x = jnp.moveaxis(jnp.asarray(x), self.axis, -1)
    features = (x.shape[-1],)
    ra_mean = self.variable("batch_stats", "mean", jnp.zeros, features, jnp.float32)
    ra_var = self.variable("batch_stats", "var", jnp.ones, features, jnp.float32)
    scale = (
      self.param("scale", self.scale_init, features, self.param_dtype)
      if self.use_scale
      else jnp.ones(features, self.param_dtype)
    )
    bias = (
      self.param("bias", self.bias_init, features, self.param_dtype)
      if self.use_bias
      else jnp.zeros(features, self.param_dtype)
    )
    # flax's result dtype; the op computes in float32 and returns its input's dtype.
    out_dtype = dtypes.canonicalize_dtype(
      x, *([scale] if self.use_scale else []), *([bias] if self.use_bias else []), dtype=self.dtype
    )

    if use_running_average:
      mul = jax.lax.rsqrt(ra_var.value + self.epsilon) * scale
      y = (x - ra_mean.value) * mul + bias
    else:
      initializing = self.is_initializing()  # like flax: local statistics at init.
      y, mean, var = batch_norm(
        x.astype(jnp.promote_types(x.dtype, out_dtype)),
        scale,
        bias,
        axis_name=None if initializing else self.axis_name,
        group_size=None if initializing else self.group_size,
        epsilon=self.epsilon,
        implementation=self.implementation,
      )
      if not initializing:
        ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
        ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
    return jnp.moveaxis(jnp.asarray(y, out_dtype), -1, self.axis)
