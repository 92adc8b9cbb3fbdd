"""Replica groups that are contiguous tiles of the torus.

Distributed batch norm sums its per-channel statistics over a small group of replicas
rather than the whole mesh, and the torus collectives run ``axis_index_groups`` that are
such groups. A group here is a tile: a sub-box of the named mesh axes with extent ``t_a``
along axis ``a``, where every ``t_a`` divides the axis size ``n_a``, and the tiles are
aligned (replica ``i`` along axis ``a`` belongs to tile ``i // t_a``).

``group_size`` names a tile by its replica count, filled along the last named axis first:
on a 2x4 mesh with axes ("x", "y"), 2 -> (1, 2), 4 -> (1, 4), 8 -> (2, 4). A tuple gives
the tile shape explicitly (``resolve_tile``). ``tile_of_groups`` reads the tile back off
explicit ``axis_index_groups``. The sum over the replicas of each tile is
``collectives.group_sum``.

Everything here is arithmetic on axis sizes and replica indices: no collectives.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

GroupSize = int | Sequence[int] | None


def _is_int(value) -> bool:
  """An int, but not a bool (``True`` is not a group of one)."""
  return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _valid_extents(size: int) -> list[int]:
  """Tile extents allowed along an axis of ``size`` replicas."""
  return [t for t in range(1, size + 1) if size % t == 0 and (t == size or _is_power_of_two(t))]


def _fill_last_axis_first(group_size: int, sizes: Sequence[int]) -> tuple[int, ...] | None:
  """The tile of ``group_size`` replicas filled along the last axis first, or None."""
  tile = []
  remaining = group_size
  for size in reversed(sizes):
    if remaining >= size:
      if remaining % size:
        return None
      tile.append(size)
      remaining //= size
    else:
      tile.append(remaining)
      remaining = 1
  if remaining != 1:
    return None
  return tuple(reversed(tile))


def is_valid_tile(tile: Sequence[int], sizes: Sequence[int]) -> bool:
  """Whether ``tile`` is a tile of axes of ``sizes``: one extent per axis, each dividing
  its axis and either the whole axis or a power of two."""
  return len(tile) == len(sizes) and all(t in _valid_extents(n) for t, n in zip(tile, sizes))


def valid_group_sizes(sizes: Sequence[int]) -> list[int]:
  """Every int ``group_size`` that names a valid tile on a mesh of these axis sizes."""
  return [
    g
    for g in range(1, math.prod(sizes) + 1)
    if (tile := _fill_last_axis_first(g, sizes)) and is_valid_tile(tile, sizes)
  ]


def resolve_tile(group_size: GroupSize, sizes: Sequence[int]) -> tuple[int, ...]:
  """The tile shape (one extent per axis) that ``group_size`` names on axes of ``sizes``.

  A tile is a group of replicas: a sub-box of the named axes with extent ``t_a`` along
  axis ``a``, where ``t_a`` divides the axis size ``n_a`` and is either ``n_a`` or a power
  of two, and the tiles are aligned (replica ``i`` along axis ``a`` is in tile
  ``i // t_a``). ``batch_norm(group_size=...)`` resolves its argument with this, and
  ``group_sum`` sums over the tiles it returns.

  Args:
    group_size: None for the whole mesh; an int, the replicas per group, filled along
      the last axis first (on axes of sizes ``(2, 4)``: 2 is ``(1, 2)``, 4 is ``(1, 4)``,
      8 is ``(2, 4)``); or a sequence of ints, the tile shape itself, one extent per axis.
    sizes: the sizes of the named mesh axes, in order, e.g. ``(2, 4)``.

  Returns:
    The tile's extent along each axis, a tuple as long as ``sizes`` (``sizes`` itself for
    None).

  Raises:
    TypeError: ``group_size`` is not None, an int or a sequence of ints (a bool
      included).
    ValueError: ``group_size`` does not name an aligned tile of the mesh; the message
      lists the valid group sizes, or the valid extents per axis.
  """
  sizes = tuple(sizes)
  if group_size is None:
    return sizes
  if not _is_int(group_size) and not (
    isinstance(group_size, Sequence) and all(_is_int(t) for t in group_size)
  ):
    raise TypeError(
      f"group_size must be None, an int (replicas per group) or a tuple of ints (the tile "
      f"shape, one extent per named axis), got {group_size!r}"
    )
  if _is_int(group_size):
    tile = _fill_last_axis_first(group_size, sizes)
    if group_size >= 1 and tile and is_valid_tile(tile, sizes):
      return tile
    raise ValueError(
      f"{group_size=} is not a tile of the mesh with axis sizes {sizes} (filled along the "
      f"last axis first); valid group sizes: {valid_group_sizes(sizes)}, or None for the "
      "whole mesh."
    )
  tile = tuple(group_size)
  if is_valid_tile(tile, sizes):
    return tile
  raise ValueError(
    f"group_size={tile} is not a tile of the mesh with axis sizes {sizes}: give one "
    "extent per named axis that divides the axis size and is either the whole axis or a "
    f"power of two; valid extents per axis: {[_valid_extents(n) for n in sizes]}."
  )


def _group_tiles(tile: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
  """The aligned tiles of ``tile`` on axes of ``sizes``, as row-major linear indices."""
  grid = np.arange(math.prod(sizes)).reshape(sizes)
  blocks = grid.reshape([d for n, t in zip(sizes, tile) for d in (n // t, t)])
  k = len(sizes)
  order = list(range(0, 2 * k, 2)) + list(range(1, 2 * k, 2))
  return [tuple(g) for g in blocks.transpose(order).reshape(-1, math.prod(tile)).tolist()]


def _replica_lists(groups) -> list[tuple[int, ...]] | None:
  """``groups`` as tuples of replica indices, or None where they are not lists of ints."""
  try:
    return [tuple(int(i) for i in g) for g in groups]
  except (TypeError, ValueError):
    return None


def tile_of_groups(groups, sizes: Sequence[int], ordered: bool) -> tuple[int, ...] | None:
  """The tile shape whose aligned tiles on axes of ``sizes`` are exactly ``groups`` (each
  listed row-major when ``ordered``), or None (also where ``groups`` is not a list of
  lists of replica indices)."""
  sizes = tuple(sizes)
  replicas = _replica_lists(groups)
  if not replicas or any(len(g) != len(replicas[0]) for g in replicas):
    return None
  key = (lambda g: g) if ordered else (lambda g: tuple(sorted(g)))
  wanted = sorted(map(key, replicas))
  divisors = [[t for t in range(1, n + 1) if n % t == 0] for n in sizes]
  for tile in itertools.product(*divisors):
    if math.prod(tile) != len(replicas[0]):
      continue
    if sorted(map(key, _group_tiles(tile, sizes))) == wanted:
      return tile
  return None
