"""Torus collectives as sequences of split Pallas calls, issued one call at a time.

A ``SplitCollective`` is a reduce-scatter, all-gather or all-reduce over one or more torus
axes, built from the split ring phases of ``split_rings`` (each phase a start, ``n - 2``
steps and a done), chained as the torus schedules chain them: a reduce-scatter along
every axis in turn, each on the chunk the previous one left; an all-gather back along the
axes in reverse; an all-reduce both. Between any two calls the DMAs of the last one are
on the link, and whoever drives the sequence (``advance``) may place compute there,
pinned to the sequence with ``pin``: how ``torus_collectives.experimental.overlap`` threads gradient
summation through the backward pass.

The chains are not described here: each stream executes, call by call, the phases of one
stream of ``schedule.build(collective, sizes, variant)`` over the live axes (those of more
than one device; a phase's ``axis`` indexes them), the data the blocking kernels and the
cost model run too.

Streams (``variant``):

* ``"torus"`` (one stream): the paper's schedule, ``schedule.build(kind, torus,
  "torus")``: every phase in direction +1, one link of each chip busy at a time;
* ``"torus_split"`` (2N streams on N axes of more than one device): the buffer is cut
  into 2N equal parts, and part ``(r, d)`` runs the chain over the axes rotated by ``r``
  in direction ``d``, the streams of ``schedule.build("all_reduce", torus,
  "torus_split")``. Every ``advance`` issues the next call of every stream, so at each
  step the streams' hops run on different (axis, direction) links at once (on a torus
  whose axes have equal sizes; otherwise they drift out of phase), each with ``1 / 2N``
  of the bytes: all 2N links of a chip carry traffic, as in the blocking kernels.
  Per-stream traffic is the ring's ``(n - 1) / n`` of its part per phase, so the total is
  the torus schedule's. A chain over rotated axes leaves device ``d`` the chunk whose
  row-major index *in the rotated order* is ``d``'s, so the reduce-scatter and
  all-gather, whose results depend on that order, cut each device's chunk (not the
  buffer) into the 2N parts: stream ``s`` reduce-scatters slice ``s`` of every chunk,
  the chunks laid out in its rotated order (a transposition of the ``[p, m]`` grid), and
  the all-gather puts its streams' slices back the same way, so both equal lax's tiled
  collectives whatever the streams. The rotation is read off the stream's phases
  (``_rotation``: the axis it reduce-scatters first, which it all-gathers last): the
  schedule's stream ``(r, d)`` scatters the axes ``r, r + 1, ..., r - 1``, the order
  ``_to_rotated(..., r)`` lays the chunks out in. Those transpositions are copies of the
  whole buffer, so the pallas backend runs its split reduce-scatter and all-gather in one
  stream (``pallas_backend.split_reduce_scatter``); whether 2N links' bandwidth pays for
  the copies in a real step is not measured here.

Axes are given as ``(name, size)`` pairs in the caller's order; the reduce-scatter of
``x`` over ``("x", "y")`` leaves device ``(i, j)`` chunk ``i * ny + j`` of the sum, as
``lax.psum_scatter(x, ("x", "y"), tiled=True)`` does, and the all-gather is its inverse.
A phase of size 1 is skipped. The buffer must split into whole 512-byte DMA words per
final chunk of every stream (``padded_elements``).

Every device must issue the calls in the same order: streams (and, in each, phases) of
one (kind, axis, direction) share that pattern's barrier semaphore, whose counts pair the
``k``-th calls of all sequences of the pattern, which is right only if every device issues
them in one order (see ``split_rings``). One program under ``shard_map`` does. Nothing
has run on a TPU (see ``split_rings``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import split_rings
from torus_collectives.kernels.buffer_layout import dma_alignment

Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]
Variant = Literal["torus", "torus_split"]


def _live_axes(axes) -> list[tuple[str, int]]:
  return [(name, int(size)) for name, size in axes if int(size) > 1]


def _streams(
  collective: Collective, axes, variant: Variant = "torus"
) -> tuple[tuple[schedule_lib.Phase, ...], ...]:
  """The streams of ``schedule.build(collective, sizes, variant)`` over the live axes (a
  phase's ``axis`` is its axis's place among the live ``axes``); one empty stream where no
  axis is live."""
  live = _live_axes(axes)
  if not live:
    return ((),)
  return schedule_lib.build(collective, [size for _, size in live], variant).streams


def stream_count(collective: Collective, axes, variant: Variant = "torus") -> int:
  """How many streams the collective runs in (module doc): the schedule's, 2N in the split
  torus variant."""
  return len(_streams(collective, axes, variant))


def padded_elements(elements: int, sizes: Sequence[int], itemsize: int, streams: int = 1) -> int:
  """The smallest length ``>= elements`` that an all-reduce over axes of ``sizes`` in
  ``streams`` streams takes: a whole number of DMA words for every final chunk."""
  unit = streams * math.prod(sizes) * dma_alignment(itemsize)
  return -(-elements // unit) * unit


def _named(phases: Sequence[schedule_lib.Phase], live) -> list[tuple[str, str, int, int]]:
  """``(kind, axis name, size, direction)`` of each of a stream's ``phases`` over the
  ``live`` axes."""
  return [(p.kind, *live[p.axis], p.direction) for p in phases]


def _stream_phases(collective: Collective, axes, variant: Variant):
  """Each stream's phases, named (``_named``), as the schedule holds them."""
  live = _live_axes(axes)
  return [_named(phases, live) for phases in _streams(collective, axes, variant)]


