"""Torus collectives as sequences of split Pallas calls, issued one call at a time.

A ``SplitCollective`` is a reduce-scatter, all-gather or all-reduce over one or more torus
axes, built from the split ring phases of ``async_torus`` (each phase a start, ``n - 2``
steps and a done), chained in the order of the paper's torus schedule
(``schedule.build(kind, torus, "torus")``, one direction): a reduce-scatter along every
axis in turn, each on the chunk the previous one left; an all-gather back along the axes
in reverse; an all-reduce both. Between any two calls the DMAs of the last one are on the
link, and whoever drives the sequence (``advance``) may place compute there, pinned to
the sequence with ``pin``: how ``torus_collectives.overlap`` threads gradient summation
through the backward pass.

Axes are given as ``(name, size)`` pairs in the caller's order; the reduce-scatter of
``x`` over ``("x", "y")`` leaves device ``(i, j)`` chunk ``i * ny + j`` of the sum, as
``lax.psum_scatter(x, ("x", "y"), tiled=True)`` does, and the all-gather is its inverse.
A phase of size 1 is skipped. The buffer must split into whole 512-byte DMA words per
final chunk (``padded_elements``).

What this chaining does not do that the blocking kernels do: the phases run one after
another over single rings in one direction, so one link of each chip carries traffic at a
time (the blocking torus schedules interleave 2N streams over all 2N links). Per-phase
traffic is the ring's ``(n - 1) / n`` of the phase's buffer, so the total is the same as
the paper's torus schedule; the bandwidth of the other links is left unused. Nothing has
run on a TPU (see ``async_torus``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax

from torus_collectives.kernels import async_torus
from torus_collectives.kernels.buffer_layout import dma_alignment

Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]


def padded_elements(elements: int, sizes: Sequence[int], itemsize: int) -> int:
  """The smallest length ``>= elements`` that an all-reduce over axes of ``sizes`` takes:
  a whole number of DMA words for every device's final chunk."""
  unit = math.prod(sizes) * dma_alignment(itemsize)
  return -(-elements // unit) * unit


def _phases(collective: Collective, axes) -> list[tuple[str, str, int]]:
  axes = [(name, int(size)) for name, size in axes if int(size) > 1]
  scatter = [("reduce_scatter", name, size) for name, size in axes]
  gather = [("all_gather", name, size) for name, size in reversed(axes)]
  return {"reduce_scatter": scatter, "all_gather": gather, "all_reduce": scatter + gather}[
    collective
  ]


class SplitCollective:
  """One collective as a queue of Pallas calls (module doc).

  ``result_elements``: the length ``finish`` returns, where ``x`` was padded.
  ``advance()`` issues the next call, ``pin(values)`` ties ``values`` to the sequence
  where it stands (what comes out is ready only after the last issued call, and the next
  call waits for it), ``finish()`` issues every call left and returns the result. The
  sequence holds the current ``async_torus.RingState`` (or, between phases, the array a
  done call returned); nothing is computed until a call is issued. Calls are traced in
  the order they are issued, so every device must drive its sequences the same way (they
  do under ``shard_map``: the program is one).
  """

  def __init__(
    self,
    collective: Collective,
    x: jax.Array,
    axes: Sequence[tuple[str, int]],
    mesh_axes,
    result_elements: int | None = None,
  ):
    self.collective = collective
    self.mesh_axes = tuple(mesh_axes)
    self.result_elements = result_elements
    self._value = x
    self._calls: list[Callable] = []
    for kind, name, n in _phases(collective, axes):
      self._calls.append(
        lambda value, kind=kind, name=name, n=n: async_torus.ring_start(
          kind, value, name, n, self.mesh_axes
        )
      )
      self._calls += [async_torus.ring_step] * (n - 2)
      self._calls.append(async_torus.ring_done)
    self._check(x, axes)

  def _check(self, x, axes) -> None:
    """Every phase's chunk is a whole number of DMA words (raises before any call)."""
    sizes = [int(size) for _, size in axes]
    total = x.shape[0] if x.ndim == 1 else -1
    if self.collective == "all_gather":
      total *= math.prod(sizes)
    if total < 0 or total != padded_elements(total, sizes, x.dtype.itemsize):
      unit = math.prod(sizes) * dma_alignment(x.dtype.itemsize)
      raise ValueError(
        f"a split {self.collective} over {list(axes)} takes a 1-D buffer whose full length "
        f"is a multiple of {unit} elements (whole DMA words per device), got "
        f"{x.dtype}{list(x.shape)}; pad it (split_collectives.padded_elements)"
      )
    for _, name, _ in _phases(self.collective, axes):
      if name not in self.mesh_axes:
        raise ValueError(f"axis {name!r} is not one of mesh_axes={self.mesh_axes}")

  @property
  def calls_left(self) -> int:
    """Calls not yet issued; the collective is complete when this is 0."""
    return len(self._calls)

  def advance(self) -> None:
    """Issues the next call."""
    if not self._calls:
      raise ValueError(f"the split {self.collective} has issued all its calls")
    self._value = self._calls.pop(0)(self._value)

  def pin(self, values):
    """``values`` through one optimization barrier with the sequence's in-flight buffer
    (``async_torus.pin``); returns them."""
    self._value, values = async_torus.pin(self._value, values)
    return values

  def finish(self) -> jax.Array:
    """Issues every call left; returns the collective's result (its first
    ``result_elements`` elements, if given: the length before padding)."""
    while self._calls:
      self.advance()
    return self._value if self.result_elements is None else self._value[: self.result_elements]


def run(
  collective: Collective,
  x: jax.Array,
  axes: Sequence[tuple[str, int]],
  mesh_axes: Sequence[str],
  between: Callable[..., object] | None = None,
  operands=(),
):
  """The whole collective, with ``between(i, *operands)`` (if given) in the window after
  the ``i``-th call, pinned on both sides as in ``async_torus.ring_phase``. Returns the
  result, or ``(result, results)`` with the hook's results."""
  split = SplitCollective(collective, x, axes, mesh_axes)
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
