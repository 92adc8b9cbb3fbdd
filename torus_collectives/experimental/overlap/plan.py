"""The threaded summation's plan: every decision it makes about one traced
``value_and_grad``, computed from the program's equations alone, before anything runs.

``make_plan`` gives a frozen, printable ``Plan``: the order the equations are evaluated in
(``leaves_first``), the buckets (``packing.buckets_by_size`` in the order the leaves are
computed, the last cut at the last heavy equation: ``cut_last_bucket``), where each starts
(``ready_after``), which equations run after the last call issued (``pinned``), and the
advance points between which each bucket's calls are spread (``advance_points``; a bucket's
``windows``). The tail's decisions (the units it evaluates one at a time, their work, the
spacing of the calls over it) are pure functions here too (``units``, ``unit_work``,
``call_spacing``); the executor (``executor``) applies them. The algorithm is described in
the package's docstring (``torus_collectives.experimental.overlap``), steps 2 to 5.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from torus_collectives import packing

# The equations whose work a window between two collective calls holds: the backward
# pass's convolutions and matmuls (everything else is cheap beside them).
HEAVY = frozenset({"conv_general_dilated", "dot_general"})
# Run after the last call issued (the package docstring, step 4): the heavy equations only.
# A batch norm's backward sums read the convolution's output, and XLA fuses them into it;
# pinned apart they ran as fusions of their own (the design log's figures), so they are left
# to follow their convolution into its window.
PINNED = HEAVY
# The reductions of the tail's units (``units``): a trust ratio's norms.
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# Equations that move no data of their own (XLA makes them bitcasts or fuses them).
MOVES_NO_DATA = frozenset(
  "reshape squeeze expand_dims broadcast_in_dim convert_element_type transpose copy copy_p".split()
)
# What lays an input out for a convolution without computing on it (``is_computed``).
LAID_OUT = MOVES_NO_DATA | {"rev"}


@dataclasses.dataclass(frozen=True)
class Plan:
  """The decisions for one traced ``value_and_grad`` (``make_plan``). ``order``: the
  inlined equations' indices in the order they are evaluated (``leaves_first``); every
  other position indexes that order. Leaf numbers index the gradient's flat leaves.

  ``buckets``: the leaf numbers of each bucket, in start order. ``ready_after``: per
  bucket, the position of the equation after which its last leaf exists (-1: before any
  equation), where its split collective starts. ``heavy``: the positions of the heavy
  equations. ``pinned``: the positions of the equations that run after the last call
  issued (the package docstring, step 4: the ``PINNED`` ones once a bucket is in
  flight). ``points``: the advance points (``advance_points``)."""

  order: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]
  ready_after: tuple[int, ...]
  heavy: tuple[int, ...]
  pinned: tuple[int, ...]
  points: tuple[int, ...]

  def windows(self, bucket: int) -> tuple[int, ...]:
    """The advance points after bucket ``bucket`` starts: its calls are spread over them."""
    return tuple(p for p in self.points if p > self.ready_after[bucket])

  def __str__(self) -> str:
    lines = [
      f"Plan: {len(self.order)} equations, {len(self.buckets)} buckets, "
      f"{len(self.heavy)} heavy equations, "
      f"{len(self.pinned)} pinned, {len(self.points)} advance points"
    ]
    for b, (bucket, ready) in enumerate(zip(self.buckets, self.ready_after)):
      lines.append(
        f"  bucket {b}: leaves {list(bucket)}, starts after equation {ready}, "
        f"{len(self.windows(b))} windows"
      )
    return "\n".join(lines)


def make_plan(eqns, outs, grad_leaves: Sequence, bucket_bytes: float) -> Plan:
  """The plan for the inlined equations ``eqns`` of a ``value_and_grad`` whose outputs
  ``outs`` end with the gradient's leaves (``grad_leaves``: their shapes and dtypes); its
  positions index ``eqns`` in ``Plan.order``."""
  grad_atoms = outs[len(outs) - len(grad_leaves) :]
  evaluation = leaves_first(eqns, grad_atoms)
  eqns = [eqns[i] for i in evaluation]
  produced_at = {key: position for position, item in enumerate(eqns) for key in item.outs}
  where = [produced_at.get(a, -1) if isinstance(a, int) else -1 for a in grad_atoms]
  order = sorted(range(len(grad_atoms)), key=lambda i: (where[i], i))
  buckets = packing.buckets_by_size(grad_leaves, bucket_bytes, order)
  heavy = [i for i, item in enumerate(eqns) if item.eqn.primitive.name in HEAVY]
  if buckets and heavy:  # what exists only after the last heavy equation travels alone
    buckets[-1:] = cut_last_bucket(buckets[-1], where, heavy[-1])
  ready_after = [max(where[i] for i in bucket) for bucket in buckets]
  first_start = min(ready_after, default=len(eqns))
  leaf_keys = {a for a in grad_atoms if isinstance(a, int)}
  pinned = [
    i for i, item in enumerate(eqns) if i > first_start and item.eqn.primitive.name in PINNED
  ]
  return Plan(
    order=tuple(evaluation),
    buckets=tuple(tuple(bucket) for bucket in buckets),
    ready_after=tuple(ready_after),
    heavy=tuple(heavy),
    pinned=tuple(pinned),
    points=tuple(advance_points(eqns, leaf_keys, first_start)),
  )


def leaves_first(eqns, grad_atoms) -> list[int]:
  """The indices of ``eqns`` in the order the executor evaluates them: for each gradient
  leaf (``grad_atoms``) in the order the program computes them, what it needs that is not
  evaluated yet, in program order. What no leaf needs (the loss value's last steps, say)
  comes right after the last thing it reads, so it is not left for after the backward
  pass. A valid order: everything comes after what it reads, and equations with effects
  keep their program order among themselves.

  Why: a pinned equation runs after the last call issued when it is evaluated, and an
  advance point is a leaf computed from pinned work evaluated since the previous one. In
  program order a layer's input-gradient convolution may come before the same layer's
  weight gradient; it is then pinned behind the call before that leaf's point, and the
  batch norm gradients computed from it open no window of their own (ResNet-50's
  backward pass then has half the windows, each of two convolutions). Leaves first, it is
  evaluated after that point, in the window that the batch norm's gradients close, so
  nearly every window holds one convolution and no reduction needs pinning to hold a
  window."""
  producer = {key: position for position, item in enumerate(eqns) for key in item.outs}
  effectful = [i for i, item in enumerate(eqns) if item.eqn.effects]
  # An equation with effects (a callback, a print, a collective's axis effect) also reads
  # the one before it, so that effects keep their program order.
  previous_effect = dict(itertools.pairwise(reversed(effectful)))

  def reads(i):
    found = [producer[a] for a in eqns[i].ins if isinstance(a, int) and a in producer]
    return found + ([previous_effect[i]] if i in previous_effect else [])

  leaves = sorted({producer[a] for a in grad_atoms if isinstance(a, int) and a in producer})
  groups = []
  taken: set[int] = set()
  for leaf in leaves:
    needed, stack = set(), [leaf]
    while stack:
      i = stack.pop()
      if i not in taken and i not in needed:
        needed.add(i)
        stack.extend(reads(i))
    taken |= needed
    groups.append(sorted(needed))
  order = [i for group in groups for i in group]
  for i in range(len(eqns)):  # what no leaf needs: right after the last thing it reads
    if i not in taken:
      order.insert(max((order.index(j) for j in reads(i)), default=-1) + 1, i)
  return order


def cut_last_bucket(bucket: list[int], positions, boundary: int) -> list[list[int]]:
  """``bucket`` cut in two: its leaves whose ``positions`` lie before ``boundary``, then
  the others (either part left out when empty). The summation's last bucket is cut at
  the last heavy equation, so that the part with nothing to overlap (the first layer's
  gradients, produced by the last backward convolution) is only what must be: a full
  bucket there would be exposed whole."""
  before = [i for i in bucket if positions[i] < boundary]
  after = [i for i in bucket if positions[i] >= boundary]
  return [part for part in (before, after) if part]


def advance_points(eqns, leaf_keys, first_start: int) -> list[int]:
  """The positions after ``first_start`` of the equations that compute a gradient leaf
  from a ``PINNED`` equation evaluated since the previous such position (directly, or
  through what derives from it): where the calls may advance, so that each window
  between two of them holds work that runs after its first call."""
  window: set[int] = set()
  points = []
  for position, item in enumerate(eqns):
    if position <= first_start:
      continue
    if item.eqn.primitive.name in PINNED or any(
      isinstance(a, int) and a in window for a in item.ins
    ):
      window.update(item.outs)
      if any(k in leaf_keys for k in item.outs):
        points.append(position)
        window.clear()
  return points


def call_points(hop_bytes: Sequence[float], windows: Sequence[int]) -> list[int | None]:
  """The advance point at which a collective issues each call after its first, given the
  bytes its hops move (``hop_bytes``: hop ``i`` is started by call ``i``, and call ``i + 1``
  waits for it) and the points it was started before (``windows``).

  Each hop is given a run of consecutive windows, one at least, and the call that waits
  for it is issued at the last point of its run. The windows beyond one a hop go, one at a
  time, to the hop with the most bytes per window so far (water-filling): no hop has fewer
  windows than a smaller one, and a hop that moves sixteen times the bytes of another (a
  2-D torus's first phase against its second) gets more time to hide in, where an even
  spread gives both one window. With fewer windows than hops, one call a window and the
  rest at the end (None); the last call is issued at the last point."""
  hops, count = len(hop_bytes), len(windows)
  if not hops:
    return []
  if count < hops:
    return [*windows, *[None] * (hops - count)]
  runs = [1] * hops
  for _ in range(count - hops):
    widest = max(range(hops), key=lambda i: (hop_bytes[i] / runs[i], -i))
    runs[widest] += 1
  ends = itertools.accumulate(runs)
  return [windows[end - 1] for end in ends]


def is_computed(key, producer) -> bool:
  """Whether ``key`` is computed by an equation other than a layout change (``LAID_OUT``),
  through any such changes: not a program input or constant moved into place."""
  item = producer.get(key) if isinstance(key, int) else None
  while item is not None and item.eqn.primitive.name in LAID_OUT:
    key = item.ins[0]
    item = producer.get(key) if isinstance(key, int) else None
  return item is not None


def units(eqns, outputs, producer) -> list[tuple[int, ...]]:
  """What the tail evaluates one at a time, in the order it returns its ``outputs``: each
  output, after the reductions in its cone that no earlier unit holds (together, one unit:
  XLA fuses the reductions of one leaf, a trust ratio's two norms, into one pass). A
  reduction's scalar result cannot fuse into the elementwise work that reads it, so the
  window can close between them at no cost, and a large leaf's update (one norm pass, one
  update pass) gives two windows, not one. An output that earlier units compute whole (a
  momentum, computed for its parameter's update) joins the last of them, in the same
  window, where XLA computes both in one pass."""
  units: list[tuple[int, ...]] = []
  claimed: set[int] = set()
  unit_of: dict[int, int] = {}  # equation -> the unit that computes it
  for key in outputs:
    needed = cone(key, eqns, producer)
    if all(i in unit_of for i in needed):
      last = max(unit_of[i] for i in needed)
      units[last] += (key,)
      continue
    reductions = [
      i
      for i in needed
      if i not in claimed and eqns[i].eqn.primitive.name in REDUCTIONS and eqns[i].outs[0] != key
    ]
    claimed.update(reductions)
    if reductions:
      units.append(tuple(eqns[i].outs[0] for i in reductions))
      for i in {j for r in reductions for j in cone(eqns[r].outs[0], eqns, producer)}:
        unit_of.setdefault(i, len(units) - 1)
    units.append((key,))
    for i in needed:
      unit_of.setdefault(i, len(units) - 1)
  return units


def unit_work(eqns, units, cones, producer) -> dict[tuple[int, ...], float]:
  """Each unit's work, for spacing the calls: the bytes its keys hold, a reduction's those
  of the array it reduces, where its cone holds an equation no earlier unit's does (the
  momentum an update's cone computed holds none: it is done by then), else 0."""
  avals = {k: v.aval for item in eqns for k, v in zip(item.outs, item.eqn.outvars)}

  def nbytes(key):
    item = eqns[producer[key]]
    if item.eqn.primitive.name in REDUCTIONS:
      aval = item.eqn.invars[0].aval
    else:
      aval = avals[key]
    return math.prod(aval.shape) * aval.dtype.itemsize

  seen: set[int] = set()
  work = {}
  for unit in units:
    fresh = set(cones[unit]) - seen
    seen |= fresh
    work[unit] = float(sum(nbytes(key) for key in unit)) if fresh else 0.0
  return work


def cone(key, eqns, producer) -> list[int]:
  """The positions of the equations ``key`` is computed from, in program order."""
  found, stack = set(), [key]
  while stack:
    i = producer.get(stack.pop())
    if i is None or i in found:
      continue
    found.add(i)
    stack.extend(a for a in eqns[i].ins if isinstance(a, int))
  return sorted(found)


def call_spacing(unit_work, unit_needs, calls_left) -> list[float]:
  """The tail's work (``unit_work``) that each collective in flight lets pass between
  two of its calls.

  The collectives are taken to finish in the order of their calls left (fewest first).
  What can cover collective ``c``'s calls is the units that need none of the sums of
  ``c`` and of the collectives finishing after it (``unit_needs``: the collectives'
  indices each unit reads), evaluated in their order. Their work is lumpy (a convolution
  kernel's update beside a batch norm scale's), so the spacing is fitted to it
  (``fitted_spacing``): the largest that still closes a window for each of ``c``'s
  calls, so that none is left to issue back to back after that work. 1 (a call after
  every unit with work) where nothing can cover them; infinite for a collective with no
  calls left."""
  order = sorted(range(len(calls_left)), key=lambda i: calls_left[i])
  spacing = [math.inf] * len(calls_left)
  for rank, c in enumerate(order):
    if not calls_left[c]:
      continue
    later = set(order[rank:])
    free = [w for w, needs in zip(unit_work, unit_needs) if w and not needs & later]
    spacing[c] = fitted_spacing(free, calls_left[c])
  return spacing


def fitted_spacing(work: list[float], windows: int) -> float:
  """The largest spacing at which ``work`` (positive, in order) closes at least
  ``windows`` windows, a window closing once the work in it reaches the spacing; the
  smallest of ``work`` where even that closes fewer (one window a unit), 1 where there is
  none. Found by bisection: fewer windows close the larger the spacing."""
  if not work:
    return 1.0
  low, high = min(work), sum(work)
  if windows_closed(work, low) < windows:
    return low
  if windows_closed(work, high) >= windows:
    return high
  for _ in range(60):  # low closes enough windows, high too few
    middle = (low + high) / 2
    low, high = (middle, high) if windows_closed(work, middle) >= windows else (low, middle)
  return low


def windows_closed(work: list[float], spacing: float) -> int:
  """How many windows ``work`` (in order) closes at ``spacing``: a window closes once the
  work in it reaches the spacing (what is left after the last is no window)."""
  count, since = 0, 0.0
  for w in work:
    since += w
    if since >= spacing:
      count, since = count + 1, 0.0
  return count
