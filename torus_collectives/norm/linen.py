"""A flax.linen BatchNorm whose statistics span a tile of replicas (needs flax).

``BatchNorm`` has every field of ``flax.linen.BatchNorm`` (``axis_index_groups``,
``use_fast_variance`` and ``force_float32_reductions`` included) and its ``mask=`` call
argument, the same parameter names ('scale', 'bias') and batch_stats ('mean', 'var'), so
checkpoints interchange; it adds ``group_size`` and ``implementation`` (see
``torus_collectives.norm.batch_norm``).

Two paths, chosen per call:

* the fused op (``tc.batch_norm``) when it computes what flax asks for: no ``mask``,
  float32 reductions, one feature axis, and replica groups that are aligned tiles of the
  mesh (``group_size``, or ``axis_index_groups`` that are such tiles). Its variance comes
  from one pass over x in HBM (on the XLA path, sums shifted by x's first row; in the
  Pallas kernels, each block centred on its own mean), the replicas' results combined
  with non-negative terms (``torus_collectives.norm.batch_norm``), whatever
  ``use_fast_variance`` says: one pass, like flax's fast variance, yet accurate when the
  mean is large next to the spread (given a first row of typical values); results agree
  with flax's within rounding.
* otherwise flax's own statistics, with the cross-replica means taken by ``tc.pmean``.

``use_running_average`` normalizes with the stored statistics, as flax does. This module is
the only part of the package that imports flax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes
from jax import lax

from torus_collectives import axes, groups
from torus_collectives.collectives import pmean
from torus_collectives.norm.batch_norm import batch_norm
from torus_collectives.registry import Implementation


def _feature_axes(axis, ndim: int) -> tuple[int, ...]:
  axes = axis if isinstance(axis, Sequence) else (axis,)
  return tuple(sorted({a % ndim for a in axes}))


def _abs_sq(x):
  return lax.square(lax.real(x)) + lax.square(lax.imag(x)) if jnp.iscomplexobj(x) else lax.square(x)


class BatchNorm(nn.Module):
  """Drop-in for flax.linen.BatchNorm with grouped cross-replica statistics.

  Attributes beyond flax's: ``group_size`` (None: all replicas of ``axis_name``; int or
  tile shape: see ``torus_collectives.groups``; exclusive with ``axis_index_groups``) and
  ``implementation``.
  """

  use_running_average: bool | None = None
  axis: int | Sequence[int] = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: nn.initializers.Initializer = nn.initializers.zeros
  scale_init: nn.initializers.Initializer = nn.initializers.ones
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True
  group_size: groups.GroupSize = None
  implementation: Implementation = "auto"

  def _group_tile(self):
    """The group as a tile shape for the fused op, or None if it is not one."""
    if self.axis_index_groups is None:
      return self.group_size
    if self.group_size is not None:
      raise ValueError("give group_size or axis_index_groups, not both")
    sizes = tuple(lax.axis_size(a) for a in axes.names(self.axis_name))
    return groups.tile_of_groups(self.axis_index_groups, sizes, ordered=False)

  def _flax_statistics(self, x, reduction_axes, mask, axis_name):
    """Mean and variance as flax computes them, averaged across replicas by tc.pmean."""
    dtype = jnp.result_type(x) if self.dtype is None else self.dtype
    if self.force_float32_reductions:
      dtype = jnp.promote_types(dtype, jnp.float32)
    x = jnp.asarray(x, dtype)
    where = None if mask is None else jnp.asarray(mask, bool)
    collective = "xla" if self.implementation == "xla" else "auto"

    def means(*values):
      local = jnp.stack([v.mean(reduction_axes, where=where) for v in values])
      if axis_name is None:
        return local
      return pmean(
        local, axis_name, axis_index_groups=self.axis_index_groups, implementation=collective
      )

    if self.use_fast_variance:
      mean, mean_sq = means(x, _abs_sq(x))
      return mean, jnp.maximum(0.0, mean_sq - _abs_sq(mean))
    mean = means(x)[0]
    return mean, means(_abs_sq(x - jnp.expand_dims(mean, reduction_axes)))[0]

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_running_average = nn.merge_param(
      "use_running_average", self.use_running_average, use_running_average
    )
    x = jnp.asarray(x)
    feature_axes = _feature_axes(self.axis, x.ndim)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    features = tuple(x.shape[a] for a in feature_axes)
    stats_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
    ra_mean = self.variable("batch_stats", "mean", jnp.zeros, features, stats_dtype)
    ra_var = self.variable("batch_stats", "var", jnp.ones, features, stats_dtype)
    params = []
    for name, use, init in (
      ("scale", self.use_scale, self.scale_init),
      ("bias", self.use_bias, self.bias_init),
    ):
      params.append(self.param(name, init, features, self.param_dtype) if use else None)
    scale, bias = params
    # flax's result dtype, from the input and the parameters in use.
    out_dtype = dtypes.canonicalize_dtype(
      x, *(p for p in params if p is not None), dtype=self.dtype
    )

    initializing = self.is_initializing()  # like flax: local statistics at init.
    axis_name = None if initializing else self.axis_name
    tile = None if axis_name is None else self._group_tile()
    fused = (
      not use_running_average
      and mask is None
      and self.force_float32_reductions
      and len(feature_axes) == 1
      and jnp.issubdtype(x.dtype, jnp.floating)
      and (self.axis_index_groups is None or tile is not None or axis_name is None)
    )
    if fused:
      moved = jnp.moveaxis(x, feature_axes[0], -1)
      y, mean, var = batch_norm(
        moved.astype(jnp.promote_types(x.dtype, out_dtype)),
        jnp.ones(features, self.param_dtype) if scale is None else scale,
        jnp.zeros(features, self.param_dtype) if bias is None else bias,
        axis_name=axis_name,
        group_size=tile,
        epsilon=self.epsilon,
        implementation=self.implementation,
      )
      y = jnp.moveaxis(y, -1, feature_axes[0])
    else:
      if use_running_average:
        mean, var = ra_mean.value, ra_var.value
        if not self.force_float32_reductions:
          mean, var = jnp.asarray(mean, self.param_dtype), jnp.asarray(var, self.param_dtype)
      else:
        mean, var = self._flax_statistics(x, reduction_axes, mask, axis_name)
      shape = [1] * x.ndim
      for a in feature_axes:
        shape[a] = x.shape[a]
      mul = lax.rsqrt(jnp.expand_dims(var, reduction_axes) + self.epsilon)
      cast = (
        (lambda p: p) if self.force_float32_reductions else (lambda p: p.astype(self.param_dtype))
      )
      if scale is not None:
        mul = mul * cast(scale.reshape(shape))
      y = (x - jnp.expand_dims(mean, reduction_axes)) * mul
      if bias is not None:
        y = y + cast(bias.reshape(shape))
    if not use_running_average and not initializing:
      ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
      ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
    return jnp.asarray(y, out_dtype)
