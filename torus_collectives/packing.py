"""Pytree leaves <-> flat buffers, one per bucket: the packing every bucketed collective uses.

The collectives (``psum``, ``psum_scatter``, ``all_gather`` of a pytree), the gradient
summation and ``sharded_update`` move many leaves with a few collectives. They all pack
the same way:

* **Leaf order.** Leaves are numbered in ``jax.tree.flatten`` order, and a bucket is a
  list of leaf indices; results are written back to the same indices, so the tree's
  structure is kept.
* **Buckets.** ``buckets_by_dtype``: one bucket per dtype, the dtypes in the order of their
  first leaf, each bucket's leaves in tree order (the collectives: one collective per
  dtype). ``buckets_by_size``: greedy buckets of at most ``bucket_bytes`` (a larger leaf
  gets a bucket of its own) holding one dtype each, filled in the order the traced program
  computed the leaves (for gradients, the backward pass's order, last layers first), so
  each bucket's collective can start while the rest is still being computed.
* **Pieces and buffers.** Each leaf enters a bucket as a piece: flat ``[w]``, or ``[r, w]``
  rows (all pieces of a bucket have the same ``r``). ``pack`` lays a bucket's pieces side
  by side, the buffer being the row-major flattening of ``[r, sum w_i]``, piece ``i`` in
  columns ``[o_i, o_i + w_i)`` with ``o_i`` the widths of the pieces before it. With ``r =
  p`` rows (row ``d`` for device ``d``), a tiled reduce-scatter of the buffer hands device
  ``d`` row ``d``: its chunk of every leaf at once; a tiled all-gather of flat pieces
  returns ``[p, sum w_i]``, row ``d`` from device ``d``. ``unpack`` cuts a buffer viewed
  as ``[r, sum w_i]`` (or flat) back into the pieces.
* **Padding.** ``as_rows`` views a leaf of ``n`` elements as ``[p, m]``, ``m = ceil(n /
  p)``, zero-padding its flat values at the end to ``p * m`` (a static-shaped shard per
  device, the zeros adding nothing to sums); ``from_rows`` drops the padding again. Pieces
  whose size ``p`` divides are not padded.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from torus_collectives import _jax_internals as jax_internals
from torus_collectives.tiling import ceil_div, pad_to


def buckets_by_dtype(leaves: Sequence[jax.Array]) -> list[list[int]]:
  """Leaf indices per dtype, in tree order: each bucket travels as one buffer."""
  buckets: dict[jnp.dtype, list[int]] = {}
  for i, leaf in enumerate(leaves):
    buckets.setdefault(leaf.dtype, []).append(i)
  return list(buckets.values())


def computed_order(leaves: Sequence[jax.Array]) -> list[int] | None:
  """Leaf indices in the order the enclosing traced program computed the leaves (for
  gradients, the backward pass's: last layers first), or None when some leaf was not
  computed there (an input, a concrete array)."""
  produced = jax_internals.production_order(leaves)
  return None if produced is None else sorted(range(len(leaves)), key=produced.__getitem__)


def buckets_by_size(
  leaves: Sequence[jax.Array], bucket_bytes: int, order: Sequence[int] | None = None
) -> list[list[int]]:
  """Greedy packing of leaf indices into buckets of at most ``bucket_bytes`` (a larger leaf
  gets one of its own), one dtype per bucket, filled in ``order`` (every leaf index once):
  by default ``computed_order``, so that for gradients each bucket's collective can start
  while earlier layers are still being differentiated, or the tree's order where that is
  not known. Leaves need only ``shape`` and ``dtype``."""
  if order is None:
    order = computed_order(leaves) or range(len(leaves))
  elif sorted(order) != list(range(len(leaves))):
    raise ValueError(f"order must hold every leaf index 0..{len(leaves) - 1} once, got {order}")
  buckets: list[list[int]] = []
  size = 0
  for i in order:
    leaf = leaves[i]
    nbytes = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    same_dtype = buckets and leaves[buckets[-1][0]].dtype == leaf.dtype
    if same_dtype and size + nbytes <= bucket_bytes:
      buckets[-1].append(i)
      size += nbytes
    else:
      buckets.append([i])
      size = nbytes
  return buckets


def first_use_order(fn: Callable, tree, *args) -> list[int]:
  """Leaf indices of ``tree`` (in ``jax.tree.flatten`` order) sorted by where the traced
  ``fn(tree, *args)`` first reads each leaf: for parameters and a model's forward pass,
  the order in which the layers need their weights (leaves it never reads come last, in
  tree order). ``buckets_by_size(..., order=...)`` with it fills buckets first layers
  first, so that a gather of the weights can run ahead of the layers that need them."""
  closed = jax.make_jaxpr(fn)(tree, *args)
  count = len(jax.tree.leaves(tree))
  leaf_of = {var: i for i, var in enumerate(closed.jaxpr.invars[:count])}
  var_type = type(closed.jaxpr.invars[0]) if closed.jaxpr.invars else ()  # not a Literal
  first: dict[int, int] = {}
  for position, eqn in enumerate(closed.jaxpr.eqns):
    for var in eqn.invars:
      if isinstance(var, var_type) and var in leaf_of:
        first.setdefault(leaf_of[var], position)
  never = len(closed.jaxpr.eqns)
  return sorted(range(count), key=lambda i: (first.get(i, never), i))


def as_rows(x: jax.Array, rows: int) -> jax.Array:
  """``x`` flattened, zero-padded at its end to a multiple of ``rows`` and viewed as
  ``[rows, m]``, ``m = ceil(x.size / rows)``: row ``d`` is shard ``d``."""
  m = ceil_div(x.size, rows)
  if x.size == rows * m:
    return x.reshape(rows, m)
  return pad_to(x.reshape(-1), rows * m).reshape(rows, m)


def from_rows(rows: jax.Array, shape: Sequence[int]) -> jax.Array:
  """The inverse of ``as_rows``: the rows flattened, the padding dropped, as ``shape``."""
  return rows.reshape(-1)[: math.prod(shape)].reshape(shape)


def pack(pieces: Sequence[jax.Array]) -> jax.Array:
  """One flat buffer of a bucket's pieces: all flat ``[w_i]``, or all ``[r, w_i]`` with
  the same ``r`` (laid side by side, then flattened row-major)."""
  if pieces[0].ndim == 1:
    return jnp.concatenate(pieces)
  return jnp.concatenate(pieces, axis=1).reshape(-1)


def unpack(buffer: jax.Array, widths: Sequence[int], rows: int | None = None) -> list[jax.Array]:
  """``buffer`` cut back into its pieces of ``widths``: flat ``[w_i]`` pieces, or with
  ``rows``, the buffer viewed as ``[rows, sum w_i]`` and cut into ``[rows, w_i]``."""
  grid = buffer if rows is None else buffer.reshape(rows, -1)
  ends = list(itertools.accumulate(widths))
  return [grid[..., end - w : end] for w, end in zip(widths, ends)]


def through_buckets(
  collective: Callable[[jax.Array], jax.Array],
  pieces: Sequence[jax.Array],
  buckets: Sequence[Sequence[int]],
  widths: Sequence[int],
  rows: int | None | tuple = None,
) -> list[jax.Array]:
  """For each bucket: its pieces packed into one buffer, ``collective`` applied to it (one
  call per bucket, in bucket order), and the result unpacked into per-leaf pieces of
  ``widths`` (indexed as the leaves; see ``unpack`` for ``rows``). A collective that
  returns a tuple of buffers gives a tuple of such lists (``rows`` then one entry per
  buffer, or one for all)."""
  outs: list[list] | None = None
  for bucket in buckets:
    result = collective(pack([pieces[i] for i in bucket]))
    results = result if isinstance(result, tuple) else (result,)
    outs = outs or [[None] * len(pieces) for _ in results]
    layouts = rows if isinstance(rows, tuple) else (rows,) * len(results)
    for out, buffer, layout in zip(outs, results, layouts):
      for i, piece in zip(bucket, unpack(buffer, [widths[i] for i in bucket], layout)):
        out[i] = piece
  if outs is None:
    return [None] * len(pieces)
  return tuple(outs) if isinstance(result, tuple) else outs[0]
