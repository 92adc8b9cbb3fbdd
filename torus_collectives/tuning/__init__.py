"""What "auto" knows: tuning tables, and the tuner that measures them.

* ``tables``: the table format, the decision rule, and where tables are found
  (``use_table``, the user cache, the tables shipped in ``tuned/``); the registry reads
  it, so it imports nothing above the shared facts;
* ``timing``: the interleaved routine that times implementations against each other
  (the tuner's and ``bench/``'s);
* ``tuner``: the cases timed and the command line, ``python -m torus_collectives.tuning``;
* ``step_tuning``: the whole-train-step mode, ``tune_step``, whose entries "auto" reads
  for gradient summation.

This file imports ``tables`` only: the registry imports the tables, and the tuner imports
the ops, which import the registry (``torus_collectives._layers``).
"""

from torus_collectives import _deprecation
from torus_collectives.tuning import tables

_SUBMODULES = frozenset({"tables", "timing", "tuner", "step_tuning"})


def _tune_step():
  _deprecation.warn_moved(
    "torus_collectives.tuning.tune_step",
    "torus_collectives.tuning.step_tuning.tune_step",
    stacklevel=4,
  )
  from torus_collectives.tuning.step_tuning import tune_step

  return tune_step


def __getattr__(name: str):
  # Old paths, deprecated: ``tune_step`` was re-exported here, and this was one module
  # until the tuner, the tables and the timing became three; its table API (``use_table``,
  # ``Table``, ``decide``, ...) still answers here.
  if name == "tune_step":
    return _tune_step()
  if not name.startswith("_") and name not in _SUBMODULES and hasattr(tables, name):
    _deprecation.warn_moved(
      f"torus_collectives.tuning.{name}", f"torus_collectives.tuning.tables.{name}"
    )
    return getattr(tables, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
