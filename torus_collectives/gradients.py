"""Gradient summation for data-parallel training: ``all_reduce_gradients``.

A ResNet-50 gradient is 161 arrays; one collective each would pay the per-collective
latency 161 times. As Horovod's tensor fusion and PyTorch DDP's buckets do, leaves are
grouped, in the order the backward pass produces them (last layers first), into a few
buckets of at most ``bucket_bytes`` (a larger leaf gets a bucket of its own, and each
bucket holds one dtype), and each bucket is reduced by one collective that depends only on
its own leaves, so it can run while the rest of the backward pass computes.
With ``transport_dtype`` (e.g. bfloat16) the buckets travel in that dtype; the torus
implementations still accumulate floating-point partial sums in float32.

The torus implementations pack each bucket into one flat buffer. When the implementation
is XLA (what "auto" picks unless the tuner measured otherwise for this tree's size, as op
``all_reduce_gradients``), each bucket's leaves go to one variadic ``lax.psum`` /
``lax.pmean``, with no concatenate or slice copies, and equal ``lax.pmean`` of the tree
bitwise. Under XLA's default flags the TPU all-reduce combiner may merge them again
(it merges ``lax.pmean`` of a whole ResNet-50 gradient into one collective after the
backward pass); ``torus_collectives.xla_settings`` has the flags that keep them apart and
let XLA run them asynchronously.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import registry
from torus_collectives.collectives import AxisName, all_reduce

DEFAULT_BUCKET_BYTES = 32 * 2**20


def _buckets(leaves: list[jax.Array], bucket_bytes: int) -> list[list[int]]:
  """Greedy packing of leaf indices, one dtype per bucket, in the order the traced program
  computed the leaves: for gradients, the order the backward pass produces them, last
  layers first, so each bucket's collective can start while earlier layers are still
  being differentiated. Leaves that are not computed in the traced program (inputs,
  concrete arrays) keep the tree's order."""
  order = jax_internals.production_order(leaves)
  indices = sorted(range(len(leaves)), key=order.__getitem__) if order else range(len(leaves))
  buckets: list[list[int]] = []
  size = 0
  for i in indices:
    leaf = leaves[i]
    nbytes = leaf.size * leaf.dtype.itemsize
    same_dtype = buckets and leaves[buckets[-1][0]].dtype == leaf.dtype
    if same_dtype and size + nbytes <= bucket_bytes:
      buckets[-1].append(i)
      size += nbytes
    else:
      buckets.append([i])
      size = nbytes
  return buckets


def all_reduce_gradients(
  tree: Any,
  axis_name: AxisName,
  *,
  mean: bool = True,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  transport_dtype: jnp.dtype | None = None,
  implementation: str = "auto",
) -> Any:
  """Sums (``mean=False``) or averages a gradient pytree over ``axis_name``.

  Returns a tree of the same structure, shapes and dtypes. ``transport_dtype`` must be a
  floating dtype: a cast to an integer dtype would truncate every gradient to whole numbers
  (block-scaled integer transport does not exist yet), so it is refused before any work.
  """
  if transport_dtype is not None and not jnp.issubdtype(jnp.dtype(transport_dtype), jnp.floating):
    raise ValueError(
      f"transport_dtype={jnp.dtype(transport_dtype).name} is not a floating dtype: casting "
      "gradients to it would truncate them (there is no block-scaled integer transport); "
      "pass a floating transport dtype such as jnp.bfloat16, or None"
    )
  if not bucket_bytes > 0 or not math.isfinite(bucket_bytes):
    raise ValueError(f"{bucket_bytes=} must be a positive, finite number of bytes")
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  leaves, treedef = jax.tree.flatten(tree)
  for leaf in leaves:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(
        f"gradients must be floating point, got a leaf of dtype {leaf.dtype}; "
        "filter integer leaves out of the tree first"
      )
  wire = [leaf if transport_dtype is None else leaf.astype(transport_dtype) for leaf in leaves]
  torus = tuple(lax.axis_size(a) for a in axes)
  scale = 1.0 / math.prod(torus) if mean else 1.0
  nbytes = sum(w.size * w.dtype.itemsize for w in wire)
  dtype = max(wire, key=lambda w: w.size * w.dtype.itemsize).dtype if wire else jnp.float32
  if implementation == "auto":
    implementation = registry.auto_implementation(
      "all_reduce_gradients", dtype, nbytes=nbytes, torus=torus
    )
  implementation = registry.resolve("all_reduce", implementation, dtype)
  out: list[jax.Array | None] = [None] * len(leaves)
  buckets = _buckets(wire, bucket_bytes)
  if registry.runs_lax(implementation):
    # One variadic lax collective per bucket, on the leaves themselves (no packing copy):
    # each can be scheduled as soon as its bucket's gradients exist.
    for bucket in buckets:
      if transport_dtype is None:
        reduced = (lax.pmean if mean else lax.psum)([leaves[i] for i in bucket], axis_name)
      else:
        summed = lax.psum([wire[i] for i in bucket], axis_name)
        reduced = [
          (s.astype(jnp.float32) * scale).astype(leaves[i].dtype) for s, i in zip(summed, bucket)
        ]
      for i, value in zip(bucket, reduced):
        out[i] = value
    return jax.tree.unflatten(treedef, out)
  for bucket in buckets:
    flat = jnp.concatenate([wire[i].reshape(-1) for i in bucket])
    summed = all_reduce(flat, axes, implementation=implementation)
    offset = 0
    for i in bucket:
      part = summed[offset : offset + leaves[i].size].reshape(leaves[i].shape)
      out[i] = (part.astype(jnp.float32) * scale).astype(leaves[i].dtype)
      offset += leaves[i].size
  return jax.tree.unflatten(treedef, out)
