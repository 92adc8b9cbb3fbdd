"""Per-replica batch-norm passes as Pallas TPU kernels, with their plain-jnp reference.

Batch norm over an activation viewed as ``x[M, C]`` (all axes but the channel axis
flattened into rows) takes two passes over HBM forward and two backward; the group
reduction of the per-channel results happens between them, outside these kernels:

1. ``stats``: per-channel mean and M2 = sum((x - mean)**2) of the local rows, float32.
   Each block of rows is centred on its own mean while it sits in VMEM (two passes over
   VMEM, one over HBM), and blocks are merged with Chan's parallel update, so the
   variance never comes from E[x^2] - E[x]^2 and stays exact for bfloat16 inputs with a
   mean far larger than their spread.
2. ``normalize``: y = (x - mean) * mul + bias, optionally ReLU'd, with
   mul = scale * rsqrt(var + eps) precomputed per channel.
3. ``backward_sums``: per-channel sum(g) and sum(g * (x - mean)), where g is the output
   cotangent, masked by the ReLU (recomputed from x, so y is never stored).
4. ``backward_dx``: dx = mul * g + k_xc * (x - mean) + k_0, with the per-channel
   coefficients computed from the group-summed results of pass 3.

Per-channel vectors reach the kernels stacked as one float32 ``coef[k, C]`` array: rows
(mean, mul, bias) for passes 2 and 3, plus (k_xc, k_0) for pass 4.

Layout: the grid runs over (channel blocks, row blocks). Reductions keep the row axis
innermost and "arbitrary", accumulating into an output block resident across it; the
elementwise passes are "parallel" on both axes. A row count that the block does not
divide leaves a ragged last block, whose padding rows are masked out of every sum (their
contents are undefined). Fewer than 128 channels would waste most of each 128-lane vreg,
so when C divides 128 the rows are folded into lanes: x[M, C] is viewed as
x[M * C / 128, 128], lane l holding channel l % C, and the per-lane results are merged
back per channel.

The ``*_reference`` functions are the same four passes in jnp: the "xla" implementation
that runs everywhere. Its statistics use one pass of per-block shifted sums (each block
of rows shifted by its first row), merged with Chan's update, which XLA fuses into a
single reduction like flax's own E[x^2] one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
# Rows of a block are a multiple of this: 8 sublanes of 32 bits, 16 rows of bfloat16.
ROW_ALIGN = 16
# Float32 elements per block: 1 MiB, so a pass's double-buffered inputs, outputs and
# float32 temporaries stay well inside the 16 MiB of scoped VMEM of v4/v5e/v5p.
BLOCK_ELEMENTS = 1 << 18
MAX_BLOCK_CHANNELS = 512


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block shape of every pass: ``block_rows`` x ``block_channels`` of the (folded) x."""

  block_rows: int
  block_channels: int

  def __post_init__(self):
    if self.block_rows < 1 or self.block_channels < 1:
      raise ValueError(f"block sizes must be positive, got {self}")

  @classmethod
  def default(cls, rows: int, channels: int) -> BlockSizes:
    """About ``BLOCK_ELEMENTS`` per block, at most ``MAX_BLOCK_CHANNELS`` lanes wide."""
    block_channels = channels
    if channels > MAX_BLOCK_CHANNELS and channels % LANES == 0:
      block_channels = math.gcd(channels, MAX_BLOCK_CHANNELS)
    block_rows = max(ROW_ALIGN, BLOCK_ELEMENTS // block_channels // ROW_ALIGN * ROW_ALIGN)
    return cls(block_rows=min(block_rows, rows), block_channels=block_channels)

  def check(self, rows: int, channels: int) -> None:
    """Raises ValueError unless these blocks tile an x[rows, channels] legally."""
    if channels % self.block_channels or (
      self.block_channels != channels and self.block_channels % LANES
    ):
      raise ValueError(
        f"block_channels={self.block_channels} must divide {channels=} and be a "
        f"multiple of {LANES} or all of them"
      )
    if self.block_rows != rows and (self.block_rows % ROW_ALIGN or self.block_rows > rows):
      raise ValueError(
        f"block_rows={self.block_rows} must be a multiple of {ROW_ALIGN} no larger "
        f"than {rows=}, or all of them"
      )


# ----------------------------------------------------------------------------- folding


def _fold_factor(rows: int, channels: int) -> int:
  """How many rows share one 128-lane row when channels are fewer than 128."""
  if channels < LANES and LANES % channels == 0 and rows % (LANES // channels) == 0:
    return LANES // channels
  return 1


def _folded(num_rowwise: int) -> Callable:
  """Runs ``fn(*rowwise, [coef], **kw)`` on lane-folded views and unfolds its result.

  The first ``num_rowwise`` arguments are [M, C] activations, reshaped to [M / f, 128];
  a trailing coef[k, C] is tiled to [k, 128]. ``fn`` returns either an activation
  (reshaped back) or per-lane float32 rows [k, 128] that ``merge`` combines per channel.
  """

  def decorator(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*arrays, merge=None, **kwargs):
      rows, channels = arrays[0].shape
      fold = _fold_factor(rows, channels)
      if fold == 1:
        return fn(*arrays, **kwargs)
      rowwise = [a.reshape(rows // fold, LANES) for a in arrays[:num_rowwise]]
      per_channel = [jnp.tile(a, (1, fold)) for a in arrays[num_rowwise:]]
      out = fn(*rowwise, *per_channel, **kwargs)
      if merge is None:
        return out.reshape(rows, channels)
      return merge(out.reshape(out.shape[0], fold, channels), rows // fold)

    return wrapper

  return decorator


def _merge_moments(per_lane, rows_per_lane: int):
  """(mean, M2) of ``fold`` equal-count lane copies -> per channel (Chan's update)."""
  mean_l, m2_l = per_lane[0], per_lane[1]
  mean = jnp.mean(mean_l, axis=0)
  m2 = jnp.sum(m2_l, axis=0) + rows_per_lane * jnp.sum((mean_l - mean) ** 2, axis=0)
  return jnp.stack([mean, m2])


def _merge_sums(per_lane, rows_per_lane: int):
  del rows_per_lane
  return jnp.sum(per_lane, axis=1)


# ----------------------------------------------------------------------------- kernels


def _row_mask(block_rows: int, rows: int):
  """Valid-row mask of the current row block (grid axis 1), or None if all are valid."""
  if rows % block_rows == 0:
    return None
  start = pl.program_id(1) * block_rows
  return start + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0) < rows


def _masked(v, mask):
  return v if mask is None else jnp.where(mask, v, 0.0)


def _relu_masked_cotangent(x, dy, coef_ref, relu: bool):
  """Float32 (x - mean, g): g is dy, zeroed where the fused ReLU clipped the output."""
  xc = x.astype(jnp.float32) - coef_ref[0:1, :]
  g = dy.astype(jnp.float32)
  if relu:
    g = jnp.where(xc * coef_ref[1:2, :] + coef_ref[2:3, :] > 0, g, 0.0)
  return xc, g


def _stats_kernel(x_ref, out_ref, *, rows: int, block_rows: int):
  i = pl.program_id(1)
  mask = _row_mask(block_rows, rows)
  count = jnp.minimum(block_rows, rows - i * block_rows).astype(jnp.float32)
  x = x_ref[...].astype(jnp.float32)
  block_mean = jnp.sum(_masked(x, mask), axis=0, keepdims=True) / count
  block_m2 = jnp.sum(_masked((x - block_mean) ** 2, mask), axis=0, keepdims=True)

  @pl.when(i == 0)
  def _():
    out_ref[0:1, :] = block_mean
    out_ref[1:2, :] = block_m2

  @pl.when(i > 0)
  def _():
    seen = (i * block_rows).astype(jnp.float32)
    total = seen + count
    mean = out_ref[0:1, :]
    delta = block_mean - mean
    out_ref[0:1, :] = mean + delta * (count / total)
    out_ref[1:2, :] = out_ref[1:2, :] + block_m2 + delta * delta * (seen * count / total)


def _normalize_kernel(x_ref, coef_ref, y_ref, *, relu: bool):
  coef = coef_ref[...]
  y = (x_ref[...].astype(jnp.float32) - coef[0:1]) * coef[1:2] + coef[2:3]
  if relu:
    y = jnp.maximum(y, 0.0)
  y_ref[...] = y.astype(y_ref.dtype)


def _backward_sums_kernel(
  x_ref, dy_ref, coef_ref, out_ref, *, rows: int, block_rows: int, relu: bool
):
  mask = _row_mask(block_rows, rows)
  xc, g = _relu_masked_cotangent(x_ref[...], dy_ref[...], coef_ref, relu)
  sum_g = jnp.sum(_masked(g, mask), axis=0, keepdims=True)
  sum_gxc = jnp.sum(_masked(g * xc, mask), axis=0, keepdims=True)

  @pl.when(pl.program_id(1) == 0)
  def _():
    out_ref[...] = jnp.zeros_like(out_ref)

  out_ref[0:1, :] += sum_g
  out_ref[1:2, :] += sum_gxc


def _backward_dx_kernel(x_ref, dy_ref, coef_ref, dx_ref, *, relu: bool):
  xc, g = _relu_masked_cotangent(x_ref[...], dy_ref[...], coef_ref, relu)
  dx = g * coef_ref[1:2, :] + xc * coef_ref[3:4, :] + coef_ref[4:5, :]
  dx_ref[...] = dx.astype(dx_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls


def _specs(rows: int, channels: int, block_sizes: BlockSizes | None, n_coef: int, reduce: bool):
  """Grid, x-block spec and coef spec; reductions put the row axis innermost."""
  bs = block_sizes or BlockSizes.default(rows, channels)
  bs.check(rows, channels)
  bm, bc = bs.block_rows, bs.block_channels
  row_blocks, channel_blocks = pl.cdiv(rows, bm), channels // bc
  if reduce:
    grid = (channel_blocks, row_blocks)
    x_spec = pl.BlockSpec((bm, bc), lambda j, i: (i, j))
    coef_spec = pl.BlockSpec((n_coef, bc), lambda j, i: (0, j))
    semantics = ("parallel", "arbitrary")
  else:
    grid = (row_blocks, channel_blocks)
    x_spec = pl.BlockSpec((bm, bc), lambda i, j: (i, j))
    coef_spec = pl.BlockSpec((n_coef, bc), lambda i, j: (0, j))
    semantics = ("parallel", "parallel")
  params = pltpu.CompilerParams(dimension_semantics=semantics)
  return bs, grid, x_spec, coef_spec, params


def _out_shape(shape, dtype, like):
  """Output type of a pallas_call, varying over the same mesh axes as ``like``."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def _cost(*arrays, outputs, flops_per_element: int):
  """The kernel's HBM traffic (operands plus results) for XLA's cost analysis."""
  nbytes = sum(a.size * a.dtype.itemsize for a in (*arrays, *outputs))
  return pl.CostEstimate(
    flops=flops_per_element * arrays[0].size, transcendentals=0, bytes_accessed=nbytes
  )


def _reduction_out_spec(k: int, bc: int):
  return pl.BlockSpec((k, bc), lambda j, i: (0, j))


@_folded(1)
def _stats_pallas(x, *, block_sizes=None):
  rows, channels = x.shape
  bs, grid, x_spec, _, params = _specs(rows, channels, block_sizes, 0, reduce=True)
  kernel = functools.partial(_stats_kernel, rows=rows, block_rows=bs.block_rows)
  out_shape = _out_shape((2, channels), jnp.float32, x)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[x_spec],
    out_specs=_reduction_out_spec(2, bs.block_channels),
    out_shape=out_shape,
    cost_estimate=_cost(x, outputs=[out_shape], flops_per_element=5),
    compiler_params=params,
    name="bn_stats",
  )(x)


def stats(x, *, block_sizes: BlockSizes | None = None):
  """Per-channel (mean, M2) of x[M, C] as float32 [2, C]."""
  with jax.named_scope("bn_stats"):
    return _stats_pallas(x, merge=_merge_moments, block_sizes=block_sizes)


@_folded(1)
def _normalize_pallas(x, coef, *, relu, block_sizes=None):
  rows, channels = x.shape
  _, grid, x_spec, coef_spec, params = _specs(rows, channels, block_sizes, 3, reduce=False)
  out_shape = _out_shape(x.shape, x.dtype, x)
  return pl.pallas_call(
    functools.partial(_normalize_kernel, relu=relu),
    grid=grid,
    in_specs=[x_spec, coef_spec],
    out_specs=x_spec,
    out_shape=out_shape,
    cost_estimate=_cost(x, coef, outputs=[out_shape], flops_per_element=4),
    compiler_params=params,
    name="bn_normalize",
  )(x, coef)


def normalize(x, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """(x - mean) * mul + bias (then ReLU) with coef rows (mean, mul, bias); x's dtype."""
  with jax.named_scope("bn_normalize"):
    return _normalize_pallas(x, coef, relu=relu, block_sizes=block_sizes)


@_folded(2)
def _backward_sums_pallas(x, dy, coef, *, relu, block_sizes=None):
  rows, channels = x.shape
  bs, grid, x_spec, coef_spec, params = _specs(rows, channels, block_sizes, 3, reduce=True)
  kernel = functools.partial(_backward_sums_kernel, rows=rows, block_rows=bs.block_rows, relu=relu)
  out_shape = _out_shape((2, channels), jnp.float32, x)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[x_spec, x_spec, coef_spec],
    out_specs=_reduction_out_spec(2, bs.block_channels),
    out_shape=out_shape,
    cost_estimate=_cost(x, dy, coef, outputs=[out_shape], flops_per_element=7),
    compiler_params=params,
    name="bn_backward_sums",
  )(x, dy, coef)


def backward_sums(x, dy, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """Per-channel (sum g, sum g * (x - mean)) as float32 [2, C]; coef as in normalize."""
  with jax.named_scope("bn_backward_sums"):
    return _backward_sums_pallas(x, dy, coef, merge=_merge_sums, relu=relu, block_sizes=block_sizes)


@_folded(2)
def _backward_dx_pallas(x, dy, coef, *, relu, block_sizes=None):
  rows, channels = x.shape
  _, grid, x_spec, coef_spec, params = _specs(rows, channels, block_sizes, 5, reduce=False)
  out_shape = _out_shape(x.shape, x.dtype, x)
  return pl.pallas_call(
    functools.partial(_backward_dx_kernel, relu=relu),
    grid=grid,
    in_specs=[x_spec, x_spec, coef_spec],
    out_specs=x_spec,
    out_shape=out_shape,
    cost_estimate=_cost(x, dy, coef, outputs=[out_shape], flops_per_element=9),
    compiler_params=params,
    name="bn_backward_dx",
  )(x, dy, coef)


def backward_dx(x, dy, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """mul * g + k_xc * (x - mean) + k_0, coef rows (mean, mul, bias, k_xc, k_0)."""
  with jax.named_scope("bn_backward_dx"):
    return _backward_dx_pallas(x, dy, coef, relu=relu, block_sizes=block_sizes)


# ----------------------------------------------------------------------------- reference


def _shift_block_rows(rows: int, target: int = 4096) -> int:
  """The largest divisor of ``rows`` up to ``target``: the reference's block length."""
  divisors = (c for d in range(1, math.isqrt(rows) + 1) if rows % d == 0 for c in (d, rows // d))
  return max(c for c in divisors if c <= target)


def stats_reference(x):
  """``stats`` in one XLA pass: per-block sums shifted by each block's first row."""
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
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  return jnp.stack([jnp.sum(g, axis=0), jnp.sum(g * xc, axis=0)])


def backward_dx_reference(x, dy, coef, *, relu: bool):
  xc, g = _centred_cotangent_reference(x, dy, coef, relu)
  return (g * coef[1] + xc * coef[3] + coef[4]).astype(x.dtype)


class Passes(NamedTuple):
  """The four per-replica passes of one implementation."""

  stats: Callable
  normalize: Callable
  backward_sums: Callable
  backward_dx: Callable


PALLAS = Passes(stats, normalize, backward_sums, backward_dx)
REFERENCE = Passes(
  stats_reference, normalize_reference, backward_sums_reference, backward_dx_reference
)
