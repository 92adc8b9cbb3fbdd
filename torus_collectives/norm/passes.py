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

Per-channel vectors travel between the passes stacked as small float32 ``[k, C]`` arrays,
one row per quantity; the rows are named by the constants below, each with one meaning:
``coef`` holds (mean, mul, bias) for passes 2 and 3, plus (k_xc, k_0) for pass 4; pass 1
returns (mean, M2) and pass 3 (sum g, sum g * (x - mean)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

# ``stats``' result, [STATS_ROWS, C]: the local mean and M2.
STATS_MEAN, STATS_M2 = 0, 1
STATS_ROWS = 2
# ``backward_sums``' result (and ``local_backward``'s second), [SUMS_ROWS, C]: sum(g) and
# sum(g * (x - mean)).
SUM_G, SUM_G_XC = 0, 1
SUMS_ROWS = 2
# ``coef``: (mean, mul, bias), the FORWARD_COEF_ROWS of ``normalize`` and ``backward_sums``;
# ``backward_dx`` takes BACKWARD_COEF_ROWS, the per-channel coefficients of
# dx = mul * g + k_xc * (x - mean) + k_0 after them.
COEF_MEAN, COEF_MUL, COEF_BIAS, COEF_K_XC, COEF_K_0 = range(5)
FORWARD_COEF_ROWS, BACKWARD_COEF_ROWS = 3, 5
# ``local_backward``'s coef (BACKWARD_COEF_ROWS too): the forward rows, then the factors
# of the sums it computes itself, k_xc = a * sum(g * (x - mean)) and k_0 = b * sum(g).
COEF_A, COEF_B = 3, 4
# ``local_forward``'s statistics, [STATS_ROWS, C]: the mean and the biased variance.
LOCAL_MEAN, LOCAL_VAR = 0, 1
# The affine parameters the fused ``local_forward`` kernel takes, [AFFINE_ROWS, C].
AFFINE_SCALE, AFFINE_BIAS = 0, 1
AFFINE_ROWS = 2


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
  return jnp.stack([shift + s1 / rows, s2 - s1 * s1 / rows])  # STATS_MEAN, STATS_M2


def _centred_cotangent_reference(x, dy, coef, relu: bool):
  xc = x.astype(jnp.float32) - coef[COEF_MEAN]
  g = dy.astype(jnp.float32)
  if relu:
    g = jnp.where(xc * coef[COEF_MUL] + coef[COEF_BIAS] > 0, g, 0.0)
  return xc, g


def normalize_reference(x, coef, *, relu: bool):
  y = (x.astype(jnp.float32) - coef[COEF_MEAN]) * coef[COEF_MUL] + coef[COEF_BIAS]
  return (jnp.maximum(y, 0.0) if relu else y).astype(x.dtype)


def backward_sums_reference(x, dy, coef, *, relu: bool):
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  axes = _leading_axes(x)
  return jnp.stack([jnp.sum(g, axis=axes), jnp.sum(g * xc, axis=axes)])  # SUM_G, SUM_G_XC


def backward_dx_reference(x, dy, coef, *, relu: bool):
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  return (g * coef[COEF_MUL] + xc * coef[COEF_K_XC] + coef[COEF_K_0]).astype(x.dtype)


REFERENCE = Passes(
  stats_reference, normalize_reference, backward_sums_reference, backward_dx_reference
)
