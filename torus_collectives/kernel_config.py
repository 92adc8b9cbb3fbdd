"""The torus kernels' tunables that callers may pass, ``KernelConfig``, with its defaults
per shape and TPU generation, and the VMEM sizes of each generation that every kernel
sizes its blocks by (batch norm's ``BlockSizes`` too, in ``norm.block_sizes``).

They live in the core, not beside the kernels, so that the public API can take and
validate them (``config=``) without importing Pallas. ``KernelConfig`` is a frozen,
self-validating dataclass: a bad value raises ``ValueError`` when constructed.

The torus kernels move data HBM to HBM with remote DMAs and stream the reductions through
VMEM in blocks of ``block_rows`` x 128 lanes. A block is the unit of VMEM traffic: four
blocks (the own partial sum and the received one, each double-buffered) are resident at a
time, plus their float32 sum when the buffer holds a 16-bit type.
"""

from __future__ import annotations

import dataclasses

from torus_collectives.tiling import LANES, ceil_div

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


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tunables of the torus kernels: pass as ``config=`` to ``psum``, ``pmean``,
  ``psum_scatter``, ``all_gather`` (and their descriptive names). Only the
  ``"pallas"`` implementation reads it, whether chosen or picked by "auto"; the others
  accept and ignore it. ``KernelConfig()`` is what ``config=None`` means.

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

  Raises:
    ValueError: when constructed, on a ``block_rows`` that is not None or a positive
      multiple of 16, or a ``float32_partials`` that is not a bool.
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
    vmem = scoped_vmem_bytes(device_kind)
    cap = max(ROW_MULTIPLE, (vmem // 8 // (4 * LANES * itemsize)) // ROW_MULTIPLE * ROW_MULTIPLE)
    rows = max(rows_per_slice, 1)
    return cls(block_rows=min(cap, ceil_div(rows, PIECES * ROW_MULTIPLE) * ROW_MULTIPLE))

  def resolve(self, rows_per_slice: int, itemsize: int, device_kind: str) -> KernelConfig:
    """This config with ``block_rows`` filled in from the shape and generation if unset."""
    if self.block_rows is not None:
      return self
    block_rows = KernelConfig.default(rows_per_slice, itemsize, device_kind).block_rows
    return dataclasses.replace(self, block_rows=block_rows)


# Physical VMEM per TensorCore (jax's TPU info); 16 MiB where unknown. The local batch
# norm keeps activations resident in up to half of it.
_VMEM_BYTES = {
  "TPU v4": 16 << 20,
  "TPU v5 lite": 128 << 20,
  "TPU v5": 64 << 20,
  "TPU v5p": 64 << 20,
  "TPU v6 lite": 128 << 20,
}


def vmem_bytes(device_kind: str) -> int:
  """Physical VMEM of a TPU generation's TensorCore (16 MiB where unknown)."""
  return _VMEM_BYTES.get(device_kind, 16 << 20)


def scoped_vmem_bytes(device_kind: str) -> int:
  """XLA's default scoped-VMEM limit for a TPU generation (16 MiB where unknown)."""
  return _SCOPED_VMEM_BYTES.get(device_kind, _FALLBACK_SCOPED_VMEM_BYTES)
