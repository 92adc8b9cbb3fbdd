"""Tunables of the remote-DMA torus kernels, and their defaults per shape and TPU generation.

The kernels move data HBM to HBM with remote DMAs and stream the reductions through VMEM in
blocks of ``block_rows`` x 128 lanes. A block is the unit of VMEM traffic: four blocks (the
own partial sum and the received one, each double-buffered) are resident at a time.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Block size of the VMEM streaming in the reduce-scatter kernel.

  Attributes:
    block_rows: rows of 128 lanes per VMEM block; a positive multiple of 16. Each stream's
      slice of a chunk is padded to a multiple of it.
  """

  block_rows: int = 512

  def __post_init__(self):
    if self.block_rows <= 0 or self.block_rows % ROW_MULTIPLE:
      raise ValueError(
        f"block_rows must be a positive multiple of {ROW_MULTIPLE} (the bfloat16 sublane "
        f"tiling), got {self.block_rows=}"
      )


def default_config(rows_per_slice: int, itemsize: int, device_kind: str) -> KernelConfig:
  """A config for slices of ``rows_per_slice`` rows of ``itemsize``-byte elements.

  The four resident blocks may use 1/8 of the generation's scoped VMEM. A slice takes the
  fewest blocks that respect that cap, each as small as that count allows, so padding a
  slice to a whole number of blocks adds under 16 rows per block.
  """
  vmem = _SCOPED_VMEM_BYTES.get(device_kind, _FALLBACK_SCOPED_VMEM_BYTES)
  cap = max(ROW_MULTIPLE, (vmem // 8 // (4 * LANES * itemsize)) // ROW_MULTIPLE * ROW_MULTIPLE)
  rows = max(rows_per_slice, 1)
  blocks = -(-rows // cap)
  return KernelConfig(block_rows=-(-rows // (blocks * ROW_MULTIPLE)) * ROW_MULTIPLE)
