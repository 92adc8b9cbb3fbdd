"""Deprecated: ``torus_collectives.nn`` moved to ``torus_collectives.norm.linen``.

``from torus_collectives.nn import BatchNorm`` keeps working until 0.3.0, with a
``DeprecationWarning``; import ``torus_collectives.norm.linen.BatchNorm`` instead."""

from torus_collectives._deprecation import warn_moved

warn_moved("torus_collectives.nn", "torus_collectives.norm.linen")

from torus_collectives.norm.linen import BatchNorm  # noqa: E402

__all__ = ["BatchNorm"]
