"""Deprecated: ``torus_collectives.kernels.async_torus`` moved to
``torus_collectives.kernels.split_rings`` (the package calls start/step/done collectives
"split"). Importing it keeps working until 0.3.0, with a ``DeprecationWarning``."""

from torus_collectives._deprecation import warn_moved

warn_moved("torus_collectives.kernels.async_torus", "torus_collectives.kernels.split_rings")

from torus_collectives.kernels.split_rings import (  # noqa: E402
  RingState,
  pattern,
  ring_done,
  ring_phase,
  ring_start,
  ring_step,
)

__all__ = ["RingState", "pattern", "ring_done", "ring_phase", "ring_start", "ring_step"]
