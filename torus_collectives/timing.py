"""Deprecated: ``torus_collectives.timing`` moved to ``torus_collectives.tuning.timing``.

Its names keep working from here until 0.3.0, with a ``DeprecationWarning``."""

from torus_collectives._deprecation import warn_moved

warn_moved("torus_collectives.timing", "torus_collectives.tuning.timing")

from torus_collectives.tuning.timing import *  # noqa: E402, F403
