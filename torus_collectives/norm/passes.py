"""The four per-replica passes of batch norm, as plain jnp: the portable ("xla")
implementation, and the reference the Pallas kernels (``torus_collectives.kernels``) are
tested against.

Batch norm over a channels-last activation ``x`` (its M rows: all positions of all
axes but the last) takes two passes over HBM forward and two backward; the group
reduction of the per-channel results happens between them, outside these passes:

1. ``stats``: per-channel mean and M2 = sum((x - mean)**2) of the local rows, float32.
   Never E[x^2] - E[x]^2: here the rows are shifted by the first one before the sums,
   so they stay small for bfloat16 inputs with a mean far larger than their spread. The
   passes reduce over the leading axes and never reshape x: XLA's TPU convolutions lay
   an NHWC activation out with H outermost, and a reshape to rows would copy it. So each
   compiles to the same fusions, and the same compiled bytes, as flax's own BatchNorm.
2. ``normalize``: y = (x - mean) * mul + bias, optionally ReLU'd, with
   mul = scale * rsqrt(var + eps) precomputed per channel.
3. ``backward_sums``: per-channel sum(g) and sum(g * (x - mean)), where g is the output
   cotangent, masked by the ReLU (recomputed from x, so y is never stored).
4. ``backward_dx``: dx = mul * g + k_xc * (x - mean) + k_0, with the per-channel
   coefficients computed from the group-summed results of pass 3.

Per-channel vectors reach the passes stacked as one float32 ``coef[k, C]`` array: rows
(mean, mul, bias) for passes 2 and 3, plus (k_xc, k_0) for pass 4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp


class Passes(NamedTuple):
  """The four per-replica passes of one implementation, and optionally fused versions
  for a group of one replica (nothing to sum between the passes): ``local_forward``
  returns (y, [mean, var]) and ``local_backward`` (dx, pass 3's sums), or None where
  they cannot run (e.g. the activation does not fit on chip)."""

  stats: Callable
  normalize: Callable
  backward_sums: Callable
  backward_dx: Callable
  local_forward: Callable | None = None
  local_backward: Callable | None = None


def _leading_axes(x) -> tuple[int, ...]:
  """The axes reduced per channel: all but the last (never a reshape of ``x``, which
  would copy an activation XLA lays out with the batch axis not outermost)."""
  return tuple(range(x.ndim - 1))


def stats_reference(x):
  """``stats`` in one XLA pass: sums of ``x`` shifted by its first row."""
  axes = _leading_axes(x)
  rows = math.prod(x.shape[:-1])
  # The shift is sliced before the cast, so the cast fuses into the reduction instead of
  # materialising a float32 copy of x.
  shift = x[(0,) * len(axes)].astype(jnp.float32)
  d = x.astype(jnp.float32) - shift
  s1, s2 = jnp.sum(d, axis=axes), jnp.sum(d * d, axis=axes)
  return jnp.stack([shift + s1 / rows, s2 - s1 * s1 / rows])


def _centred_cotangent_reference(x, dy, coef, relu: bool):
  xc = x.astype(jnp.float32) - coef[0]
  g = dy.astype(jnp.float32)
  if relu:
    g = jnp.where(xc * coef[1] + coef[2] > 0, g, 0.0)
  return xc, g


def normalize_reference(x, coef, *, relu: bool):
  y = (x.astype(jnp.float32) - coef[0]) * coef[1] + coef[2]
  return (jnp.maximum(y, 0.0) if relu else y).astype(x.dtype)


def backward_sums_reference(x, dy, coef, *, relu: bool):
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  axes = _leading_axes(x)
  return jnp.stack([jnp.sum(g, axis=axes), jnp.sum(g * xc, axis=axes)])


def backward_dx_reference(x, dy, coef, *, relu: bool):
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  return (g * coef[1] + xc * coef[3] + coef[4]).astype(x.dtype)


REFERENCE = Passes(
  stats_reference, normalize_reference, backward_sums_reference, backward_dx_reference
)
