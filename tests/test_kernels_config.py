"""Kernel tunables and the schedule facts the kernels rely on (no kernels run here)."""

import pytest

from torus_collectives import kernel_config as config_lib
from torus_collectives import schedule


@pytest.mark.parametrize("block_rows", [-16, 0, 8, 24])
def test_block_rows_must_be_a_positive_multiple_of_16(block_rows):
  with pytest.raises(ValueError, match="multiple of 16"):
    config_lib.KernelConfig(block_rows=block_rows)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 1000, 3120, 100_000])
@pytest.mark.parametrize(
  "kind,vmem_budget",
  [("TPU v5 lite", 2 << 20), ("TPU v6 lite", 4 << 20), ("an unknown kind", 2 << 20)],
)
def test_default_blocks_fit_vmem_and_pad_little(rows, kind, vmem_budget):
  cfg = config_lib.KernelConfig.default(rows, 4, kind)
  blocks = -(-rows // cfg.block_rows)
  assert 4 * cfg.block_rows * config_lib.LANES * 4 <= vmem_budget  # four float32 blocks
  assert blocks * cfg.block_rows - rows < config_lib.ROW_MULTIPLE * blocks


@pytest.mark.parametrize("torus", [(2, 4), (4, 2), (1, 8), (8,), (2, 2, 2), (2, 3, 4)])
def test_all_reduce_schedule_is_reduce_scatter_then_all_gather(torus):
  """The kernels run an all-reduce as the reduce-scatter kernel then the all-gather kernel;
  that is the all-reduce schedule exactly."""
  variant = schedule.default_variant(torus)
  rs, ag, ar = (
    schedule.build(c, torus, variant) for c in ("reduce_scatter", "all_gather", "all_reduce")
  )
  assert ar.streams == tuple(r + a for r, a in zip(rs.streams, ag.streams))
  assert ar.steps() == rs.steps() + ag.steps()


def test_float32_partials_must_be_a_bool():
  with pytest.raises(ValueError, match="float32_partials"):
    config_lib.KernelConfig(float32_partials="yes")


@pytest.mark.parametrize("rows", [1, 16, 100, 208, 3120, 100_000])
def test_unset_block_rows_come_from_the_shape_and_generation(rows):
  """Unset, block_rows is the default for the shape and generation: the smallest whole
  number of 16-row tiles that cuts a slice into at most PIECES pipelined pieces (more only
  when VMEM caps the block); set, it is kept."""
  resolved = config_lib.KernelConfig(float32_partials=True).resolve(rows, 4, "TPU v5 lite")
  assert resolved.float32_partials
  assert resolved.block_rows == config_lib.KernelConfig.default(rows, 4, "TPU v5 lite").block_rows
  block, tile = resolved.block_rows, config_lib.ROW_MULTIPLE
  capped = block * 4 * 128 * 4 * 8 > (16 << 20) - 4 * 128 * 4 * 8 * tile
  assert -(-rows // block) <= config_lib.PIECES or capped
  assert block == tile or (block - tile) * config_lib.PIECES < rows
  assert config_lib.KernelConfig(block_rows=32).resolve(rows, 4, "TPU v5 lite").block_rows == 32


def test_package_import_loads_no_pallas():
  """``import torus_collectives`` leaves Pallas (jax's and the kernels) unloaded: the
  registry imports the kernels only when a Pallas implementation is chosen."""
  import subprocess
  import sys

  code = (
    "import sys, torus_collectives; loaded = [m for m in sys.modules if 'pallas' in m]; "
    "assert not loaded, loaded"
  )
  subprocess.run([sys.executable, "-c", code], check=True)
