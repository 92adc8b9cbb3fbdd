"""Deprecated: ``python -m torus_collectives.tune`` is now ``python -m
torus_collectives.tuning`` (the same options). The old command keeps working until 0.3.0,
with a ``DeprecationWarning``."""

import sys

from torus_collectives._deprecation import warn_moved

if __name__ == "__main__":
  warn_moved("python -m torus_collectives.tune", "python -m torus_collectives.tuning", stacklevel=2)
  from torus_collectives.tuning import tuner

  tuner.main(sys.argv[1:])
else:
  warn_moved("torus_collectives.tune", "torus_collectives.tuning.tuner")
  from torus_collectives.tuning.tuner import *  # noqa: F403
