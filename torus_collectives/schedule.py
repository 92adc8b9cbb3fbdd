"""The torus collective algorithms as data.

Every device holds a buffer that is viewed as a grid of chunks, one grid axis per torus
axis (in the order the caller names the axes, any number of them), so chunk ``(c0, c1, c2)``
is the one that ``lax.psum_scatter(..., (axis0, axis1, axis2))`` hands to the device at mesh
coordinates ``(c0, c1, c2)`` (row-major over the tuple). Each chunk is further split into
``len(streams)`` equal slices; stream ``k`` carries slice ``k`` of every chunk, independently
of the others.

A stream is a sequence of ring phases. A phase runs a ring reduce-scatter or ring
all-gather of ``n - 1`` steps along one torus axis of size ``n``, in one direction:

* reduce-scatter along axis ``a``, direction ``d``, step ``s``: the device at ring position
  ``r`` sends its partial sums of the grid slab ``c_a = (r - d(s + 1)) mod n`` to ``r + d``
  and adds what it receives (slab ``(r - d(s + 2)) mod n``). After ``n - 1`` steps it holds
  the full sum of slab ``c_a = r``, and the stream's live buffer shrinks by ``n``.
* all-gather along axis ``a``, direction ``d``, step ``s``: it sends slab ``(r - d s) mod n``
  and stores slab ``(r - d(s + 1)) mod n``. After ``n - 1`` steps every slab is present.

Only the axes not yet reduced are "live" in a slab: on a 2-D torus a reduce-scatter along x
moves whole rows of the grid, a later one along y moves single chunks. The variants below
are the textbook 1-D ring, the bidirectional ring, the paper's torus (all of x, then all of
y, and so on for every axis, one direction), and the split form: the paper's two halves
(x-then-y and y-then-x over bidirectional rings) generalised to N axes. A chunk is split
into 2N parts, one per (dimension, direction); part ``(r, d)`` visits the dimensions in the
order rotated by ``r`` (``r, r+1, ..., r-1``) over rings in direction ``d``. In every step
the N rotations are on N different axes, each in both directions, so all 2N links of every
chip carry traffic (on a torus whose axes have equal sizes; otherwise the rotations drift
out of phase and some steps share a link while another idles).

The Pallas kernels, the ``shard_map`` fallback and the cost model all execute or price
these same objects. ``simulate`` is the reference executor: plain numpy over ``p`` virtual
devices.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

Kind = Literal["reduce_scatter", "all_gather"]
Collective = Literal["reduce_scatter", "all_gather", "all_reduce"]


class Variant(enum.StrEnum):
  RING = "ring"
  BIDIRECTIONAL_RING = "bidirectional_ring"
  TORUS = "torus"
  TORUS_SPLIT = "torus_split"


@dataclasses.dataclass(frozen=True)
class Phase:
  """A ring reduce-scatter or all-gather along one torus axis in one direction."""

  kind: Kind
  axis: int
  direction: int

  def __post_init__(self):
    if self.kind not in ("reduce_scatter", "all_gather"):
      raise ValueError(f"Phase kind must be reduce_scatter or all_gather, got {self.kind=}")
    if self.direction not in (1, -1):
      raise ValueError(f"Phase direction must be +1 or -1, got {self.direction=}")

  def send_slab(self, position: int, step: int, size: int) -> int:
    """Grid index (along ``axis``) that ring position ``position`` sends at ``step``."""
    shift = step + 1 if self.kind == "reduce_scatter" else step
    return (position - self.direction * shift) % size

  def recv_slab(self, position: int, step: int, size: int) -> int:
    """Grid index (along ``axis``) that ring position ``position`` receives at ``step``."""
    return self.send_slab(position - self.direction, step, size)


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One stream's move in one step: every device sends one slab to its ring neighbour."""

  stream: int
  phase: Phase
  step: int  # step within the phase, 0 .. n - 2
  live_axes: tuple[int, ...]  # grid axes not yet reduced (slab spans all of them but phase.axis)

  def slab_index(self, coords: Sequence, slab) -> tuple:
    """Index into the chunk grid of the device at ``coords`` selecting one slab: ``slab``
    along the phase's axis, everything along other live axes, the own index elsewhere."""
    index = []
    for axis, own in enumerate(coords):
      if axis == self.phase.axis:
        index.append(slab)
      elif axis in self.live_axes:
        index.append(slice(None))
      else:
        index.append(own)
    return tuple(index)

  def slab_elements(self, torus: Sequence[int], chunk_elements: int) -> int:
    """Elements moved by one device in this transfer (chunk_elements per grid chunk)."""
    others = [torus[a] for a in self.live_axes if a != self.phase.axis]
    return math.prod(others) * chunk_elements


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A collective on a torus of shape ``torus`` (one entry per named axis)."""

  torus: tuple[int, ...]
  streams: tuple[tuple[Phase, ...], ...]

  def __post_init__(self):
    if not self.torus or any(n < 1 for n in self.torus):
      raise ValueError(f"torus sizes must be positive, got {self.torus=}")
    lengths = {sum(self.torus[p.axis] - 1 for p in phases) for phases in self.streams}
    if len(lengths) != 1:
      raise ValueError(f"all streams must take the same number of steps, got {lengths}")

  @property
  def num_devices(self) -> int:
    return int(np.prod(self.torus))

  @property
  def num_streams(self) -> int:
    return len(self.streams)

  @property
  def num_steps(self) -> int:
    return sum(self.torus[p.axis] - 1 for p in self.streams[0])

  def stream_transfers(self, stream: int) -> list[Transfer]:
    """The transfers of one stream, in order, one per step."""
    live = set(range(len(self.torus)))
    if self.streams[stream] and self.streams[stream][0].kind == "all_gather":
      live = set()
    out = []
    for phase in self.streams[stream]:
      if phase.kind == "all_gather":
        live.add(phase.axis)
      for step in range(self.torus[phase.axis] - 1):
        out.append(Transfer(stream, phase, step, tuple(sorted(live))))
      if phase.kind == "reduce_scatter":
        live.discard(phase.axis)
    return out

  def steps(self) -> list[tuple[Transfer, ...]]:
    """All transfers grouped by global step: the streams advance in lockstep."""
    per_stream = [self.stream_transfers(k) for k in range(self.num_streams)]
    return [tuple(t) for t in zip(*per_stream)]

  def phase_of_steps(self) -> list[list[int]]:
    """``[stream][global step]`` -> index of that step's phase within its stream."""
    return [
      [i for i, p in enumerate(phases) for _ in range(self.torus[p.axis] - 1)]
      for phases in self.streams
    ]

  def bytes_sent_per_device(self, nbytes: int) -> float:
    """Bytes one device sends for a buffer of ``nbytes`` (the full, unscattered size)."""
    chunk = nbytes / self.num_devices / self.num_streams
    return sum(t.slab_elements(self.torus, 1) * chunk for step in self.steps() for t in step)


