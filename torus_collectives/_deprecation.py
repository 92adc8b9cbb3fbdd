"""Old public paths that moved: each keeps working for one release, with a
``DeprecationWarning`` that names the new path (``CHANGELOG.md`` lists them)."""

import warnings

REMOVED_IN = "0.3.0"


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warns that ``old`` moved to ``new``; ``stacklevel`` 3 points at the caller's caller
  (the line that imported or used the old path)."""
  warnings.warn(
    f"{old} is deprecated and will be removed in torus-collectives {REMOVED_IN}: use {new}",
    DeprecationWarning,
    stacklevel=stacklevel,
  )
