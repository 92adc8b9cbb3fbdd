"""Axis names and axis sizes, read one way everywhere.

* ``names(axis_name)``: lax's rule for an ``axis_name`` argument: a tuple or a list is
  several names, anything else (a string, an int, any other hashable) is one name.
* ``drop_unit_axes(sizes, *aligned)``: a collective over a ring of one device is the
  identity, so the backends, the tuning tables' latency floor and the group sums leave
  such axes out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

AxisName = Hashable | Sequence[Hashable]


def names(axis_name: AxisName) -> tuple:
  """``axis_name`` as a tuple of names: a tuple or list is several, anything else one."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def drop_unit_axes(sizes: Sequence[int], *aligned: Sequence) -> tuple[tuple, ...]:
  """``(sizes, *aligned)`` without the axes of size one: the entries of ``sizes`` above
  one, and of each sequence in ``aligned`` (one entry per axis, e.g. its names) those at
  the same positions. Always a tuple whose first entry is the kept sizes."""
  keep = [i for i, n in enumerate(sizes) if n > 1]
  return tuple(tuple(seq[i] for i in keep) for seq in (sizes, *aligned))
