"""What "auto" knows: tuning tables, and the tuner that measures them.

* ``tables``: the table format, the decision rule, and where tables are found
  (``use_table``, the user cache, the tables shipped in ``tuned/``);
* ``timing``: the interleaved routine that times implementations against each other
  (the tuner's and ``bench/``'s);
* ``tuner``: the cases timed and the command line, ``python -m torus_collectives.tuning``;
* ``step_tuning``: the whole-train-step mode, ``tune_step`` (re-exported here), whose
  entries "auto" reads for gradient summation.
"""

import importlib

__all__ = ["tune_step"]

_SUBMODULES = frozenset({"tables", "timing", "tuner", "step_tuning"})


def __getattr__(name: str):
  # Lazily: ``tables`` is imported by the registry, which ``step_tuning`` imports.
  if name == "tune_step":
    from torus_collectives.tuning.step_tuning import tune_step

    return tune_step
  if not name.startswith("_") and name not in _SUBMODULES:
    # This was one module until the tuner, the tables and the timing became three: its
    # table API (``use_table``, ``Table``, ``decide``, ...) still answers here, deprecated.
    tables = importlib.import_module("torus_collectives.tuning.tables")
    if hasattr(tables, name):
      from torus_collectives._deprecation import warn_moved

      warn_moved(f"torus_collectives.tuning.{name}", f"torus_collectives.tuning.tables.{name}")
      return getattr(tables, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
