"""Deprecated: ``torus_collectives.overlap`` moved to ``torus_collectives.experimental.overlap``.

``from torus_collectives.overlap import value_and_summed_grad`` keeps working until 0.3.0,
with a ``DeprecationWarning``; import ``torus_collectives.experimental.value_and_summed_grad``
instead."""

from torus_collectives._deprecation import warn_moved

warn_moved("torus_collectives.overlap", "torus_collectives.experimental.overlap")

from torus_collectives.experimental.overlap import value_and_summed_grad  # noqa: E402

__all__ = ["value_and_summed_grad"]
