"""The paper's schedule on XLA's own collectives: per-axis ``lax.psum_scatter`` and
``lax.all_gather``.

Where ``backends.shard_map`` executes every ring step of a ``schedule.Schedule`` as a
``lax.ppermute``, this implementation hands each *phase* (a reduce-scatter or all-gather
along one torus axis) to XLA as one collective over that mesh axis, as Horovod's
hierarchical all-reduce and Sony's 2D-Torus all-reduce compose vendor collectives. The
phases come from the same schedule (``schedule.default_variant``): on a 2-D torus the
split schedule, whose two halves (x then y, y then x) are two independent chains of
collectives, so XLA may run them concurrently. Ring direction is XLA's business, so streams
that differ only in direction are one chain here.

Each chain works on its slice of every chunk; the grid of chunks is the buffer viewed as
``torus + (width,)``, row-major over ``axes`` as ``lax.psum_scatter(x, axes, tiled=True)``
orders them. Sums are XLA's, in the input dtype, as ``lax.psum`` computes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import schedule as schedule_lib
from torus_collectives.axes import drop_unit_axes
from torus_collectives.tiling import ceil_div

AxisNames = tuple[str, ...]
Chain = tuple[tuple[str, int], ...]  # (phase kind, grid axis), in order


@functools.cache
def chains(collective: str, torus: tuple[int, ...]) -> tuple[Chain, ...]:
  """The distinct per-axis phase sequences of the schedule's streams."""
  sched = schedule_lib.build(collective, torus, schedule_lib.default_variant(torus))
  out: list[Chain] = []
  for phases in sched.streams:
    chain = tuple((p.kind, p.axis) for p in phases)
    if chain not in out:
      out.append(chain)
  return tuple(out)


def _run_chain(grid: jax.Array, chain: Chain, axes: AxisNames, gathering: bool) -> jax.Array:
  """Runs one chain; ``grid`` holds the live grid axes (sorted) then the chunk width."""
  live = [] if gathering else list(range(len(axes)))
  for kind, axis in chain:
    with jax.named_scope(f"{kind}_{axes[axis]}"):
      if kind == "reduce_scatter":
        grid = lax.psum_scatter(grid, axes[axis], scatter_dimension=live.index(axis))
        live.remove(axis)
      else:
        live = sorted(live + [axis])
        grid = lax.all_gather(grid, axes[axis], axis=live.index(axis))
  return grid


def _execute(collective: str, grid: jax.Array, axes: AxisNames, torus: tuple[int, ...]):
  """Splits the chunk width over the chains, runs them, and joins their results."""
  torus, axes = drop_unit_axes(torus, axes)
  if not torus:
    return grid
  if collective != "all_gather":
    grid = grid.reshape(torus + grid.shape[-1:])
  todo = chains(collective, torus)
  slices = jnp.split(grid, len(todo), axis=-1)
  gathering = collective == "all_gather"
  return jnp.concatenate([_run_chain(s, c, axes, gathering) for s, c in zip(slices, todo)], axis=-1)


def _num_chains(torus: tuple[int, ...]) -> int:
  (kept,) = drop_unit_axes(torus)
  return len(chains("all_reduce", kept)) if kept else 1


def _pad_last(x: jax.Array, width: int) -> jax.Array:
  extra = width - x.shape[-1]
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x


def reduce_scatter(x: jax.Array, axes: AxisNames, torus: tuple[int, ...]) -> jax.Array:
  """(p*m,) -> (m,): this device's chunk of the sum, chunks row-major over ``axes``."""
  p = math.prod(torus)
  m = x.shape[0] // p
  k = _num_chains(torus)
  grid = _pad_last(x.reshape(p, m), ceil_div(m, k) * k)
  return _execute("reduce_scatter", grid, axes, torus).reshape(-1)[:m]


def all_gather(x: jax.Array, axes: AxisNames, torus: tuple[int, ...]) -> jax.Array:
  """(m,) -> (p*m,): every device's chunk, row-major over ``axes``."""
  p, m = math.prod(torus), x.shape[0]
  k = _num_chains(torus)
  out = _execute("all_gather", _pad_last(x, ceil_div(m, k) * k), axes, torus)
  return out.reshape(p, -1)[:, :m].reshape(p * m)


def all_reduce(x: jax.Array, axes: AxisNames, torus: tuple[int, ...]) -> jax.Array:
  """(n,) -> (n,): the sum over ``axes``. Which element sits in which chunk does not
  matter here, so the buffer is padded once and viewed as the grid directly."""
  p, n = math.prod(torus), x.shape[0]
  k = _num_chains(torus)
  width = ceil_div(n, p * k) * k
  grid = _pad_last(x, p * width).reshape(p, width)
  return _execute("all_reduce", grid, axes, torus).reshape(-1)[:n]
