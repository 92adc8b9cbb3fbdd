"""Deprecated: ``torus_collectives.weight_update.interpreter`` moved to
``torus_collectives.weight_update.sharded_eval`` (the sharded evaluation of an update).

Importing it keeps working until 0.3.0, with a ``DeprecationWarning``."""

from torus_collectives._deprecation import warn_moved

warn_moved(
  "torus_collectives.weight_update.interpreter", "torus_collectives.weight_update.sharded_eval"
)

from torus_collectives.weight_update.sharded_eval import (  # noqa: E402
  Interpreter,
  Sharded,
  Shards,
  Uniform,
  UnshardableTransformError,
  replicated,
)

__all__ = ["Interpreter", "Sharded", "Shards", "Uniform", "UnshardableTransformError", "replicated"]
