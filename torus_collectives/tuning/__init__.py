"""What "auto" knows: tuning tables, and the tuner that measures them.

* ``tables``: the table format, the decision rule, and where tables are found
  (``use_table``, the user cache, the tables shipped in ``tuned/``);
* ``timing``: the interleaved routine that times implementations against each other
  (the tuner's and ``bench/``'s);
* ``tuner``: the cases timed and the command line, ``python -m torus_collectives.tuning``;
* ``step_tuning``: the whole-train-step mode, ``tune_step`` (re-exported here), whose
  entries "auto" reads for gradient summation.
"""

__all__ = ["tune_step"]


def __getattr__(name: str):
  # Lazily: ``tables`` is imported by the registry, which ``step_tuning`` imports.
  if name == "tune_step":
    from torus_collectives.tuning.step_tuning import tune_step

    return tune_step
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
