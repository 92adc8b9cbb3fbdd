"""Deprecated: ``torus_collectives.layout`` moved to ``torus_collectives.tiling`` (the
word "layout" now means only where a collective's grid of chunks lies in a buffer:
``torus_collectives.kernels.buffer_layout``). Importing it keeps working until 0.3.0,
with a ``DeprecationWarning``."""

from torus_collectives._deprecation import warn_moved

warn_moved("torus_collectives.layout", "torus_collectives.tiling")

from torus_collectives.tiling import (  # noqa: E402
  LANES,
  SUBLANES,
  BatchNormView,
  accumulation_dtype,
  bn_view,
  ceil_div,
  from_bn_view,
  pad_chunks,
  pad_to,
  to_bn_view,
)

__all__ = [
  "LANES",
  "SUBLANES",
  "BatchNormView",
  "accumulation_dtype",
  "bn_view",
  "ceil_div",
  "from_bn_view",
  "pad_chunks",
  "pad_to",
  "to_bn_view",
]
