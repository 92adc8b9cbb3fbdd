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

from torus_collectives import quantization
from torus_collectives import schedule as schedule_lib
from torus_collectives.axes import drop_unit_axes
from torus_collectives.tiling import accumulation_dtype, ceil_div, pad_chunks, pad_to

AxisNames = tuple[str, ...]


def _ring_perm(size: int, extent: int, direction: int) -> list[tuple[int, int]]:
  """One ring per aligned block of ``extent`` devices along an axis of ``size``."""
  return [(i, i - i % extent + (i % extent + direction) % extent) for i in range(size)]


@functools.cache
def _schedule(collective: str, torus: tuple[int, ...]) -> schedule_lib.Schedule:
  return schedule_lib.build(collective, torus, schedule_lib.default_variant(torus))


def _join(parts, dim):
  """Slabs (arrays or quantized ``(q, scales)`` pairs) joined along ``dim``."""
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=dim), *parts)


class _Residual:
  """What this device's quantizations took off the values it sent (``sent - arrived``),
  summed at the grid positions they belong to, per stream, in the device's own frame;
  None-valued when nobody asked for it. Over all devices it sums to ``exact - result``
  (up to float32 rounding): error feedback adds it to the next step's input."""

  def __init__(self, streams, wanted: bool):
    self.grids = [jnp.zeros_like(s) for s in streams] if wanted else None

  def add(self, k, transfer, frame_index: int, values, payload, fmt) -> None:
    if self.grids is None or fmt is None:
      return
    index = tuple(
      slice(frame_index, frame_index + 1)
      if a == transfer.phase.axis
      else slice(None)
      if a in transfer.live_axes
      else 0
      for a in range(self.grids[k].ndim - 1)
    )
    error = values - quantization.dequantize(payload, fmt)
    self.grids[k] = self.grids[k].at[index].add(error)


def _expand(payload, dim):
  return jax.tree.map(lambda v: jnp.expand_dims(v, dim), payload)


class _Stream:
  """One stream's live buffer while the schedule runs; ``slabs`` during a phase.

  ``held``: the block-scaled format a gathering stream holds its values in, as bytes, or
  None for plain values.
  """

  def __init__(self, buffer):
    self.buffer, self.slabs, self.held = buffer, None, None

  def start_scatter(self, n: int, dim: int) -> None:
    self.slabs = [lax.index_in_dim(self.buffer, j, dim) for j in range(n)]

  def start_gather(self, k, transfer, n: int, dim: int, fmt, residual: _Residual) -> None:
    """The own slab at frame index 0, converted to ``fmt``: quantized once where the
    phase quantizes and the bytes are not of that format yet."""
    if self.held != fmt:
      values = self.values()
      self.buffer = values if fmt is None else quantization.quantize(values, fmt)
      residual.add(k, transfer, 0, jnp.expand_dims(values, dim), _expand(self.buffer, dim), fmt)
      self.held = fmt
    self.slabs = [_expand(self.buffer, dim)] + [None] * (n - 1)

  def values(self):
    return self.buffer if self.held is None else quantization.dequantize(self.buffer, self.held)


def _scatter_step(stream, send_at, recv_at, ring, fmt, wire_dtype, sent) -> None:
  """Sends the partial sums of slab ``send_at`` along ``ring`` (an ``(axis, perm)``
  pair) and adds what arrives to slab ``recv_at``. ``sent(values, payload)`` sees what
  left a quantized hop."""
  values = stream.slabs[send_at]
  if fmt is None:
    incoming = lax.ppermute(values.astype(wire_dtype), *ring).astype(values.dtype)
  else:
    outgoing = quantization.quantize(values, fmt)
    sent(values, outgoing)
    incoming = quantization.dequantize(lax.ppermute(outgoing, *ring), fmt)
  stream.slabs[recv_at] = incoming + stream.slabs[recv_at]


def _gather_step(stream, send_at, recv_at, ring, wire_dtype) -> None:
  """Sends slab ``send_at`` along ``ring`` and stores what arrives as slab ``recv_at``;
  quantized bytes are forwarded as they are."""
  outgoing = stream.slabs[send_at]
  if stream.held is None:
    incoming = lax.ppermute(outgoing.astype(wire_dtype), *ring).astype(stream.buffer.dtype)
  else:
    incoming = lax.ppermute(outgoing, *ring)
  stream.slabs[recv_at] = incoming


