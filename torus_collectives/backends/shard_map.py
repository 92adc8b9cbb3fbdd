"""The portable implementation: a torus ``Schedule`` executed with ``lax.ppermute``.

It runs inside the caller's ``jax.shard_map`` on any backend and any number of processes.
Each device keeps, per stream, its *live* buffer: the chunk grid restricted to the axes not
yet reduced (see ``schedule``). A reduce-scatter step sends one slab along a ring and adds
the slab it receives; at the end of a phase the device keeps only its own slab, so the
buffer shrinks by the ring size. An all-gather step does the opposite. All streams of a
step are independent, so XLA may overlap their transfers.

Assumptions: every device runs the same program (SPMD), ring position along an axis is
``lax.axis_index``. Data travels in the input dtype; floating-point partial sums are
accumulated in float32 at least (a bfloat16 slab is widened on arrival, added, and narrowed
again only to be sent on); integers are summed in their own type.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import schedule as schedule_lib
from torus_collectives.axes import drop_unit_axes
from torus_collectives.layout import accumulation_dtype, ceil_div, pad_chunks, pad_to

AxisNames = tuple[str, ...]


def _ring_perm(size: int, extent: int, direction: int) -> list[tuple[int, int]]:
  """One ring per aligned block of ``extent`` devices along an axis of ``size``."""
  return [(i, i - i % extent + (i % extent + direction) % extent) for i in range(size)]


@functools.cache
def _schedule(collective: str, torus: tuple[int, ...]) -> schedule_lib.Schedule:
  return schedule_lib.build(collective, torus, schedule_lib.default_variant(torus))


def _run(schedule, streams, axes, sizes, wire_dtype):
  """Executes ``schedule`` on per-stream live buffers, all streams in lockstep.

  During a phase, a stream's buffer is held as a list of its slabs along the phase's axis,
  so a step touches only the slab it sends and the slab it receives (no whole-buffer
  update); the list is split off at the phase's start and joined at its end.
  """
  torus = schedule.torus
  per_stream = [schedule.stream_transfers(k) for k in range(schedule.num_streams)]
  buffers, slabs = list(streams), [None] * len(streams)
  for step in range(schedule.num_steps):
    for k, transfers in enumerate(per_stream):
      transfer = transfers[step]
      phase = transfer.phase
      n = torus[phase.axis]
      dim = transfer.live_axes.index(phase.axis)
      if transfer.step == 0:  # phase starts: own slab at frame index 0
        if phase.kind == "reduce_scatter":
          slabs[k] = [lax.index_in_dim(buffers[k], j, dim) for j in range(n)]
        else:
          slabs[k] = [jnp.expand_dims(buffers[k], dim)] + [None] * (n - 1)
      send_at = phase.send_slab(0, transfer.step, n)
      recv_at = phase.recv_slab(0, transfer.step, n)
      outgoing = slabs[k][send_at].astype(wire_dtype)
      perm = _ring_perm(sizes[phase.axis], n, phase.direction)
      incoming = lax.ppermute(outgoing, axes[phase.axis], perm)
      incoming = incoming.astype(buffers[k].dtype)
      if phase.kind == "reduce_scatter":
        incoming = incoming + slabs[k][recv_at]
      slabs[k][recv_at] = incoming
      if transfer.step == n - 2:  # phase ends
        if phase.kind == "reduce_scatter":
          buffers[k] = jnp.squeeze(slabs[k][0], dim)
        else:
          buffers[k] = jnp.concatenate(slabs[k], axis=dim)
  return buffers


def _rotate(grid: jax.Array, positions, sign: int) -> jax.Array:
  """Rolls every torus axis of ``grid`` by ``sign * position`` along it."""
  for axis, pos in enumerate(positions):
    grid = jnp.roll(grid, sign * pos, axis=axis)
  return grid


def _execute(
  collective: str, x: jax.Array, axes: AxisNames, torus: tuple[int, ...], sizes, wire_dtype
) -> jax.Array:
  """Runs ``collective`` on ``x``: a chunk grid ``torus + (width,)``, or ``(width,)`` for
  an all-gather. Returns the grid (all-reduce, all-gather) or the own chunk. Slabs travel
  in ``wire_dtype`` and are summed in ``x.dtype``. ``torus`` holds the ring sizes: the
  axis ``sizes``, or the extents of an aligned tile of them (one ring per tile).

  The schedule runs in each device's own frame: the grid is rolled so that the device's
  own chunk sits at index 0 along every axis. Every slab index is then the same static
  number on every device, which keeps dynamic indexing (and the copies it costs) to one
  roll per axis on the way in and one on the way out.
  """
  torus, axes, sizes = drop_unit_axes(torus, axes, sizes)  # rings of one: the identity
  if collective != "all_gather":
    x = x.reshape(torus + x.shape[-1:])
  if not axes:
    return x
  schedule = _schedule(collective, torus)
  positions = [lax.axis_index(a) % n for a, n in zip(axes, torus)]
  if collective != "all_gather":
    x = _rotate(x, positions, -1)
  streams = jnp.split(x, schedule.num_streams, axis=-1)
  outputs = _run(schedule, streams, axes, sizes, wire_dtype)
  out = jnp.concatenate(outputs, axis=-1)
  return out if collective == "reduce_scatter" else _rotate(out, positions, 1)


def _padded_width(m: int, torus: tuple[int, ...]) -> int:
  (kept,) = drop_unit_axes(torus)
  streams = _schedule("all_reduce", kept).num_streams if kept else 1
  return ceil_div(m, streams) * streams


def reduce_scatter(x: jax.Array, axes: AxisNames, torus: tuple[int, ...], tile=None) -> jax.Array:
  """(p*m,) -> (m,): this device's chunk of the sum, chunks row-major over ``axes``.

  With ``tile`` (extents of aligned replica groups, see ``groups``), within each group.
  """
  sizes, torus = torus, tile or torus
  p = math.prod(torus)
  m = x.shape[0] // p
  width = _padded_width(m, torus)
  grid = pad_chunks(x.astype(accumulation_dtype(x.dtype)), p, width)
  out = _execute("reduce_scatter", grid.reshape(torus + (width,)), axes, torus, sizes, x.dtype)
  return out.reshape(width)[:m].astype(x.dtype)


def all_gather(x: jax.Array, axes: AxisNames, torus: tuple[int, ...], tile=None) -> jax.Array:
  """(m,) -> (p*m,): every device's chunk, row-major over ``axes`` (or over its group)."""
  sizes, torus = torus, tile or torus
  p, m = math.prod(torus), x.shape[0]
  width = _padded_width(m, torus)
  out = _execute("all_gather", pad_to(x, width), axes, torus, sizes, x.dtype)
  return out.reshape(p, width)[:, :m].reshape(p * m)


def all_reduce(x: jax.Array, axes: AxisNames, torus: tuple[int, ...], tile=None) -> jax.Array:
  """(n,) -> (n,): the sum over ``axes`` (or over its group), identical on every device."""
  sizes, torus = torus, tile or torus
  p, n = math.prod(torus), x.shape[0]
  m = ceil_div(n, p)
  width = _padded_width(m, torus)
  flat = pad_to(x.astype(accumulation_dtype(x.dtype)), p * m)
  grid = pad_chunks(flat, p, width)
  out = _execute("all_reduce", grid.reshape(torus + (width,)), axes, torus, sizes, x.dtype)
  return out.reshape(p, width)[:, :m].reshape(p * m)[:n].astype(x.dtype)
