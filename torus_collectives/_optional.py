"""Optional dependencies: the core needs only jax and numpy.

``sharded_update`` and the LARS helpers take optax transformations, so they need optax;
``require`` imports it where they are used, and says which extra to install if it is
missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The extra of torus-collectives that installs each optional package.
EXTRAS = {"optax": "optax"}


def require(package: str, feature: str) -> ModuleType:
  """``package``, imported; an ImportError naming the extra if it is not installed."""
  try:
    return importlib.import_module(package)
  except ImportError as e:
    raise ImportError(
      f"torus_collectives.{feature} needs {package}, which is not installed: "
      f"pip install 'torus-collectives[{EXTRAS[package]}]'"
    ) from e