def _run(schedule, buffers, axes, sizes, wire_dtype, transport, residual: _Residual):
  """Executes ``schedule`` on per-stream live buffers, all streams in lockstep.

  During a phase, a stream's buffer is held as a list of its slabs along the phase's axis,
  so a step touches only the slab it sends and the slab it receives (no whole-buffer
  update); the list is split off at the phase's start and joined at its end.

  ``transport`` (one ``quantization.BlockScaled`` or None per axis): a reduce-scatter
  hop along a quantized axis sends its partial sums quantized, and the receiver adds them
  dequantized; a gather phase along one holds its stream as quantized bytes, quantized
  once when the phase starts and forwarded unchanged (``torus_collectives.quantization``).
  """
  torus = schedule.torus
  per_stream = [schedule.stream_transfers(k) for k in range(schedule.num_streams)]
  streams = [_Stream(b) for b in buffers]
  for step in range(schedule.num_steps):
    for k, (stream, transfers) in enumerate(zip(streams, per_stream)):
      transfer = transfers[step]
      phase = transfer.phase
      n, fmt = torus[phase.axis], transport[phase.axis]
      dim = transfer.live_axes.index(phase.axis)
      scatter = phase.kind == "reduce_scatter"
      if transfer.step == 0 and scatter:
        stream.start_scatter(n, dim)
      elif transfer.step == 0:
        stream.start_gather(k, transfer, n, dim, fmt, residual)
      send_at = phase.send_slab(0, transfer.step, n)
      recv_at = phase.recv_slab(0, transfer.step, n)
      ring = (axes[phase.axis], _ring_perm(sizes[phase.axis], n, phase.direction))
      if scatter:
        sent = functools.partial(residual.add, k, transfer, send_at, fmt=fmt)
        _scatter_step(stream, send_at, recv_at, ring, fmt, wire_dtype, sent)
      else:
        _gather_step(stream, send_at, recv_at, ring, wire_dtype)
      if transfer.step == n - 2:  # phase ends
        stream.buffer = jnp.squeeze(stream.slabs[0], dim) if scatter else _join(stream.slabs, dim)
  return [stream.values() for stream in streams]


def _rotate(grid: jax.Array, positions, sign: int) -> jax.Array:
  """Rolls every torus axis of ``grid`` by ``sign * position`` along it."""
  for axis, pos in enumerate(positions):
    grid = jnp.roll(grid, sign * pos, axis=axis)
  return grid


def _execute(
  collective: str,
  x: jax.Array,
  axes: AxisNames,
  torus: tuple[int, ...],
  sizes,
  wire_dtype,
  transport=None,
  with_residual: bool = False,
):
  """Runs ``collective`` on ``x``: a chunk grid ``torus + (width,)``, or ``(width,)`` for
  an all-gather. Returns the grid (all-reduce, all-gather) or the own chunk, and, with
  ``with_residual``, the grid of what this device's quantizations took off (``_Residual``).
  Slabs travel in ``wire_dtype`` (or ``transport``'s block-scaled format, per axis) and
  are summed in ``x.dtype``. ``torus`` holds the ring sizes: the axis ``sizes``, or the
  extents of an aligned tile of them (one ring per tile).

  The schedule runs in each device's own frame: the grid is rolled so that the device's
  own chunk sits at index 0 along every axis. Every slab index is then the same static
  number on every device, which keeps dynamic indexing (and the copies it costs) to one
  roll per axis on the way in and one on the way out.
  """
  transport = transport or (None,) * len(torus)
  torus, axes, sizes, transport = drop_unit_axes(torus, axes, sizes, transport)
  if collective != "all_gather":
    x = x.reshape(torus + x.shape[-1:])
  if not axes:
    return (x, jnp.zeros_like(x)) if with_residual else x
  schedule = _schedule(collective, torus)
  positions = [lax.axis_index(a) % n for a, n in zip(axes, torus)]
  if collective != "all_gather":
    x = _rotate(x, positions, -1)
  streams = jnp.split(x, schedule.num_streams, axis=-1)
  residual = _Residual(streams, with_residual)
  outputs = _run(schedule, streams, axes, sizes, wire_dtype, transport, residual)
  out = jnp.concatenate(outputs, axis=-1)
  out = out if collective == "reduce_scatter" else _rotate(out, positions, 1)
  if not with_residual:
    return out
  return out, _rotate(jnp.concatenate(residual.grids, axis=-1), positions, 1)


