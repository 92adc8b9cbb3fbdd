"""Deprecated: ``torus_collectives.configs`` moved to ``torus_collectives.kernel_config``
(beside the example's ``resnet/configs``, the old name read as the same kind of thing).
Importing it keeps working until 0.3.0, with a ``DeprecationWarning``; ``KernelConfig`` is
also ``torus_collectives.KernelConfig``."""

from torus_collectives._deprecation import warn_moved

warn_moved("torus_collectives.configs", "torus_collectives.kernel_config")

from torus_collectives.kernel_config import (  # noqa: E402
  PIECES,
  ROW_MULTIPLE,
  KernelConfig,
  scoped_vmem_bytes,
  vmem_bytes,
)

__all__ = ["PIECES", "ROW_MULTIPLE", "KernelConfig", "scoped_vmem_bytes", "vmem_bytes"]
