"""Block-scaled transport: partial sums on the wire as int8 (or fp8) values plus one
bfloat16 scale per block of ``block_size`` elements.

Format. A buffer that travels is cut, along its last dimension, into blocks of ``B``
consecutive elements (of the chunk grid's stream slices: a block never spans two chunks).
A block ``x`` goes as one scale ``s``, ``max|x| / Q`` rounded up to a bfloat16, and
``q = clip(round(x * (1 / s)), -Q, Q)`` in the transport dtype, where ``Q`` is the
format's largest finite value (127 for int8, 448 for ``float8_e4m3fn``, 57344 for
``float8_e5m2``); it arrives as ``q * s`` in float32. ``round`` is to nearest, ties to
even (for fp8, the cast's rounding); there is no stochastic rounding. Why these choices:
a bfloat16 scale has 8 significant bits, so ``q * s`` is exact in float32 and a compiler
that fuses it with the next add into an FMA computes the same bits; the multiply by the
reciprocal is what XLA makes of a division by a broadcast scale anyway, so writing it so
keeps the numpy model exact. An all-zero block has ``s = 0`` and arrives as zeros, as
does a block whose ``max|x| / Q`` is below the smallest normal float32 (about 1.2e-38:
XLA flushes subnormals to zero, and so does the format, subnormal inputs included). A
block holding an infinity or a NaN gets the scale NaN and arrives as all NaN: a
non-finite gradient is never turned into a finite one. Wire bytes per element:
``(B * itemsize + 2) / B``, 1.016 for int8 blocks of 128 (0.508 of bfloat16's 2).

The ring schedules forward partial sums, so a value is quantized once per hop
(``torus_collectives.schedule``): in a reduce-scatter step a device dequantizes what it
receives, adds its own partial sum in float32, and quantizes the result to send it on.
The all-gather forwards each block's bytes unchanged: the owner of a reduced chunk
quantizes it once, and every device dequantizes the same bytes, so an all-reduce's result
is bitwise identical on every device (its own chunk included).

Error bound (``error_bound``). One quantization of a block whose largest magnitude is
``a`` moves each element by at most ``delta * a``: ``delta = 1 / (2 Q)`` for int8
(half a step), ``2**-(mantissa bits + 1)`` relative for fp8. A partial sum is at most
``A = sum_i a_i`` in magnitude, ``a_i`` device i's largest magnitude in that block, and
each hop's quantization and float32 add multiply the worst case by ``(1 + delta)(1 + u)``
(``u = 2**-24``). So over ``k`` quantizations

    |computed - exact| <= ((1 + delta)**k (1 + u)**k - 1) * A   per element,

about ``k * delta * A``. ``k`` counts the hops that quantize: on a torus of axis sizes
``n_a`` a reduce-scatter quantizes ``sum_a (n_a - 1)`` times (``p - 1`` on a ring; fewer
on a 2-D or 3-D torus, 30 on 16x16 against 255 on a ring of 256), an all-gather once, an
all-reduce both. With transport on some axes only (``{"dcn": jnp.int8}``, for the
data-centre network between slices) only the hops along those axes quantize. (Blocks
whose partial sums fall below ``Q`` times the smallest normal float32, about 1.5e-36,
are flushed to zero instead: an absolute error below that per hop, outside this bound.)

Where it runs: ``implementation="shard_map"``, the ``lax.ppermute`` schedule, on any
backend, every format, block size and per-axis mix, with error feedback; "auto" with a
block-scaled ``transport_dtype`` runs it. ``"pallas"`` runs int8 blocks of 128 on every
axis in the remote-DMA kernels of ``torus_collectives.kernels.quantized_kernels`` (the
same schedules, layout, blocks and order of adds) and refuses the rest. ``"xla"`` and
``"lax_torus"`` refuse it (XLA's collectives on int8 would sum in int8). Collectives with
it are not differentiable (quantization is not linear). Float32 arithmetic on CPU is
IEEE, so there both equal ``simulate`` (a numpy model of the same schedule) bitwise
(``tests/test_block_scaled_transport.py``; the kernels in TPU interpret mode,
``tests/test_quantized_kernels.py``); a TPU's float32 reciprocal may round differently,
within the bound.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from torus_collectives import schedule as schedule_lib
from torus_collectives.axes import drop_unit_axes

DEFAULT_BLOCK_SIZE = 128
_SCALE_BYTES = 2  # a bfloat16 scale per block
_FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")
_F32_UNIT_ROUNDOFF = 2.0**-24
# The smallest normal float32. XLA on CPU and TPU flushes subnormal float32 values to zero
# (inputs and results); the format does so explicitly, so that the numpy model agrees.
_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class BlockScaled:
  """A block-scaled transport format: ``dtype`` values plus a bfloat16 scale per block.

  ``block_size`` defaults to 128, chosen from the measured error against the bytes
  (``python -m bench.quantization_report``, all-reduce on a 2x4 torus, RMS error over the
  RMS sum): smaller blocks err less, more so on heavy tails (int8, Student-t: 1.30 %,
  1.58 %, 1.95 %, 2.39 % at 32, 64, 128, 256; normal: 0.95 %, 1.05 %, 1.14 %, 1.22 %) and
  pay more for scales (0.531, 0.516, 0.508, 0.504 of bfloat16's bytes). 32 exceeds the
  0.53 this format is held to; 128 is one row of 128 lanes, the unit a TPU kernel reduces
  and scales in one vector; 64 buys 10-20 % less error for 1.6 % more bytes, so pass it
  where heavy-tailed gradients matter more than kernel alignment.

  Pass one as ``transport_dtype=`` of ``psum``, ``pmean``, ``psum_scatter``,
  ``all_gather``, ``all_reduce_gradients`` or ``sharded_update``, or as a value of a
  mapping from axis name to format. A bare ``jnp.int8`` or fp8 dtype there means
  ``BlockScaled(dtype)``, blocks of 128. ``"pallas"`` runs ``BlockScaled("int8", 128)``
  only; ``"shard_map"`` runs every format and block size.

  Attributes:
    dtype: the quantized values' dtype: ``"int8"`` (default), ``"float8_e4m3fn"`` or
      ``"float8_e5m2"``; a jnp dtype is accepted and stored by name.
    block_size: elements per block, each block with one bfloat16 scale (default 128).

  Raises:
    ValueError: when constructed, on another ``dtype`` (for a floating transport such as
      bfloat16, cast the input instead) or a ``block_size`` that is not a positive int.
  """

  dtype: str = "int8"
  block_size: int = DEFAULT_BLOCK_SIZE

  def __post_init__(self):
    name = jnp.dtype(self.dtype).name
    if name not in _FORMATS:
      raise ValueError(
        f"block-scaled transport needs one of {_FORMATS}, got dtype {name}; for a floating "
        "transport dtype such as bfloat16, cast the input instead"
      )
    object.__setattr__(self, "dtype", name)
    size = self.block_size
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
      raise ValueError(f"block_size must be a positive int, got {size!r}")
    object.__setattr__(self, "block_size", int(size))

  @property
  def levels(self) -> float:
    """``Q``, the largest magnitude a quantized value takes."""
    if self.dtype == "int8":
      return 127.0
    return float(jnp.finfo(self.dtype).max)

  @property
  def delta(self) -> float:
    """The largest error of one quantization, relative to the block's largest magnitude:
    half a step for int8 (``1 / 2Q``), the rounding of the cast for fp8
    (``2**-(mantissa bits + 1)``), times ``1 + 2**-6`` for the scale's rounding up to
    bfloat16 (``2**-7``) and the float32 roundings of its reciprocal and the product."""
    if self.dtype == "int8":
      base = 1.0 / (2 * self.levels)
    else:
      base = 2.0 ** -(jnp.finfo(self.dtype).nmant + 1)
    return base * (1 + 2.0**-6)

  @property
  def wire_bytes_per_element(self) -> float:
    """Bytes on the wire per element, its block's scale included."""
    return (self.block_size * jnp.dtype(self.dtype).itemsize + _SCALE_BYTES) / self.block_size


Transport = tuple[BlockScaled | None, ...]  # one entry per named axis


def _format(value) -> BlockScaled | None:
  if value is None or isinstance(value, BlockScaled):
    return value
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise ValueError(
      f"transport_dtype entries must be dtypes or tc.BlockScaled, got {value!r}"
    ) from None
  return BlockScaled(dtype.name)


def is_block_scaled(transport_dtype: Any) -> bool:
  """Whether a ``transport_dtype=`` argument asks for block-scaled transport (rather than
  a plain cast): a ``BlockScaled``, a mapping per axis, or an int8 or fp8 dtype."""
  if isinstance(transport_dtype, (BlockScaled, Mapping)):
    return True
  try:
    return jnp.dtype(transport_dtype).name in _FORMATS
  except TypeError:
    return False


def transport_per_axis(transport_dtype: Any, axis_names: Sequence) -> Transport | None:
  """The block-scaled format of each of ``axis_names`` from a ``transport_dtype=``
  argument: None, a dtype (``jnp.int8``, an fp8 type) or a ``BlockScaled`` for every
  axis, or a mapping from axis name to one of those (axes not named travel unquantized).
  None where nothing is quantized. Raises ValueError, naming the fix, on a floating
  dtype (cast the input instead), an unknown format or a mapping naming another axis."""
  if transport_dtype is None:
    return None
  names = tuple(axis_names)
  if isinstance(transport_dtype, Mapping):
    unknown = set(transport_dtype) - set(names)
    if unknown:
      raise ValueError(
        f"transport_dtype names axes {sorted(map(str, unknown))} that the collective does "
        f"not run over (its axes: {names})"
      )
    per_axis = tuple(_format(transport_dtype.get(a)) for a in names)
  else:
    per_axis = (_format(transport_dtype),) * len(names)
  return per_axis if any(per_axis) else None


def block_multiple(transport: Transport | None) -> int:
  """The block size every stream slice must be a multiple of (1 without quantization).
  Differing block sizes on different axes must divide each other's least common multiple,
  which any set of them does."""
  if not transport:
    return 1
  return math.lcm(*(f.block_size for f in transport if f is not None))


# ----------------------------------------------------------------------------------------
# jnp: what the implementations run.


def _round_up_to_bfloat16(v):
  """Positive float32 ``v`` rounded up to the nearest bfloat16 (NaN stays NaN): a scale
  at least ``max|x| / Q``, whose product with any quantized value is exact in float32."""
  bits = lax.bitcast_convert_type(v, jnp.uint32)
  bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
  return lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


def quantize(x, fmt: BlockScaled):
  """``x`` (float32, last dimension a multiple of the block size) as ``(q, scales)``:
  ``q`` of ``x``'s shape in ``fmt.dtype``, bfloat16 ``scales`` of shape
  ``x.shape[:-1] + (x.shape[-1] // B,)``."""
  blocks = x.reshape(x.shape[:-1] + (-1, fmt.block_size))
  blocks = jnp.where(jnp.abs(blocks) < _TINY, 0.0, blocks)  # subnormals: zero, as XLA reads them
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  scaled = absmax * jnp.float32(1 / fmt.levels)
  scaled = jnp.where(scaled < _TINY, 0.0, scaled)  # a subnormal scale: zero, as XLA makes it
  finite = jnp.all(jnp.isfinite(blocks), axis=-1)
  scales = _round_up_to_bfloat16(jnp.where(finite, scaled, jnp.nan))
  wide = scales.astype(jnp.float32)
  positive = wide > 0
  reciprocal = jnp.where(positive, 1.0 / jnp.where(positive, wide, 1.0), 0.0)
  divided = blocks * reciprocal[..., None]
  divided = jnp.where(jnp.isfinite(divided), divided, 0.0)  # a non-finite block: q = 0
  if fmt.dtype == "int8":
    divided = jnp.round(divided)
  q = jnp.clip(divided, -fmt.levels, fmt.levels).astype(fmt.dtype)
  return q.reshape(x.shape), scales


def dequantize(payload, fmt: BlockScaled):
  """float32 ``q * s`` of a ``quantize`` payload (exact: ``s`` has 8 significant bits)."""
  q, scales = payload
  blocks = q.reshape(q.shape[:-1] + (-1, fmt.block_size)).astype(jnp.float32)
  return (blocks * scales.astype(jnp.float32)[..., None]).reshape(q.shape)


# ----------------------------------------------------------------------------------------
# numpy: the model the implementations are tested against, and the error bound.


def quantize_np(x: np.ndarray, fmt: BlockScaled) -> tuple[np.ndarray, np.ndarray]:
  """``quantize`` in numpy (float32 arithmetic throughout)."""
  x = np.asarray(x, np.float32)
  blocks = _flush_np(x.reshape(x.shape[:-1] + (-1, fmt.block_size)))
  with np.errstate(invalid="ignore", over="ignore"):
    absmax = np.max(np.abs(blocks), axis=-1)
    finite = np.all(np.isfinite(blocks), axis=-1)
    scaled = np.where(finite, _flush_np(absmax * np.float32(1 / fmt.levels)), np.nan)
    bits = (scaled.astype(np.float32).view(np.uint32) + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)
    scales = bits.view(np.float32)
    positive = scales > 0
    reciprocal = np.where(positive, np.float32(1) / np.where(positive, scales, np.float32(1)), 0)
    divided = blocks * reciprocal.astype(np.float32)[..., None]
  divided = np.where(np.isfinite(divided), divided, np.float32(0))
  if fmt.dtype == "int8":
    divided = np.round(divided)
  q = np.clip(divided, -fmt.levels, fmt.levels).astype(jnp.dtype(fmt.dtype))
  return q.reshape(x.shape), scales.astype(jnp.bfloat16)


def _flush_np(a: np.ndarray) -> np.ndarray:
  """``a`` with float32 subnormals replaced by zero: what XLA on CPU and TPU computes."""
  with np.errstate(invalid="ignore"):
    return np.where(np.abs(a) < _TINY, np.float32(0), a).astype(np.float32)


def dequantize_np(q: np.ndarray, scales: np.ndarray, fmt: BlockScaled) -> np.ndarray:
  blocks = q.reshape(q.shape[:-1] + (-1, fmt.block_size)).astype(np.float32)
  return (blocks * scales.astype(np.float32)[..., None]).reshape(q.shape).astype(np.float32)


def roundtrip_np(x: np.ndarray, fmt: BlockScaled | None) -> np.ndarray:
  """``x`` as it arrives after one hop in ``fmt`` (unchanged where ``fmt`` is None)."""
  if fmt is None:
    return np.asarray(x, np.float32)
  return dequantize_np(*quantize_np(x, fmt), fmt)


def quantizations(collective: str, torus: Sequence[int], transport: Transport) -> int:
  """``k``: how often the schedule of ``collective`` on ``torus`` quantizes a value, at
  most (the largest count over the streams): each reduce-scatter hop along a quantized
  axis, plus one for a gather that has a quantized axis."""
  torus, transport = drop_unit_axes(torus, transport)
  if not torus:
    return 0
  schedule = schedule_lib.build(collective, torus, schedule_lib.default_variant(torus))
  counts = []
  for phases in schedule.streams:
    scatter = sum(
      torus[p.axis] - 1 for p in phases if p.kind == "reduce_scatter" and transport[p.axis]
    )
    gather = any(p.kind == "all_gather" and transport[p.axis] and torus[p.axis] > 1 for p in phases)
    counts.append(scatter + int(gather))
  return max(counts)


def error_bound(collective: str, torus: Sequence[int], transport: Transport) -> float:
  """``c`` with ``|computed - exact| <= c * sum_i a_i`` per element, ``a_i`` the largest
  magnitude of device i's input in that element's block (see the module docstring); the
  sum of a reduce-scatter or all-reduce, or the gathered value of an all-gather (where
  ``sum_i a_i`` is the owner's ``a``)."""
  k = quantizations(collective, torus, transport)
  delta = max((f.delta for f in transport if f is not None), default=0.0)
  return (1 + delta) ** k * (1 + _F32_UNIT_ROUNDOFF) ** k - 1


def simulate(
  collective: str,
  torus: Sequence[int],
  buffers: np.ndarray,
  transport: Transport,
  schedule: schedule_lib.Schedule | None = None,
) -> np.ndarray:
  """The schedule of ``collective`` run in numpy float32 on ``p`` virtual devices, with
  the same quantization, order of adds and layout as the ``shard_map`` implementation:
  the exact model its results are tested against.

  ``buffers``: ``torus + torus + (width,)`` (device coordinates, then its chunk grid; the
  grid of an all-gather holds each device's own chunk at its own coordinates, the rest is
  ignored), with ``width`` a multiple of ``streams * block``, on a torus without axes of
  size one. Returns the same shape: the grid each device ends with (NaN outside the own
  chunk after a reduce-scatter). ``schedule``: another schedule of ``collective`` on
  ``torus`` (default: ``schedule.default_variant``'s), e.g. one stream of it.
  """
  torus = tuple(torus)
  if schedule is None:
    schedule = schedule_lib.build(collective, torus, schedule_lib.default_variant(torus))
  width = buffers.shape[-1] // schedule.num_streams
  state = np.array(buffers, np.float32)
  devices = list(np.ndindex(*torus))
  # The format each (device, stream) holds its gathered values in as bytes; they are kept
  # in ``state`` dequantized, which forwarding leaves unchanged.
  held = dict.fromkeys(itertools.product(devices, range(schedule.num_streams)))
  if schedule.streams[0][0].kind == "all_gather":
    schedule_lib.keep_own_chunks(state, devices)
  for step in schedule.steps():
    outgoing = [
      _send(state, coords, transfer, width, transport, held)
      for transfer in step
      for coords in devices
    ]
    for transfer, dest, data in outgoing:
      phase = transfer.phase
      lanes = slice(transfer.stream * width, (transfer.stream + 1) * width)
      index = transfer.slab_index(
        dest, phase.recv_slab(dest[phase.axis], transfer.step, torus[phase.axis])
      )
      view = state[dest][index]
      if phase.kind == "reduce_scatter":
        view[..., lanes] = _flush_np(data + view[..., lanes])
      else:
        view[..., lanes] = data
      state[dest][index] = view
  if schedule.streams[0][-1].kind == "reduce_scatter":
    schedule_lib.keep_own_chunks(state, devices)
  return state


def _send(state, coords, transfer, width, transport, held):
  """What the device at ``coords`` sends in ``transfer``: ``(transfer, destination,
  values as they arrive)``."""
  phase = transfer.phase
  lanes = slice(transfer.stream * width, (transfer.stream + 1) * width)
  fmt, n = transport[phase.axis], state.shape[phase.axis]
  if phase.kind == "all_gather" and transfer.step == 0:
    _enter_gather(state, coords, transfer, lanes, fmt, held)
  slab = phase.send_slab(coords[phase.axis], transfer.step, n)
  data = state[coords][transfer.slab_index(coords, slab)][..., lanes]
  if phase.kind == "reduce_scatter":
    data = roundtrip_np(data, fmt)
  dest = list(coords)
  dest[phase.axis] = (dest[phase.axis] + phase.direction) % n
  return transfer, tuple(dest), data.copy()


def _enter_gather(state, coords, transfer, lanes, fmt, held) -> None:
  """At a gather phase's start a device converts what it holds of the stream to the
  phase's format: quantizes it (once) where the phase quantizes and it is not yet held as
  bytes of that format; plain values stay as they are where the phase does not."""
  key = (coords, transfer.stream)
  if held[key] == fmt:
    return
  held[key] = fmt
  if fmt is None:  # plain values: the dequantized ones, as they are
    return
  index = tuple(
    slice(None) if a in transfer.live_axes and a != transfer.phase.axis else coords[a]
    for a in range(len(coords))
  )
  values = state[coords][index]
  values[..., lanes] = roundtrip_np(values[..., lanes], fmt)
  state[coords][index] = values
