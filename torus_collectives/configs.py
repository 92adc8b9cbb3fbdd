"""Kernel tunables that callers may pass: ``KernelConfig`` (torus collectives) and
``BlockSizes`` (batch norm), with their defaults per shape and TPU generation.

They live in the core, not beside the kernels, so that the public API can take and
validate them (``config=``, ``block_sizes=``) without importing Pallas. Both are frozen,
self-validating dataclasses: a bad value raises ``ValueError`` when constructed.

The torus kernels move data HBM to HBM with remote DMAs and stream the reductions through
VMEM in blocks of ``block_rows`` x 128 lanes. A block is the unit of VMEM traffic: four
blocks (the own partial sum and the received one, each double-buffered) are resident at a
time, plus their float32 sum when the buffer holds a 16-bit type. The batch-norm passes
tile the activation, viewed as ``x[rows, channels]``, into
``block_rows`` x ``block_channels`` blocks.
"""

from __future__ import annotations

import dataclasses
import math

from torus_collectives.layout import ceil_div

LANES = 128
# Sublane tiling of a (rows, 128) VMEM block: 8 rows for 32-bit types, 16 for bfloat16.
# Every block is a multiple of 16 rows so one config serves all supported dtypes.
ROW_MULTIPLE = 16

# Default scoped-VMEM limit per generation, in bytes (XLA's defaults). The four resident
# blocks use at most 1/8 of it, leaving the rest to whatever XLA schedules around the
# collective. These are sizing rules, not tuned values: nothing was measured on a TPU.
_SCOPED_VMEM_BYTES = {
  "TPU v4": 16 << 20,
  "TPU v5 lite": 16 << 20,
  "TPU v5": 16 << 20,
  "TPU v5p": 16 << 20,
  "TPU v6 lite": 32 << 20,
}
_FALLBACK_SCOPED_VMEM_BYTES = 16 << 20
# Pieces per reduce-scatter slab the default aims for: the link idles for one piece's add
# per ring phase (modelled as 1/PIECES of the unpipelined add time; see cost_model).
PIECES = 8

# Batch norm: float32 elements per block (1 MiB), so a pass's double-buffered inputs,
# outputs and float32 temporaries stay well inside the 16 MiB of scoped VMEM of
# v4/v5e/v5p; and the widest channel block.
BN_BLOCK_ELEMENTS = 1 << 18
BN_MAX_BLOCK_CHANNELS = 512


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tunables of the torus kernels.

  Attributes:
    block_rows: rows of 128 lanes per VMEM block and per pipelined DMA piece; a positive
      multiple of 16. None (the default): chosen from the buffer's size and the TPU
      generation (``default``).
    float32_partials: for bfloat16 and float16, send the reduce-scatter's partial sums as
      float32 (the input is widened before and rounded after the collective). Off by
      default: partial sums travel in the input's type (the wire bytes of XLA's bfloat16
      all-reduce) and every hop adds in float32 in VMEM and rounds once. On, the sum is
      rounded only once (about half the error; figures in ``pallas_backend``), at the
      price of 2x the wire and HBM bytes plus the widening and rounding passes around
      the kernels. No effect on 32-bit types.
  """

  block_rows: int | None = None
  float32_partials: bool = False

  def __post_init__(self):
    if not isinstance(self.float32_partials, bool):
      raise ValueError(f"float32_partials must be a bool, got {self.float32_partials=}")
    if self.block_rows is not None and (
      not isinstance(self.block_rows, int) or self.block_rows <= 0 or self.block_rows % ROW_MULTIPLE
    ):
      raise ValueError(
        f"block_rows must be a positive multiple of {ROW_MULTIPLE} (the bfloat16 sublane "
        f"tiling), got {self.block_rows=}"
      )

  @classmethod
  def default(cls, rows_per_slice: int, itemsize: int, device_kind: str) -> KernelConfig:
    """A config for slices of ``rows_per_slice`` rows of ``itemsize``-byte elements.

    A block is also the piece a reduce-scatter slab is sent and added in: the add of
    piece k overlaps the arrival of piece k + 1. So a slice is cut into about
    ``PIECES`` blocks, as long as the four resident blocks stay within 1/8 of the
    generation's scoped VMEM (more pieces then) and a block keeps at least one 16-row
    tile (fewer pieces for small slices). The last piece may be short: a slice is padded
    to whole 16-row tiles only.
    """
    vmem = _SCOPED_VMEM_BYTES.get(device_kind, _FALLBACK_SCOPED_VMEM_BYTES)
    cap = max(ROW_MULTIPLE, (vmem // 8 // (4 * LANES * itemsize)) // ROW_MULTIPLE * ROW_MULTIPLE)
    rows = max(rows_per_slice, 1)
    return cls(block_rows=min(cap, ceil_div(rows, PIECES * ROW_MULTIPLE) * ROW_MULTIPLE))

  def resolve(self, rows_per_slice: int, itemsize: int, device_kind: str) -> KernelConfig:
    """This config with ``block_rows`` filled in from the shape and generation if unset."""
    if self.block_rows is not None:
      return self
    block_rows = KernelConfig.default(rows_per_slice, itemsize, device_kind).block_rows
    return dataclasses.replace(self, block_rows=block_rows)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block shape of every batch-norm pass: ``block_rows`` x ``block_channels`` of the
  (lane-folded) ``x[rows, channels]``."""

  block_rows: int
  block_channels: int

  def __post_init__(self):
    if self.block_rows < 1 or self.block_channels < 1:
      raise ValueError(f"block sizes must be positive, got {self}")

  @classmethod
  def default(cls, rows: int, channels: int) -> BlockSizes:
    """About ``BN_BLOCK_ELEMENTS`` per block, at most ``BN_MAX_BLOCK_CHANNELS`` lanes."""
    block_channels = channels
    if channels > BN_MAX_BLOCK_CHANNELS and channels % LANES == 0:
      block_channels = math.gcd(channels, BN_MAX_BLOCK_CHANNELS)
    block_rows = max(
      ROW_MULTIPLE, BN_BLOCK_ELEMENTS // block_channels // ROW_MULTIPLE * ROW_MULTIPLE
    )
    return cls(block_rows=min(block_rows, rows), block_channels=block_channels)

  def check(self, rows: int, channels: int) -> None:
    """Raises ValueError unless these blocks tile an ``x[rows, channels]`` legally."""
    if channels % self.block_channels or (
      self.block_channels != channels and self.block_channels % LANES
    ):
      raise ValueError(
        f"block_channels={self.block_channels} must divide {channels=} and be a "
        f"multiple of {LANES} or all of them"
      )
    if self.block_rows != rows and (self.block_rows % ROW_MULTIPLE or self.block_rows > rows):
      raise ValueError(
        f"block_rows={self.block_rows} must be a multiple of {ROW_MULTIPLE} no larger "
        f"than {rows=}, or all of them"
      )
