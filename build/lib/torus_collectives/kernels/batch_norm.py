"""The per-replica batch-norm passes of ``torus_collectives.batch_norm_passes`` as Pallas
TPU kernels (same contracts, same ``coef`` layout).

``stats`` centres each block of rows on its own mean while it sits in VMEM (two passes
over VMEM, one over HBM) and merges blocks with Chan's parallel update.

Layout: the grid runs over (channel blocks, row blocks). Reductions keep the row axis
innermost and "arbitrary", accumulating into an output block resident across it; the
elementwise passes are "parallel" on both axes. A row count that the block does not
divide leaves a ragged last block, whose padding rows are masked out of every sum (their
contents are undefined). Fewer than 128 channels would waste most of each 128-lane vreg,
so when C divides 128 the rows are folded into lanes: x[M, C] is viewed as
x[M * C / 128, 128], lane l holding channel l % C, and the per-lane results are merged
back per channel.

Each ``pallas_call`` declares its HBM traffic (operands plus results) in a
``pl.CostEstimate``, since XLA cannot see inside a Mosaic kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives._vma import varying_like
from torus_collectives.batch_norm_passes import Passes
from torus_collectives.configs import LANES, BlockSizes

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


def _traffic_cost(*arrays, outputs, flops_per_element: int):
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
  out_shape = varying_like(x, (2, channels), jnp.float32)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[x_spec],
    out_specs=_reduction_out_spec(2, bs.block_channels),
    out_shape=out_shape,
    cost_estimate=_traffic_cost(x, outputs=[out_shape], flops_per_element=5),
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
  out_shape = varying_like(x, x.shape)
  return pl.pallas_call(
    functools.partial(_normalize_kernel, relu=relu),
    grid=grid,
    in_specs=[x_spec, coef_spec],
    out_specs=x_spec,
    out_shape=out_shape,
    cost_estimate=_traffic_cost(x, coef, outputs=[out_shape], flops_per_element=4),
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
  out_shape = varying_like(x, (2, channels), jnp.float32)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[x_spec, x_spec, coef_spec],
    out_specs=_reduction_out_spec(2, bs.block_channels),
    out_shape=out_shape,
    cost_estimate=_traffic_cost(x, dy, coef, outputs=[out_shape], flops_per_element=7),
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
  out_shape = varying_like(x, x.shape)
  return pl.pallas_call(
    functools.partial(_backward_dx_kernel, relu=relu),
    grid=grid,
    in_specs=[x_spec, x_spec, coef_spec],
    out_specs=x_spec,
    out_shape=out_shape,
    cost_estimate=_traffic_cost(x, dy, coef, outputs=[out_shape], flops_per_element=9),
    compiler_params=params,
    name="bn_backward_dx",
  )(x, dy, coef)


def backward_dx(x, dy, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """mul * g + k_xc * (x - mean) + k_0, coef rows (mean, mul, bias, k_xc, k_0)."""
  with jax.named_scope("bn_backward_dx"):
    return _backward_dx_pallas(x, dy, coef, relu=relu, block_sizes=block_sizes)


PALLAS = Passes(stats, normalize, backward_sums, backward_dx)