def _rotation(phases: Sequence[schedule_lib.Phase]) -> int:
  """The live axis a stream's chain reduce-scatters first (and all-gathers last): in
  ``schedule.build``'s split torus variant its scatter order is the live axes rotated to
  start there, so the chunk it leaves a device is the one ``_to_rotated`` by it puts in
  that device's row."""
  first = phases[0]
  return first.axis if first.kind == "reduce_scatter" else phases[-1].axis


def _to_rotated(grid: jax.Array, sizes: Sequence[int], r: int) -> jax.Array:
  """``[p, w]`` rows in row-major device order -> rows in the order rotated by ``r``
  (row ``c`` holds the device whose row-major index over the rotated axes is ``c``)."""
  n = len(sizes)
  blocks = grid.reshape(*sizes, -1)
  order = [*range(r, n), *range(r), n]
  return blocks.transpose(order).reshape(grid.shape)


def _from_rotated(grid: jax.Array, sizes: Sequence[int], r: int) -> jax.Array:
  """The inverse of ``_to_rotated``."""
  n = len(sizes)
  rotated = [*sizes[r:], *sizes[:r]]
  blocks = grid.reshape(*rotated, -1)
  order = [*range(n - r, n), *range(n - r), n]
  return blocks.transpose(order).reshape(grid.shape)


class _Stream:
  """One stream's queue of calls and where it stands: the current ``RingState``, or
  between phases (and at the end) the array the last done returned."""

  def __init__(self, x, phases, mesh_axes):
    self.value = x
    self.calls: list[Callable] = []
    for kind, name, n, direction in phases:
      self.calls.append(
        lambda value, kind=kind, name=name, n=n, d=direction: split_rings.ring_start(
          kind, value, name, n, mesh_axes, d
        )
      )
      self.calls += [split_rings.ring_step] * (n - 2)
      self.calls.append(split_rings.ring_done)

  def advance(self) -> None:
    self.value = self.calls.pop(0)(self.value)


