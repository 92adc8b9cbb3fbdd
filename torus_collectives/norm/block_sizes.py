"""Batch norm's kernel tunable, ``BlockSizes``: the block shape of every pass over the
activation, viewed in XLA's TPU layout as ``[rows, sublanes, channels]``
(``tiling.bn_view``), tiled into ``block_rows`` x sublanes x ``block_channels`` blocks.

In the core, not beside the kernels, so that ``batch_norm(..., block_sizes=)`` validates
it without importing Pallas; frozen and self-validating, like ``kernel_config.KernelConfig``.
"""

from __future__ import annotations

import dataclasses
import math

from torus_collectives.kernel_config import scoped_vmem_bytes
from torus_collectives.tiling import LANES, SUBLANES, ceil_div

# The widest channel block.
BN_MAX_BLOCK_CHANNELS = 512


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block shape of every batch-norm pass over the kernels' ``[R, S, C]`` view of the
  activation (``tiling.bn_view``: ``[H*W, N, C]`` for NHWC in XLA's convolution layout).

  Pass as ``batch_norm(..., block_sizes=)``; only ``implementation="pallas"`` reads it.
  None there: ``BlockSizes.default`` for the shape and TPU generation.

  Attributes:
    block_rows: leading rows of the view per block (each holds S x C elements); at most
      the view's rows.
    block_channels: channels per block: all of them, or a multiple of 128 dividing them.

  Raises:
    ValueError: when constructed, on a size below one; when the Pallas batch norm runs,
      on blocks that do not tile the activation's view (``check``).
  """

  block_rows: int
  block_channels: int

  def __post_init__(self):
    if self.block_rows < 1 or self.block_channels < 1:
      raise ValueError(f"block sizes must be positive, got {self}")

  @classmethod
  def default(cls, view_shape: tuple[int, int, int], device_kind: str) -> BlockSizes:
    """At most ``BN_MAX_BLOCK_CHANNELS`` lanes, and rows for (scoped VMEM) / 64 elements,
    2**18 on the 16 MiB of v4/v5e/v5p: a pass holds up to three double-buffered
    activation blocks and a few float32 temporaries of one, about 40 bytes an element."""
    rows, sublanes, channels = view_shape
    block_channels = channels
    if channels > BN_MAX_BLOCK_CHANNELS and channels % LANES == 0:
      block_channels = math.gcd(channels, BN_MAX_BLOCK_CHANNELS)
    # A block's VMEM footprint: sublanes and lanes padded to whole (8, 128) tiles.
    tile = ceil_div(sublanes, SUBLANES) * SUBLANES * ceil_div(block_channels, LANES) * LANES
    block_rows = max(1, scoped_vmem_bytes(device_kind) // 64 // tile)
    return cls(block_rows=min(block_rows, rows), block_channels=block_channels)

  def check(self, view_shape: tuple[int, int, int]) -> None:
    """Raises ValueError unless these blocks tile a ``[rows, sublanes, channels]`` view."""
    rows, _, channels = view_shape
    if channels % self.block_channels or (
      self.block_channels != channels and self.block_channels % LANES
    ):
      raise ValueError(
        f"block_channels={self.block_channels} must divide {channels=} and be a "
        f"multiple of {LANES} or all of them"
      )
    if self.block_rows > rows:
      raise ValueError(f"block_rows={self.block_rows} must be at most the view's {rows=}")
