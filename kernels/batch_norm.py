"""The per-replica batch-norm passes of ``torus_collectives.norm.passes`` as Pallas
TPU kernels that read and write the activation in XLA's TPU layout as it lies in HBM.

Same contracts and ``coef`` layout as the jnp passes. A Pallas TPU operand is row-major,
while XLA's TPU convolutions lay an NHWC activation out as H, W, N, C (major to minor).
Each pass therefore runs on ``tiling.bn_view``, the 3-D ``[R, S, C]`` view whose
row-major order is that physical order (``[H*W, N, C]``): the transpose into it and back
compiles to bitcasts, not copies, for NHWC with a batch in whole tiles of 8. Channels
are on lanes and S on sublanes; blocks ``(block_rows, S, block_channels)`` run over R.
Lanes beyond C < 128 are XLA's own tile padding, which the kernels never read into sums.

``stats`` centres each block on its own mean while it sits in VMEM (two passes over VMEM,
one over HBM) and merges blocks with Chan's parallel update.

Grid: (channel blocks, row blocks) for the reductions, the row axis innermost and
"arbitrary", accumulating into an output block resident across it; (row blocks, channel
blocks), both "parallel", for the elementwise passes. A row count that the block does not
divide leaves a ragged last block, whose padding rows are masked out of every sum (their
contents are undefined) and never written back.

HBM traffic, X being one activation's bytes: stats reads X, normalize reads X and writes
X, backward_sums reads 2X, backward_dx reads 2X and writes X: 3X forward, 8X forward
plus backward. For a group of one replica, ``local_forward`` and ``local_backward`` run
both passes of each direction in one kernel with the channel block of x (and dy) held in
VMEM between them, where that fits half the generation's VMEM: 2X forward, 5X in all.
The operands are pinned to HBM (XLA would otherwise also prefetch them into VMEM). Each
``pallas_call`` declares exactly that (operands plus results, in whole (8, 128) tiles as
they lie in HBM) in a ``pl.CostEstimate``, since XLA cannot see inside a Mosaic kernel;
the elementwise passes add their per-channel coefficients once per row block when there
are several channel blocks, since the pipeline then re-reads them at every step. The
declarations are checked against the bytes the pipeline moves, counted in TPU interpret
mode (``tests/test_kernel_accounting.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import target
from torus_collectives._vma import varying_like
from torus_collectives.kernel_config import scoped_vmem_bytes, vmem_bytes
from torus_collectives.norm.block_sizes import BlockSizes
from torus_collectives.norm.passes import (
  AFFINE_BIAS,
  AFFINE_ROWS,
  AFFINE_SCALE,
  BACKWARD_COEF_ROWS,
  COEF_A,
  COEF_B,
  COEF_BIAS,
  COEF_K_0,
  COEF_K_XC,
  COEF_MEAN,
  COEF_MUL,
  FORWARD_COEF_ROWS,
  LOCAL_MEAN,
  LOCAL_VAR,
  STATS_M2,
  STATS_MEAN,
  STATS_ROWS,
  SUM_G,
  SUM_G_XC,
  SUMS_ROWS,
  Passes,
)
from torus_collectives.tiling import LANES, SUBLANES, ceil_div, from_bn_view, to_bn_view

# ----------------------------------------------------------------------------- kernels


def _row_mask(block_rows: int, rows: int, axis: int = 1):
  """Valid-row mask of the current row block (grid ``axis``), or None if all are valid."""
  if rows % block_rows == 0:
    return None
  start = pl.program_id(axis) * block_rows
  return start + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1, 1), 0) < rows


def _masked(v, mask):
  return v if mask is None else jnp.where(mask, v, 0.0)


def _sum_rows(v):
  """(rows, sublanes, channels) -> (1, channels): rows add vreg-wise, then sublanes."""
  return jnp.sum(jnp.sum(v, axis=0), axis=0, keepdims=True)


def _row(k: int) -> slice:
  """Row ``k`` of a per-channel ``[k, C]`` array (its rows: ``norm.passes``'s constants),
  kept two-dimensional."""
  return slice(k, k + 1)


def _coef(coef_ref, k: int):
  """Row ``k`` of the per-channel coefficients, shaped to broadcast over a block."""
  return coef_ref[_row(k), :][None]


def _relu_masked_cotangent(x, dy, coef_ref, relu: bool):
  """Float32 (x - mean, g): g is dy, zeroed where the fused ReLU clipped the output."""
  xc = x.astype(jnp.float32) - _coef(coef_ref, COEF_MEAN)
  g = dy.astype(jnp.float32)
  if relu:
    g = jnp.where(xc * _coef(coef_ref, COEF_MUL) + _coef(coef_ref, COEF_BIAS) > 0, g, 0.0)
  return xc, g


def _stats_kernel(x_ref, out_ref, *, rows: int, block_rows: int):
  _accumulate_moments(x_ref[...], out_ref, 1, rows=rows, block_rows=block_rows)


def _accumulate_moments(x, out_ref, axis: int, *, rows: int, block_rows: int):
  """Merges the (mean, M2) of row block ``program_id(axis)`` of x into out_ref's rows
  STATS_MEAN and STATS_M2."""
  i = pl.program_id(axis)
  sublanes = x.shape[1]
  mask = _row_mask(block_rows, rows, axis)
  count = (jnp.minimum(block_rows, rows - i * block_rows) * sublanes).astype(jnp.float32)
  x = x.astype(jnp.float32)
  block_mean = _sum_rows(_masked(x, mask)) / count
  block_m2 = _sum_rows(_masked((x - block_mean[None]) ** 2, mask))

  @pl.when(i == 0)
  def _():
    out_ref[_row(STATS_MEAN), :] = block_mean
    out_ref[_row(STATS_M2), :] = block_m2

  @pl.when(i > 0)
  def _():
    seen = (i * block_rows * sublanes).astype(jnp.float32)
    total = seen + count
    mean = out_ref[_row(STATS_MEAN), :]
    delta = block_mean - mean
    out_ref[_row(STATS_MEAN), :] = mean + delta * (count / total)
    m2 = out_ref[_row(STATS_M2), :] + block_m2 + delta * delta * (seen * count / total)
    out_ref[_row(STATS_M2), :] = m2


def _normalize_kernel(x_ref, coef_ref, y_ref, *, relu: bool):
  y = (x_ref[...].astype(jnp.float32) - _coef(coef_ref, COEF_MEAN)) * _coef(coef_ref, COEF_MUL)
  y = y + _coef(coef_ref, COEF_BIAS)
  if relu:
    y = jnp.maximum(y, 0.0)
  y_ref[...] = y.astype(y_ref.dtype)


def _backward_sums_kernel(
  x_ref, dy_ref, coef_ref, out_ref, *, rows: int, block_rows: int, relu: bool
):
  _accumulate_sums(x_ref[...], dy_ref[...], coef_ref, out_ref, 1, rows, block_rows, relu)


def _accumulate_sums(x, dy, coef_ref, out_ref, axis: int, rows: int, block_rows: int, relu):
  """Adds (sum g, sum g * (x - mean)) of row block ``program_id(axis)`` to out_ref's rows
  SUM_G and SUM_G_XC."""
  mask = _row_mask(block_rows, rows, axis)
  xc, g = _relu_masked_cotangent(x, dy, coef_ref, relu)
  sum_g = _sum_rows(_masked(g, mask))
  sum_gxc = _sum_rows(_masked(g * xc, mask))

  @pl.when(pl.program_id(axis) == 0)
  def _():
    out_ref[...] = jnp.zeros_like(out_ref)

  out_ref[_row(SUM_G), :] += sum_g
  out_ref[_row(SUM_G_XC), :] += sum_gxc


def _backward_dx_kernel(x_ref, dy_ref, coef_ref, dx_ref, *, relu: bool):
  xc, g = _relu_masked_cotangent(x_ref[...], dy_ref[...], coef_ref, relu)
  dx = g * _coef(coef_ref, COEF_MUL) + xc * _coef(coef_ref, COEF_K_XC) + _coef(coef_ref, COEF_K_0)
  dx_ref[...] = dx.astype(dx_ref.dtype)


# Local batch norm (a group of one replica): no group sum between the passes, so one
# kernel runs both, phase 0 over every row block, then phase 1, with the activation (and
# dy) kept in VMEM from the first phase to the second: 2X forward, 3X backward.


def _resident_block(ref, block_rows: int):
  """The rows of the VMEM-resident copy that hold the current row block (grid axis 2)."""
  return ref.at[pl.ds(pl.multiple_of(pl.program_id(2) * block_rows, block_rows), block_rows)]


def _local_forward_kernel(
  x_ref, affine_ref, y_ref, stats_ref, x_vmem, *, rows, block_rows, epsilon, relu
):
  phase = pl.program_id(1)
  x_block = _resident_block(x_vmem, block_rows)

  @pl.when(phase == 0)
  def _():
    x_block[...] = x_ref[...]
    _accumulate_moments(x_ref[...], stats_ref, 2, rows=rows, block_rows=block_rows)

  @pl.when((phase == 1) & (pl.program_id(2) == 0))
  def _():  # M2 -> biased variance, once: stats' rows become local_forward's
    stats_ref[_row(LOCAL_VAR), :] = stats_ref[_row(STATS_M2), :] / float(rows * x_ref.shape[1])

  @pl.when(phase == 1)
  def _():
    mean, var = stats_ref[_row(LOCAL_MEAN), :], stats_ref[_row(LOCAL_VAR), :]
    mul = affine_ref[_row(AFFINE_SCALE), :] * jax.lax.rsqrt(var + epsilon)
    bias = affine_ref[_row(AFFINE_BIAS), :]
    y = (x_block[...].astype(jnp.float32) - mean[None]) * mul[None] + bias[None]
    if relu:
      y = jnp.maximum(y, 0.0)
    y_ref[...] = y.astype(y_ref.dtype)


def _local_backward_kernel(
  x_ref, dy_ref, coef_ref, dx_ref, sums_ref, x_vmem, dy_vmem, *, rows, block_rows, relu
):
  phase = pl.program_id(1)
  x_block, dy_block = _resident_block(x_vmem, block_rows), _resident_block(dy_vmem, block_rows)

  @pl.when(phase == 0)
  def _():
    x_block[...] = x_ref[...]
    dy_block[...] = dy_ref[...]
    _accumulate_sums(x_ref[...], dy_ref[...], coef_ref, sums_ref, 2, rows, block_rows, relu)

  @pl.when(phase == 1)
  def _():
    xc, g = _relu_masked_cotangent(x_block[...], dy_block[...], coef_ref, relu)
    k_xc = (coef_ref[_row(COEF_A), :] * sums_ref[_row(SUM_G_XC), :])[None]
    k_0 = (coef_ref[_row(COEF_B), :] * sums_ref[_row(SUM_G), :])[None]
    dx = g * _coef(coef_ref, COEF_MUL) + xc * k_xc + k_0
    dx_ref[...] = dx.astype(dx_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls


def _block_sizes(view_shape, block_sizes: BlockSizes | None) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes.default(view_shape, target.target_device().device_kind)
  block_sizes.check(view_shape)
  return block_sizes


def _specs(view_shape, bs: BlockSizes, n_coef: int, reduce: bool):
  """Grid, x-block spec, coef spec and compiler params; reductions put rows innermost."""
  rows, sublanes, channels = view_shape
  bm, bc = bs.block_rows, bs.block_channels
  row_blocks, channel_blocks = pl.cdiv(rows, bm), channels // bc
  if reduce:
    grid = (channel_blocks, row_blocks)
    x_spec = pl.BlockSpec((bm, sublanes, bc), lambda j, i: (i, 0, j))
    coef_spec = pl.BlockSpec((n_coef, bc), lambda j, i: (0, j))
    semantics = ("parallel", "arbitrary")
  else:
    grid = (row_blocks, channel_blocks)
    x_spec = pl.BlockSpec((bm, sublanes, bc), lambda i, j: (i, 0, j))
    coef_spec = pl.BlockSpec((n_coef, bc), lambda i, j: (0, j))
    semantics = ("parallel", "parallel")
  params = pltpu.CompilerParams(dimension_semantics=semantics)
  return grid, x_spec, coef_spec, params


def _in_hbm(*arrays):
  """The kernel operands, constrained to stay in HBM: the kernels pipeline their own
  reads, so XLA should not also prefetch the activation into VMEM around them."""
  return [pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in arrays]


def _tiled_bytes(a) -> int:
  """Bytes of ``a`` in HBM: its last two dimensions padded to whole (8, 128) tiles, which
  is what a DMA of it moves (twice the elements when C = 64)."""
  *major, sublanes, lanes = a.shape
  tile = ceil_div(sublanes, SUBLANES) * SUBLANES * ceil_div(lanes, LANES) * LANES
  return math.prod(major) * tile * a.dtype.itemsize


def _traffic_cost(*arrays, outputs, flops_per_element: int, fetches: dict[int, int] | None = None):
  """The kernel's HBM traffic (operands plus results) for XLA's cost analysis; operand
  ``i`` counts ``fetches[i]`` times (default once)."""
  fetches = fetches or {}
  nbytes = sum(_tiled_bytes(a) * fetches.get(i, 1) for i, a in enumerate(arrays))
  nbytes += sum(_tiled_bytes(a) for a in outputs)
  return pl.CostEstimate(
    flops=flops_per_element * arrays[0].size, transcendentals=0, bytes_accessed=nbytes
  )


def _coef_fetches(view_shape, bs: BlockSizes) -> int:
  """How often an elementwise pass reads its coefficients from HBM. The pipeline fetches
  a block when its index changes; with row blocks outermost, the coefficients' channel
  block changes at every step when there are several channel blocks (the whole array is
  then read once per row block), and never when there is one."""
  rows, _, channels = view_shape
  return pl.cdiv(rows, bs.block_rows) if channels // bs.block_channels > 1 else 1


def _reduction_out_spec(k: int, bc: int):
  return pl.BlockSpec((k, bc), lambda j, i: (0, j))


def stats(x, *, block_sizes: BlockSizes | None = None):
  """Per-channel (mean, M2) of the channels-last x as float32 [2, C]."""
  with jax.named_scope("bn_stats"):
    v = to_bn_view(x)
    bs = _block_sizes(v.shape, block_sizes)
    grid, x_spec, _, params = _specs(v.shape, bs, 0, reduce=True)
    kernel = functools.partial(_stats_kernel, rows=v.shape[0], block_rows=bs.block_rows)
    out_shape = varying_like(v, (STATS_ROWS, v.shape[2]), jnp.float32)
    return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[x_spec],
      out_specs=_reduction_out_spec(STATS_ROWS, bs.block_channels),
      out_shape=out_shape,
      cost_estimate=_traffic_cost(v, outputs=[out_shape], flops_per_element=5),
      compiler_params=params,
      name="bn_stats",
    )(*_in_hbm(v))


def normalize(x, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """(x - mean) * mul + bias (then ReLU) with coef rows (mean, mul, bias); x's dtype."""
  with jax.named_scope("bn_normalize"):
    v = to_bn_view(x)
    bs = _block_sizes(v.shape, block_sizes)
    grid, x_spec, coef_spec, params = _specs(v.shape, bs, FORWARD_COEF_ROWS, reduce=False)
    out_shape = varying_like(v, v.shape)
    y = pl.pallas_call(
      functools.partial(_normalize_kernel, relu=relu),
      grid=grid,
      in_specs=[x_spec, coef_spec],
      out_specs=x_spec,
      out_shape=out_shape,
      cost_estimate=_traffic_cost(
        v, coef, outputs=[out_shape], flops_per_element=4, fetches={1: _coef_fetches(v.shape, bs)}
      ),
      compiler_params=params,
      name="bn_normalize",
    )(*_in_hbm(v, coef))
    return from_bn_view(y, x.shape)


def backward_sums(x, dy, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """Per-channel (sum g, sum g * (x - mean)) as float32 [2, C]; coef as in normalize."""
  with jax.named_scope("bn_backward_sums"):
    v, dv = to_bn_view(x), to_bn_view(dy)
    bs = _block_sizes(v.shape, block_sizes)
    grid, x_spec, coef_spec, params = _specs(v.shape, bs, FORWARD_COEF_ROWS, reduce=True)
    kernel = functools.partial(
      _backward_sums_kernel, rows=v.shape[0], block_rows=bs.block_rows, relu=relu
    )
    out_shape = varying_like(v, (SUMS_ROWS, v.shape[2]), jnp.float32)
    return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[x_spec, x_spec, coef_spec],
      out_specs=_reduction_out_spec(SUMS_ROWS, bs.block_channels),
      out_shape=out_shape,
      cost_estimate=_traffic_cost(v, dv, coef, outputs=[out_shape], flops_per_element=7),
      compiler_params=params,
      name="bn_backward_sums",
    )(*_in_hbm(v, dv, coef))


def backward_dx(x, dy, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """mul * g + k_xc * (x - mean) + k_0, coef rows (mean, mul, bias, k_xc, k_0)."""
  with jax.named_scope("bn_backward_dx"):
    v, dv = to_bn_view(x), to_bn_view(dy)
    bs = _block_sizes(v.shape, block_sizes)
    grid, x_spec, coef_spec, params = _specs(v.shape, bs, BACKWARD_COEF_ROWS, reduce=False)
    out_shape = varying_like(v, v.shape)
    dx = pl.pallas_call(
      functools.partial(_backward_dx_kernel, relu=relu),
      grid=grid,
      in_specs=[x_spec, x_spec, coef_spec],
      out_specs=x_spec,
      out_shape=out_shape,
      cost_estimate=_traffic_cost(
        v,
        dv,
        coef,
        outputs=[out_shape],
        flops_per_element=9,
        fetches={2: _coef_fetches(v.shape, bs)},
      ),
      compiler_params=params,
      name="bn_backward_dx",
    )(*_in_hbm(v, dv, coef))
    return from_bn_view(dx, x.shape)


def _local_specs(view_shape, bs: BlockSizes):
  """Grid (channel blocks, phase, row blocks): x is fetched block by block in phase 0
  and held at the last block in phase 1; outputs are written (and flushed) in phase 1."""
  rows, sublanes, channels = view_shape
  bm, bc = bs.block_rows, bs.block_channels
  last = pl.cdiv(rows, bm) - 1
  grid = (channels // bc, 2, last + 1)
  x_spec = pl.BlockSpec((bm, sublanes, bc), lambda j, p, i: (i + (last - i) * p, 0, j))
  out_spec = pl.BlockSpec((bm, sublanes, bc), lambda j, p, i: (i * p, 0, j))
  coef_spec = lambda k: pl.BlockSpec((k, bc), lambda j, p, i: (0, j))
  return grid, x_spec, out_spec, coef_spec, ((last + 1) * bm, sublanes, bc)


def _local_params(view_shape, dtype, arrays: int, bs: BlockSizes):
  """Compiler params that make room for ``arrays`` resident copies of a channel block of
  the activation, or None if they do not fit half of the generation's VMEM."""
  resident_shape = _local_specs(view_shape, bs)[-1]
  resident = arrays * _tiled_bytes(jax.ShapeDtypeStruct(resident_shape, dtype))
  device_kind = target.target_device().device_kind
  vmem = vmem_bytes(device_kind)
  if resident > vmem // 2:
    return None
  return pltpu.CompilerParams(
    dimension_semantics=("parallel", "arbitrary", "arbitrary"),
    vmem_limit_bytes=min(vmem * 3 // 4, resident + scoped_vmem_bytes(device_kind)),
  )


def local_forward(
  x, scale, bias, *, epsilon: float, relu: bool, block_sizes: BlockSizes | None = None
):
  """Batch norm of the channels-last x over its own rows in one kernel, x read once:
  ``(y, float32 [2, C] (mean, var))``, or None where x's channel block does not fit the
  VMEM budget (then run ``stats`` and ``normalize``)."""
  with jax.named_scope("bn_local_forward"):
    v = to_bn_view(x)
    bs = _block_sizes(v.shape, block_sizes)
    params = _local_params(v.shape, v.dtype, 1, bs)
    if params is None:
      return None
    grid, x_spec, out_spec, coef_spec, resident = _local_specs(v.shape, bs)
    affine = jnp.stack([scale, bias]).astype(jnp.float32)  # AFFINE_SCALE, AFFINE_BIAS
    kernel = functools.partial(
      _local_forward_kernel, rows=v.shape[0], block_rows=bs.block_rows, epsilon=epsilon, relu=relu
    )
    out_shapes = [
      varying_like(v, v.shape),
      varying_like(v, (STATS_ROWS, v.shape[2]), jnp.float32),
    ]
    y, stats = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[x_spec, coef_spec(AFFINE_ROWS)],
      out_specs=[out_spec, coef_spec(STATS_ROWS)],
      out_shape=out_shapes,
      scratch_shapes=[pltpu.VMEM(resident, v.dtype)],
      cost_estimate=_traffic_cost(v, affine, outputs=out_shapes, flops_per_element=9),
      compiler_params=params,
      name="bn_local_forward",
    )(*_in_hbm(v, affine))
    return from_bn_view(y, x.shape), stats


def local_backward(x, dy, coef, *, relu: bool, block_sizes: BlockSizes | None = None):
  """Both backward passes in one kernel, x and dy read once: ``(dx, float32 [2, C]
  (sum g, sum g * (x - mean)))`` with coef rows (mean, mul, bias, a, b), k_xc = a *
  sum(g * (x - mean)) and k_0 = b * sum(g); None where x and dy do not fit VMEM."""
  with jax.named_scope("bn_local_backward"):
    v, dv = to_bn_view(x), to_bn_view(dy)
    bs = _block_sizes(v.shape, block_sizes)
    params = _local_params(v.shape, v.dtype, 2, bs)
    if params is None:
      return None
    grid, x_spec, out_spec, coef_spec, resident = _local_specs(v.shape, bs)
    kernel = functools.partial(
      _local_backward_kernel, rows=v.shape[0], block_rows=bs.block_rows, relu=relu
    )
    out_shapes = [
      varying_like(v, v.shape),
      varying_like(v, (SUMS_ROWS, v.shape[2]), jnp.float32),
    ]
    dx, sums = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[x_spec, x_spec, coef_spec(BACKWARD_COEF_ROWS)],
      out_specs=[out_spec, coef_spec(SUMS_ROWS)],
      out_shape=out_shapes,
      scratch_shapes=[pltpu.VMEM(resident, v.dtype), pltpu.VMEM(resident, dv.dtype)],
      cost_estimate=_traffic_cost(v, dv, coef, outputs=out_shapes, flops_per_element=16),
      compiler_params=params,
      name="bn_local_backward",
    )(*_in_hbm(v, dv, coef))
    return from_bn_view(dx, x.shape), sums


PALLAS = Passes(stats, normalize, backward_sums, backward_dx, local_forward, local_backward)