class SplitCollective:
  """One collective as a queue of Pallas calls (module doc).

  ``result_elements``: the length ``finish`` returns, where ``x`` was padded.
  ``advance()`` issues the next call of every stream, ``pin(values)`` ties ``values`` to
  the sequence where it stands (what comes out is ready only after the last issued
  calls, and the next calls wait for it), ``finish()`` issues every call left and returns
  the result. Nothing is computed until a call is issued. Calls are traced in the order
  they are issued, so every device must drive its sequences the same way (they do under
  ``shard_map``: the program is one). With several streams, each stream's calls run in a
  named scope ``stream_<s>`` (how ``testing.hlo_schedule`` tells them apart).
  """

  def __init__(
    self,
    collective: Collective,
    x: jax.Array,
    axes: Sequence[tuple[str, int]],
    mesh_axes,
    result_elements: int | None = None,
    variant: Variant = "torus",
  ):
    self.collective = collective
    self.mesh_axes = tuple(mesh_axes)
    self.result_elements = result_elements
    self._check(x, axes, variant)
    self._phases = _streams(collective, axes, variant)
    self._live = _live_axes(axes)
    parts = self._cut(x)
    self._streams = [
      _Stream(part, _named(phases, self._live), self.mesh_axes)
      for part, phases in zip(parts, self._phases)
    ]
    self._input = x

  def _cut(self, x: jax.Array) -> list[jax.Array]:
    """Each stream's input: the buffer cut in equal parts, one per stream (the all-reduce,
    the all-gather's own chunk), or for the reduce-scatter slice ``s`` of every chunk, the
    chunks in stream ``s``'s rotated order (``_rotation``, module doc)."""
    streams = len(self._phases)
    if streams == 1:
      return [x]
    if self.collective != "reduce_scatter":
      return jnp.split(x, streams)
    sizes = [n for _, n in self._live]
    grid = x.reshape(math.prod(sizes), -1)
    slices = jnp.split(grid, streams, axis=1)
    return [
      _to_rotated(g, sizes, _rotation(phases)).reshape(-1)
      for g, phases in zip(slices, self._phases)
    ]

  def _gathered_parts(self, parts) -> list[jax.Array]:
    """The all-gather's parts as its result: the ``[p, w]`` rows of each stream's slice,
    back in row-major device order, flattened side by side as ``[p, sum w]``."""
    if len(parts) == 1:
      return parts
    sizes = [n for _, n in self._live]
    p = math.prod(sizes)
    grids = [
      _from_rotated(g.reshape(p, -1), sizes, _rotation(phases))
      for g, phases in zip(parts, self._phases)
    ]
    return [jnp.concatenate(grids, axis=1).reshape(-1)]

  def _check(self, x, axes, variant) -> None:
    """Every phase's chunk is a whole number of DMA words (raises before any call)."""
    sizes = [int(size) for _, size in axes]
    streams = stream_count(self.collective, axes, variant)
    total = x.shape[0] if x.ndim == 1 else -1
    if self.collective == "all_gather":
      total *= math.prod(sizes)
    if total < 0 or total != padded_elements(total, sizes, x.dtype.itemsize, streams):
      unit = streams * math.prod(sizes) * dma_alignment(x.dtype.itemsize)
      raise ValueError(
        f"a split {self.collective} over {list(axes)} in {streams} stream(s) takes a 1-D "
        f"buffer whose full length is a multiple of {unit} elements (whole DMA words per "
        f"device and stream), got {x.dtype}{list(x.shape)}; pad it "
        "(split_collectives.padded_elements)"
      )
    for name, _ in _live_axes(axes):
      if name not in self.mesh_axes:
        raise ValueError(f"axis {name!r} is not one of mesh_axes={self.mesh_axes}")

  @property
  def parts_like(self) -> list[jax.Array]:
    """Arrays of the types ``finish_parts`` returns (varying as the input is), for tracing
    what reads them; built when asked for, so that nothing computes them otherwise."""
    p, streams = math.prod(n for _, n in self._live), len(self._streams)
    if self.collective == "all_gather":
      return [jnp.broadcast_to(self._input, (p, self._input.size)).reshape(-1)]
    size = self._input.size // streams // (p if self.collective == "reduce_scatter" else 1)
    return [self._input[:size]] * streams

  @property
  def streams(self) -> int:
    return len(self._streams)

  @property
  def calls_left(self) -> int:
    """Calls not yet issued per stream (every stream has as many); the collective is
    complete when this is 0."""
    return len(self._streams[0].calls)

  def _scope(self, s: int):
    return jax.named_scope(f"stream_{s}") if len(self._streams) > 1 else contextlib.nullcontext()

  def advance(self) -> None:
    """Issues the next call of every stream, then ties the streams together (one barrier
    over their buffers), so that no stream's next call runs before every stream's call of
    this step: XLA would otherwise be free to run one stream's chain after another's, on
    one link at a time."""
    if not self.calls_left:
      raise ValueError(f"the split {self.collective} has issued all its calls")
    for s, stream in enumerate(self._streams):
      with self._scope(s):
        stream.advance()
    if len(self._streams) > 1:
      tied = lax.optimization_barrier([split_rings.buffer_of(st.value) for st in self._streams])
      for stream, buffer in zip(self._streams, tied):
        stream.value = split_rings.with_buffer(stream.value, buffer)

  def pin(self, values):
    """``values`` through one optimization barrier with each stream's in-flight buffer
    (``split_rings.pin``); returns them."""
    for stream in self._streams:
      stream.value, values = split_rings.pin(stream.value, values)
    return values

  def finish(self) -> jax.Array:
    """Issues every call left; returns the collective's result (its first
    ``result_elements`` elements, if given: the length before padding)."""
    parts = self.finish_parts()
    out = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return out if self.result_elements is None else out[: self.result_elements]

  def finish_parts(self) -> list[jax.Array]:
    """Issues every call left; returns each stream's part of the result, unjoined (a
    barrier on the parts copies nothing, and pieces sliced from them need no buffer of the
    whole: ``packing.unpack_parts``); the all-gather's streams put back together as one
    (its result interleaves their slices row by row)."""
    while self.calls_left:
      self.advance()
    parts = [stream.value for stream in self._streams]
    return self._gathered_parts(parts) if self.collective == "all_gather" else parts


def run(
  collective: Collective,
  x: jax.Array,
  axes: Sequence[tuple[str, int]],
  mesh_axes: Sequence[str],
  between: Callable[..., object] | None = None,
  operands=(),
  variant: Variant = "torus",
):
  """The whole collective, with ``between(i, *operands)`` (if given) in the window after
  the ``i``-th call, pinned on both sides as in ``split_rings.ring_phase``. Returns the
  result, or ``(result, results)`` with the hook's results."""
  split = SplitCollective(collective, x, axes, mesh_axes, variant=variant)
  results = []
  i = 0
  while split.calls_left:
    split.advance()
    if between is not None and split.calls_left:
      ready = split.pin(tuple(operands))
      results.append(split.pin(between(i, *ready)))
      i += 1
  out = split.finish()
  return out if between is None else (out, tuple(results))
