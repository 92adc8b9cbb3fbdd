"""The four per-replica passes of batch norm, as plain jnp: the portable ("xla")
implementation, and the reference the Pallas kernels (``torus_collectives.kernels``) are
tested against.

Batch norm over a channels-last activation ``x`` (its M rows: all positions of all
axes but the last) takes two passes over HBM forward and two backward; the group
reduction of the per-channel results happens between them, outside these passes:

1. ``stats``: per-channel mean and M2 = sum((x - mean)**2) of the local rows, float32.
   Never E[x^2] - E[x]^2: here each block of rows is shifted by its first row and the
   blocks are merged with Chan's parallel update, in one XLA pass (XLA fuses it into a
   single reduction like flax's own E[x^2] one), so it stays exact for bfloat16 inputs
   with a mean far larger than their spread.
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


def _shift_block_rows(rows: int, target: int = 4096) -> int:
  """The largest divisor of ``rows`` up to ``target``: the reference's block length."""
  divisors = (c for d in range(1, math.isqrt(rows) + 1) if rows % d == 0 for c in (d, rows // d))
  return max(c for c in divisors if c <= target)


def _rows(x):
  """The channels-last ``x`` as ``x[M, C]``."""
  return x.reshape(-1, x.shape[-1])


def stats_reference(x):
  """``stats`` in one XLA pass: per-block sums shifted by each block's first row."""
  x = _rows(x)
  rows, channels = x.shape
  block = _shift_block_rows(rows)
  xb = x.reshape(rows // block, block, channels).astype(jnp.float32)
  d = xb - xb[:, :1, :]
  s1, s2 = jnp.sum(d, axis=1), jnp.sum(d * d, axis=1)
  block_mean = xb[:, 0, :] + s1 / block
  block_m2 = s2 - s1 * s1 / block
  mean = jnp.mean(block_mean, axis=0)
  m2 = jnp.sum(block_m2, axis=0) + block * jnp.sum((block_mean - mean) ** 2, axis=0)
  return jnp.stack([mean, m2])


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
  xc, g = _centred_cotangent_reference(_rows(x), _rows(dy), coef, relu)
  return jnp.stack([jnp.sum(g, axis=0), jnp.sum(g * xc, axis=0)])


def backward_dx_reference(x, dy, coef, *, relu: bool):
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  return (g * coef[1] + xc * coef[3] + coef[4]).astype(x.dtype)


REFERENCE = Passes(
  stats_reference, normalize_reference, backward_sums_reference, backward_dx_reference
)
