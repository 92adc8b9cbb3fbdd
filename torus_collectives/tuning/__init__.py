"""What "auto" knows: tuning tables, and the tuner that measures them.

* ``tables``: the table format, the decision rule, and where tables are found
  (``use_table``, the user cache, the tables shipped in ``tuned/``);
* ``timing``: the interleaved routine that times implementations against each other
  (the tuner's and ``bench/``'s);
* ``tuner``: the cases timed and the command line, ``python -m torus_collectives.tuning``.
"""
