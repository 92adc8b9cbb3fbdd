"""Byte counts as text, in binary units: ``"64 KiB"``, ``"16 MiB"``, and back.

One spelling for the tables, the tuner's command line and its reports, and the benchmarks.
"""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30
_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def size_label(nbytes: int, sep: str = " ") -> str:
  """``nbytes`` in the largest binary unit it fills, to three significant digits, e.g.
  ``"1 MiB"``, ``"1.5 KiB"``, ``"512 B"``; ``sep`` goes between number and unit."""
  for unit, scale in _UNITS:
    if nbytes >= scale:
      return f"{nbytes / scale:.3g}{sep}{unit}"
  return f"{nbytes}{sep}B"


def parse_size(text: str) -> int:
  """Bytes from ``"16MiB"``, ``"1.5 GiB"``, ``"512B"`` or a plain number of bytes."""
  for unit, scale in (*_UNITS, ("B", 1)):
    if text.endswith(unit):
      return int(float(text[: -len(unit)]) * scale)
  return int(text)