def _padded_width(m: int, torus: tuple[int, ...], transport=None) -> int:
  """The chunk width: a whole number of blocks (of the block-scaled ``transport``) per
  stream; with transport, an even number of them, so that a 16-bit buffer's stream
  slices start on the remote-DMA kernels' DMA words (``quantized_kernels``)."""
  (kept,) = drop_unit_axes(torus)
  streams = _schedule("all_reduce", kept).num_streams if kept else 1
  unit = streams * quantization.block_multiple(transport) * (2 if transport else 1)
  return ceil_div(m, unit) * unit


def _check_transport(x: jax.Array, transport) -> None:
  if transport and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
      f"block-scaled transport quantizes floating-point values; got dtype {x.dtype}. "
      "Pass transport_dtype=None for integer collectives (they are exact)."
    )


def _summed(collective, flat, p, axes, torus, sizes, dtype, transport, with_residual):
  """A reduce-scatter or all-reduce of ``flat`` (``[p*m]``, partial sums already widened)
  run on the padded chunk grid: (the own chunk ``[width]`` or the grid ``[p, width]``,
  ``width``, and with ``with_residual`` the residual as ``[p*m]``, else None)."""
  m = flat.shape[0] // p
  width = _padded_width(m, torus, transport)
  grid = pad_chunks(flat, p, width).reshape(torus + (width,))
  result = _execute(collective, grid, axes, torus, sizes, dtype, transport, with_residual)
  out, residual = result if with_residual else (result, None)
  if residual is not None:
    residual = residual.reshape(p, width)[:, :m].reshape(p * m)
  return out, width, residual


def reduce_scatter(
  x: jax.Array,
  axes: AxisNames,
  torus: tuple[int, ...],
  tile=None,
  *,
  transport=None,
  with_residual: bool = False,
):
  """(p*m,) -> (m,): this device's chunk of the sum, chunks row-major over ``axes``.

  With ``tile`` (extents of aligned replica groups, see ``groups``), within each group.
  ``with_residual``: also returns what this device's quantizations took off, as a
  ``(p*m,)`` float32 buffer in the input's layout (error feedback).
  """
  _check_transport(x, transport)
  sizes, torus = torus, tile or torus
  p = math.prod(torus)
  m = x.shape[0] // p
  flat = x.astype(accumulation_dtype(x.dtype))
  out, width, residual = _summed(
    "reduce_scatter", flat, p, axes, torus, sizes, x.dtype, transport, with_residual
  )
  own = out.reshape(width)[:m].astype(x.dtype)
  return (own, residual) if with_residual else own


def all_gather(
  x: jax.Array, axes: AxisNames, torus: tuple[int, ...], tile=None, *, transport=None
) -> jax.Array:
  """(m,) -> (p*m,): every device's chunk, row-major over ``axes`` (or over its group)."""
  _check_transport(x, transport)
  sizes, torus = torus, tile or torus
  p, m = math.prod(torus), x.shape[0]
  width = _padded_width(m, torus, transport)
  chunk = pad_to(x.astype(accumulation_dtype(x.dtype)) if transport else x, width)
  out = _execute("all_gather", chunk, axes, torus, sizes, x.dtype, transport)
  return out.reshape(p, width)[:, :m].reshape(p * m).astype(x.dtype)


def all_reduce(
  x: jax.Array,
  axes: AxisNames,
  torus: tuple[int, ...],
  tile=None,
  *,
  transport=None,
  with_residual: bool = False,
):
  """(n,) -> (n,): the sum over ``axes`` (or over its group), identical on every device.

  ``with_residual``: also returns what this device's quantizations took off, as an
  ``(n,)`` float32 buffer (error feedback: add it to the next step's input).
  """
  _check_transport(x, transport)
  sizes, torus = torus, tile or torus
  p, n = math.prod(torus), x.shape[0]
  m = ceil_div(n, p)
  if transport:  # chunks of the padded width back to back, the padding at the buffer's end
    m = _padded_width(m, torus, transport)
  flat = pad_to(x.astype(accumulation_dtype(x.dtype)), p * m)
  out, width, residual = _summed(
    "all_reduce", flat, p, axes, torus, sizes, x.dtype, transport, with_residual
  )
  total = out.reshape(p, width)[:, :m].reshape(p * m)[:n].astype(x.dtype)
  return (total, residual[:n]) if with_residual else total
