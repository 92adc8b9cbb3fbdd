"""Replica groups that are contiguous tiles of the torus, and sums across them.

Distributed batch norm sums its per-channel statistics over a small group of replicas
rather than the whole mesh. A group here is a tile: a sub-box of the named mesh axes with
extent ``t_a`` along axis ``a``, where every ``t_a`` divides the axis size ``n_a``, and the
tiles are aligned (replica ``i`` along axis ``a`` belongs to tile ``i // t_a``).

``group_size`` names a tile by its replica count, filled along the last named axis first:
on a 2x4 mesh with axes ("x", "y"), 2 -> (1, 2), 4 -> (1, 4), 8 -> (2, 4). A tuple gives
the tile shape explicitly.

The sum inside a tile is latency-bound (a few per-channel vectors), so it takes as few
steps as possible:

* an axis the tile spans whole: one all-reduce over all such axes together;
* an axis the tile covers partly: recursive doubling, ``log2(t_a)`` exchanges with the XOR
  partner ``i ^ 2**k`` (``lax.ppermute``). Partners never leave an aligned tile when
  ``t_a`` is a power of two, which is therefore required of partial extents (torus axes
  are powers of two on every TPU slice this targets). ``a + b`` is commutative in IEEE
  arithmetic, so both partners, and hence every replica of the tile, hold identical bits.

Every function here runs inside ``jax.shard_map`` (or another context that binds the axes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax

from torus_collectives.collectives import all_reduce

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


def _is_valid_tile(tile: Sequence[int], sizes: Sequence[int]) -> bool:
  return len(tile) == len(sizes) and all(t in _valid_extents(n) for t, n in zip(tile, sizes))


def valid_group_sizes(sizes: Sequence[int]) -> list[int]:
  """Every int ``group_size`` that names a valid tile on a mesh of these axis sizes."""
  return [
    g
    for g in range(1, math.prod(sizes) + 1)
    if (tile := _fill_last_axis_first(g, sizes)) and _is_valid_tile(tile, sizes)
  ]


def resolve_tile(group_size: GroupSize, sizes: Sequence[int]) -> tuple[int, ...]:
  """The tile shape (one extent per axis) that ``group_size`` names on axes of ``sizes``.

  Raises:
    ValueError: if ``group_size`` does not name an aligned tile of the mesh.
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
    if group_size >= 1 and tile and _is_valid_tile(tile, sizes):
      return tile
    raise ValueError(
      f"{group_size=} is not a tile of the mesh with axis sizes {sizes} (filled along the "
      f"last axis first); valid group sizes: {valid_group_sizes(sizes)}, or None for the "
      "whole mesh."
    )
  tile = tuple(group_size)
  if _is_valid_tile(tile, sizes):
    return tile
  raise ValueError(
    f"group_size={tile} is not a tile of the mesh with axis sizes {sizes}: give one "
    "extent per named axis that divides the axis size and is either the whole axis or a "
    f"power of two; valid extents per axis: {[_valid_extents(n) for n in sizes]}."
  )


def _xor_exchange_sum(x, axis: str, size: int, extent: int):
  """Sum of ``x`` over aligned blocks of ``extent`` replicas along ``axis``."""
  distance = 1
  while distance < extent:
    perm = [(i, i ^ distance) for i in range(size)]
    x = jax.tree.map(lambda v, perm=perm: v + lax.ppermute(v, axis, perm), x)
    distance *= 2
  return x


def group_sum(x, axis_names: Sequence[str], tile: Sequence[int]):
  """Sums the pytree ``x`` over the replicas of each tile (``tile`` from ``resolve_tile``).

  Whole axes go through one torus all-reduce (``tc.all_reduce``); partial axes through
  recursive doubling.
  """
  axis_names = tuple(axis_names)
  sizes = tuple(lax.axis_size(a) for a in axis_names)
  whole = tuple(a for a, t, n in zip(axis_names, tile, sizes) if t == n and n > 1)
  if whole:
    x = jax.tree.map(lambda v: all_reduce(v, whole), x)
  for axis, extent, size in zip(axis_names, tile, sizes):
    if 1 < extent < size:
      x = _xor_exchange_sum(x, axis, size, extent)
  return x
