"""What the computation being traced targets: its device, and whether the Pallas TPU
kernels can run there.

Inside ``jax.shard_map`` the abstract mesh names the target device, also when compiling
ahead of time for a TPU topology from a CPU host; outside one, the default device is all
there is. The Pallas kernels compile for TPU v4 and newer (libtpu cannot compile a Pallas
remote DMA for v2/v3) and run anywhere else only in TPU interpret mode.
"""

from __future__ import annotations

import jax

from torus_collectives import _jax_internals as jax_internals

# Generations whose libtpu cannot compile a Pallas remote DMA.
PALLAS_UNSUPPORTED_TPU_KINDS = ("TPU v2", "TPU v3")


def target_device():
  """The (abstract) device the enclosing computation is traced for."""
  return jax.sharding.get_abstract_mesh().abstract_device or jax.devices()[0]


def interpret_mode_active() -> bool:
  """Whether the caller is inside ``pltpu.force_tpu_interpret_mode(...)``."""
  return jax_internals.pallas_tpu_interpret_mode()


def pallas_compiles_for(device_kind: str) -> bool:
  """Whether the Pallas TPU kernels compile for a TPU of this ``device_kind`` (v4+)."""
  return device_kind.startswith("TPU") and not any(
    device_kind == k or device_kind.startswith(k + " ") for k in PALLAS_UNSUPPORTED_TPU_KINDS
  )
