"""Where a torus schedule's grid of chunks lies in a bucket of separate leaves.

The flat kernels (``torus_kernels``) lay the grid over one packed buffer, which costs the
caller a concatenation before and a slice after: every gradient byte read and written
twice more. The leaf kernels (``leaf_kernels``) take the bucket's leaves as they are, in
their own shapes: no reshape either, since XLA moves a reshape through the ops around it
and then fuses them differently (compiled, the 2-D views of ResNet-50's kernels kept the
converts of the bfloat16 weight gradients out of their convolutions and split the LARS
norms into more fusions). A leaf is cut along its second-minor dimension (a convolution
kernel's input channels, a dense kernel's rows), every leading dimension whole, in
*units* of one native tile (8 rows for 32-bit types, 16 for 16-bit ones): every piece a
DMA moves is a window ``leaf[..., a:b, :]`` that starts and ends on a tile.

Each leaf is cut on its own, hierarchically, in the order a stream visits the torus axes
(``schedule``): first into the schedule's streams, then each stream's part along the axis
of its first reduce-scatter phase, each of those along the next phase's axis, and so on.
At every level a block of ``u`` units is cut into ``n`` consecutive parts, each holding
``u // n`` units and ``u % n`` of them one more (``split``). So:

* the slab a phase moves (the part at index ``x`` along the phase's axis, inside the
  block this device owns after the earlier phases) is one window of each leaf: one DMA
  per leaf and transfer, whatever the number of devices;
* at every level a part has one of two sizes, ``lo`` or ``lo + 1`` units (a block of
  ``a`` or ``a + 1`` units cut into ``n`` gives ``a // n`` or ``a // n + 1``), so a DMA
  has one of two static shapes, chosen under a ``pl.when`` on the traced size
  (``size_bounds``);
* the same function (``piece``) gives a part's range from static indices (the reference,
  the tests) and from traced ones (inside a kernel).

A small leaf the grid cannot cut (a vector, a stem convolution's kernel of 3 input
channels: fewer than two dimensions, or a second-minor one that is no whole number of
tiles) is *whole*: one unit, the whole array, which one part holds and one DMA moves
(``LeafGrid.is_whole``). Its bytes cross the same links as a cut leaf's, carried by one
device a hop instead of spread over all (the rotations below spread a bucket's whole
leaves over the devices). So a model's vectors go to the kernels where they lie, as its
kernels do, with no concatenation into one more leaf.

A leaf with fewer units than the grid has parts of zero units; they move nothing. Each
leaf's extra units start where the previous leaf's ended (``LeafGrid.path``'s rotations),
so a bucket of small leaves spreads over the parts. The balance is by units, and units of
different leaves differ in size: on a large torus the finest parts (what the last phase
moves) are uneven.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from torus_collectives import schedule as schedule_lib

# The largest leaf the kernels take whole (``LeafGrid.is_whole``): a receiver adds it in
# one VMEM block of its own shape, and one device carries it a hop.
WHOLE_BYTES = 64 * 1024


def unit_rows(itemsize: int) -> int:
  """Rows in one native tile of a ``itemsize``-byte type: the unit a leaf is cut in."""
  return max(8, 32 // itemsize)


def _extras_before(index, n: int, extras: int, rotation: int):
  """How many of parts ``0 .. index - 1`` of ``n`` hold an extra unit, the extras being
  the ``extras`` parts from ``rotation`` on, cyclically."""
  if isinstance(index, int):
    return sum(((j - rotation) % n) < extras for j in range(index))
  clamp = lambda v, hi: jnp.minimum(jnp.maximum(v, 0), hi)
  wrapped = max(rotation + extras - n, 0)  # extras that wrap around to parts 0, 1, ...
  return clamp(index - rotation, extras - wrapped) + jnp.minimum(index, wrapped)


def kernel_view(shape: Sequence[int], itemsize: int) -> str | None:
  """How the leaf kernels take an array of ``shape``: ``"as is"``; ``"transposed"``
  (its two minor dimensions swapped), for an array whose minor dimension is no multiple of
  128 over a second-minor one that is, which XLA's TPU compiler lays out minor dimension
  first (a dense kernel of 1000 classes; ``tests/test_leaf_kernels.py`` checks the rule
  against the compiler), so that the swap is a bitcast; ``"whole"``, as is and moved
  whole (``LeafGrid.is_whole``: a vector, or a cut dimension that is no whole number of
  tiles, up to ``WHOLE_BYTES``); or None: not at all (a scalar, an 8-bit type, a larger
  leaf that cannot be cut), to be packed."""
  if itemsize not in (2, 4) or 0 in shape or not shape:
    return None
  if len(shape) >= 2:
    transposed = shape[-1] % 128 and not shape[-2] % 128
    cut = shape[-1] if transposed else shape[-2]
    if not cut % unit_rows(itemsize):
      return "transposed" if transposed else "as is"
  return "whole" if math.prod(shape) * itemsize <= WHOLE_BYTES else None


def split(units: int, n: int, index, rotation: int = 0):
  """``(offset, size)`` in units of part ``index`` of ``n`` consecutive parts of a block of
  ``units`` (static ints): every part holds ``units // n`` units, and the ``units % n``
  parts from ``rotation`` on (cyclically) one more. ``index`` may be a traced int32
  scalar."""
  q, r = divmod(units, n)
  rotation %= n
  before = _extras_before(index, n, r, rotation)
  if isinstance(index, int):
    return index * q + before, q + (((index - rotation) % n) < r)
  extra = (lax.rem(index - rotation + n, n) < r).astype(jnp.int32)
  return index * q + before, q + extra


def piece(units: int, path: Sequence[tuple[int, object, int]]):
  """``(offset, size)`` in units of the part reached by cutting a leaf of ``units`` along
  ``path``, a sequence of ``(parts, index, rotation)``: the ``index``-th of ``parts`` at
  each level, the extra units starting at part ``rotation``.

  Indices may be traced; then so are the results. A traced block size is one of two
  static values (``size_bounds``), so each level cuts both statically and selects,
  without a division on the kernel's scalar unit."""
  offset, size, bounds = 0, units, (units, units)
  for n, index, rotation in path:
    if isinstance(size, int) and isinstance(index, int):
      at, size = split(size, n, index, rotation)
    else:
      (at_lo, size_lo), (at_hi, size_hi) = (split(b, n, index, rotation) for b in bounds)
      is_lo = size == bounds[0]
      at, size = jnp.where(is_lo, at_lo, at_hi), jnp.where(is_lo, size_lo, size_hi)
    offset = offset + at
    bounds = (bounds[0] // n, -(-bounds[1] // n))
  return offset, size


def size_bounds(units: int, parts: Sequence[int]) -> tuple[int, int]:
  """The fewest and most units a part reached by cutting ``units`` into ``parts[0]``, then
  each of those into ``parts[1]``, ... may hold; the two differ by at most one."""
  lo = hi = units
  for n in parts:
    lo, hi = lo // n, -(-hi // n)
  return lo, hi


@dataclasses.dataclass(frozen=True)
class LeafGrid:
  """A schedule's grid over a bucket of leaves of ``shapes`` (two or more dimensions, the
  second-minor a whole number of units; or whole, ``is_whole``) and ``itemsize`` bytes per
  element.

  A stream ``s`` cuts each leaf first into ``num_streams`` parts (``s`` its own), then
  along the axes of its reduce-scatter phases in their order (``axis_order``).
  """

  shapes: tuple[tuple[int, ...], ...]
  itemsize: int
  schedule: schedule_lib.Schedule

  def __post_init__(self):
    for leaf, shape in enumerate(self.shapes):
      if not shape or 0 in shape:
        raise ValueError(f"a leaf needs one or more dimensions, none empty, got {shape}")
      if self.is_whole(leaf) and math.prod(shape) * self.itemsize > WHOLE_BYTES:
        raise ValueError(
          f"a leaf of {shape} is cut along a second-minor dimension that is a multiple of "
          f"{self.unit}, or taken whole up to {WHOLE_BYTES} bytes; pack it instead"
        )

  @property
  def unit(self) -> int:
    return unit_rows(self.itemsize)

  def is_whole(self, leaf: int) -> bool:
    """Whether leaf ``leaf`` is one unit, moved whole (module doc): fewer than two
    dimensions, or a second-minor one that is no whole number of tiles."""
    shape = self.shapes[leaf]
    return len(shape) < 2 or bool(shape[-2] % self.unit)

  def units(self, leaf: int) -> int:
    return 1 if self.is_whole(leaf) else self.shapes[leaf][-2] // self.unit

  def axis_order(self, stream: int) -> tuple[int, ...]:
    """The torus axes stream ``stream`` reduce-scatters along, in order (the all-gather
    visits them backwards)."""
    phases = self.schedule.streams[stream]
    order = [p.axis for p in phases if p.kind == "reduce_scatter"]
    if not order:  # an all-gather schedule: its phases retrace the scatter backwards
      order = [p.axis for p in phases][::-1]
    return tuple(order)

  def path(
    self, leaf: int, stream: int, coords: Sequence, axis: int, index
  ) -> list[tuple[int, object, int]]:
    """The cut of leaf ``leaf`` that reaches part ``index`` along torus axis ``axis`` of
    the block owned, on the axes ``stream`` visits before ``axis``, by the device at
    ``coords`` (``piece``'s path, with each level's rotation)."""
    order = self.axis_order(stream)
    levels = [(self.schedule.num_streams, stream)]
    levels += [(self.schedule.torus[a], coords[a]) for a in order[: order.index(axis)]]
    levels.append((self.schedule.torus[axis], index))
    parts = [n for n, _ in levels]
    return [(n, i, self._rotation(leaf, parts[: k + 1])) for k, (n, i) in enumerate(levels)]

  def _rotation(self, leaf: int, parts: Sequence[int]) -> int:
    """Where leaf ``leaf``'s extra units start at the level cut into ``parts[-1]``: after
    the earlier leaves' extras there (counted at their smaller block size), so that the
    extras of a bucket's leaves go round the parts instead of all to the first ones."""
    n = parts[-1]
    return sum(size_bounds(self.units(j), parts[:-1])[0] % n for j in range(leaf)) % n

  def bounds(self, leaf: int, stream: int, axis: int) -> tuple[int, int]:
    """``size_bounds`` of leaf ``leaf``'s parts along ``axis`` in stream ``stream``."""
    order = self.axis_order(stream)
    parts = [self.schedule.num_streams]
    parts += [self.schedule.torus[a] for a in order[: order.index(axis) + 1]]
    return size_bounds(self.units(leaf), parts)

  def slot_units(self, leaf: int) -> int:
    """The most units of leaf ``leaf`` one transfer of any stream moves: a receive slot's
    rows, in units (the first phase's parts are the largest)."""
    return max(
      (self.bounds(leaf, s, self.axis_order(s)[0])[1] for s in range(self.schedule.num_streams)),
      default=0,
    )

  def elements(self, leaf: int) -> int:
    return math.prod(self.shapes[leaf])


def all_reduce_grids(
  shapes: Sequence[Sequence[int]], itemsize: int, torus: Sequence[int]
) -> tuple[LeafGrid, LeafGrid]:
  """The grids of an all-reduce of leaves of ``shapes`` over ``torus``: the
  reduce-scatter's and the all-gather's of ``schedule.default_variant(torus)``, which cut
  every leaf alike, so the all-gather sends each device's parts from where the
  reduce-scatter left them."""
  shapes = tuple(tuple(s) for s in shapes)
  variant = schedule_lib.default_variant(torus)
  reduce, gather = (
    LeafGrid(shapes, itemsize, schedule_lib.build(kind, torus, variant))
    for kind in ("reduce_scatter", "all_gather")
  )
  return reduce, gather