def _phases(kind: Kind, axes: Sequence[int], direction: int) -> tuple[Phase, ...]:
  return tuple(Phase(kind, a, direction) for a in axes)


def build(collective: Collective, torus: Sequence[int], variant: Variant | str) -> Schedule:
  """The schedule of ``collective`` on ``torus`` for one algorithm ``variant``.

  The ring variants need a 1-axis torus (flatten the mesh first); the torus variants take
  any number of axes (on one axis they are the ring and the bidirectional ring).
  """
  torus = tuple(int(n) for n in torus)
  variant = Variant(variant)
  if variant in (Variant.RING, Variant.BIDIRECTIONAL_RING) and len(torus) != 1:
    raise ValueError(f"{variant.value} runs on a 1-axis torus; got {torus=}. Flatten it first.")
  directions = (1,) if variant in (Variant.RING, Variant.TORUS) else (1, -1)
  axes = tuple(range(len(torus)))
  rotations = len(torus) if variant is Variant.TORUS_SPLIT else 1
  orders = [axes[r:] + axes[:r] for r in range(rotations)]

  streams = []
  for order, direction in itertools.product(orders, directions):
    rs = _phases("reduce_scatter", order, direction)
    # The gather retraces the scatter backwards, so the last axis scattered is gathered first.
    ag = _phases("all_gather", order[::-1], direction)
    streams.append({"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag}[collective])
  return Schedule(torus, tuple(streams))


def default_variant(torus: Sequence[int]) -> Variant:
  return Variant.TORUS_SPLIT if len(torus) > 1 else Variant.BIDIRECTIONAL_RING


# ----------------------------------------------------------------------------------------
# Reference executor: numpy over p virtual devices.


def _neighbour(coords: tuple[int, ...], axis: int, direction: int, torus) -> tuple[int, ...]:
  moved = list(coords)
  moved[axis] = (moved[axis] + direction) % torus[axis]
  return tuple(moved)


def simulate(schedule: Schedule, buffers: np.ndarray) -> tuple[np.ndarray, dict]:
  """Runs ``schedule`` on virtual devices and returns (buffers, link_bytes).

  ``buffers`` has shape ``torus + torus + (m,)``: for each device, its grid of chunks, each
  chunk of ``m`` elements (``m`` divisible by the number of streams). Slabs a device does
  not hold at the end (outside its own chunk after a reduce-scatter, say) are left as NaN,
  so callers see exactly what the algorithm produced. ``link_bytes`` maps
  ``(device, axis, direction)`` to the elements that device sent over that link.
  """
  torus = schedule.torus
  m = buffers.shape[-1]
  if buffers.shape[: 2 * len(torus)] != torus + torus:
    raise ValueError(f"buffers must have shape {torus + torus + (m,)}, got {buffers.shape}")
  if m % schedule.num_streams:
    raise ValueError(f"chunk size {m} is not divisible by {schedule.num_streams} streams")
  width = m // schedule.num_streams
  state = np.array(buffers, dtype=np.float64)
  gathering = schedule.streams[0] and schedule.streams[0][0].kind == "all_gather"
  devices = list(np.ndindex(*torus))
  if gathering:  # an all-gather starts from the own chunk alone
    keep_own_chunks(state, devices)
  link_bytes: dict = {}
  for step in schedule.steps():
    outgoing = []
    for transfer in step:
      phase, lanes = transfer.phase, slice(transfer.stream * width, (transfer.stream + 1) * width)
      n = torus[phase.axis]
      for coords in devices:
        slab = phase.send_slab(coords[phase.axis], transfer.step, n)
        data = state[coords][transfer.slab_index(coords, slab)][..., lanes].copy()
        dest = _neighbour(coords, phase.axis, phase.direction, torus)
        outgoing.append((transfer, dest, data, lanes))
        key = (coords, phase.axis, phase.direction)
        link_bytes[key] = link_bytes.get(key, 0) + data.size
    for transfer, dest, data, lanes in outgoing:  # all sends of a step happen at once
      phase = transfer.phase
      slab = phase.recv_slab(dest[phase.axis], transfer.step, torus[phase.axis])
      view = state[dest][transfer.slab_index(dest, slab)]
      if phase.kind == "reduce_scatter":
        view[..., lanes] += data
      else:
        view[..., lanes] = data
      state[dest][transfer.slab_index(dest, slab)] = view
  if schedule.streams[0][-1].kind == "reduce_scatter":  # only the own chunk is reduced
    keep_own_chunks(state, devices)
  return state, link_bytes


def keep_own_chunks(state: np.ndarray, devices) -> None:
  """Poisons (NaN) every chunk but each device's own."""
  for coords in devices:
    own = state[coords][coords].copy()
    state[coords] = np.nan
    state[coords][coords] = own
