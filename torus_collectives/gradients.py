"""Gradient summation for data-parallel training: ``all_reduce_gradients``.

A ResNet-50 gradient is 161 arrays; one collective each would pay the per-collective
latency 161 times. As Horovod's tensor fusion and PyTorch DDP's buckets do, leaves are
grouped, in the order the backward pass produces them (last layers first), into a few
buckets of at most ``bucket_bytes`` (a larger leaf gets a bucket of its own, and each
bucket holds one dtype), and each bucket is reduced by one collective that depends only on
its own leaves, so it can run while the rest of the backward pass computes.
With ``transport_dtype`` (e.g. bfloat16) the buckets travel in that dtype; the torus
implementations still accumulate floating-point partial sums in float32.

The torus implementations pack each bucket into one flat buffer (the layout of
``packing``) and reduce it with one collective. When the implementation is XLA (what
"auto" picks unless the tuner measured otherwise for this tree's size, as op
``all_reduce_gradients``: the one rule, ``registry.resolve``), each bucket's leaves go to
one variadic ``lax.psum`` / ``lax.pmean``, with no concatenate or slice copies, and equal
``lax.pmean`` of the tree bitwise. jax lowers that to one all-reduce per leaf, and XLA's
TPU compiler decides the rest: under its default flags its combiner merges a whole
ResNet-50 gradient into one synchronous collective after the backward pass; under
``torus_collectives.xla_settings`` it merges only the small ones and runs most of the
others asynchronously, each once the backward pass has produced its leaf (it overlaps
single arrays that a fusion computes, not packed buffers, and in ResNet-50 not the 9 MiB
last-stage kernels: see that module).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import axes, packing, registry
from torus_collectives.collectives import AxisName, all_reduce

DEFAULT_BUCKET_BYTES = 32 * 2**20
# The named scopes (``jax.named_scope``) of the data-parallel step's collectives: every
# op of a gradient summation (here, and ``sharded_update``'s reduce-scatter) and of
# ``sharded_update``'s weight all-gather carries one in its compiled ``op_name``, which is
# how ``bench.overlap_report`` tells them from the step's other collectives.
GRADIENT_SCOPE = "gradient_summation"
WEIGHT_GATHER_SCOPE = "weight_gather"


def _check_arguments(leaves, bucket_bytes, transport_dtype) -> None:
  if transport_dtype is not None and not jnp.issubdtype(jnp.dtype(transport_dtype), jnp.floating):
    raise ValueError(
      f"transport_dtype={jnp.dtype(transport_dtype).name} is not a floating dtype: casting "
      "gradients to it would truncate them (there is no block-scaled integer transport); "
      "pass a floating transport dtype such as jnp.bfloat16, or None"
    )
  if not bucket_bytes > 0 or not math.isfinite(bucket_bytes):
    raise ValueError(f"{bucket_bytes=} must be a positive, finite number of bytes")
  for leaf in leaves:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(
        f"gradients must be floating point, got a leaf of dtype {leaf.dtype}; "
        "filter integer leaves out of the tree first"
      )


def _request(wire: list[jax.Array], torus: tuple[int, ...]) -> registry.Request:
  """The gradient summation as one request: its bytes on the wire, over ``torus``, looked
  up for the dtype that carries most of them."""
  nbytes = sum(w.size * w.dtype.itemsize for w in wire)
  dtype = max(wire, key=lambda w: w.size * w.dtype.itemsize).dtype if wire else jnp.float32
  dtypes = tuple(dict.fromkeys([jnp.dtype(dtype), *(w.dtype for w in wire)]))
  return registry.Request("all_reduce_gradients", dtypes, nbytes, torus)


def _on_lax(leaves, wire, buckets, axis_name, mean, scale, transport_dtype) -> list[jax.Array]:
  """One variadic lax collective per bucket, on the leaves themselves (no packing copy)."""
  out: list[jax.Array | None] = [None] * len(leaves)
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
  return out


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
  names = axes.names(axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  _check_arguments(leaves, bucket_bytes, transport_dtype)
  torus = tuple(lax.axis_size(a) for a in names)
  scale = 1.0 / math.prod(torus) if mean else 1.0
  with jax.named_scope(GRADIENT_SCOPE):
    wire = [leaf if transport_dtype is None else leaf.astype(transport_dtype) for leaf in leaves]
    implementation = registry.resolve(implementation, _request(wire, torus))
    # The gradients' own order (the casts to the transport dtype run in tree order).
    buckets = packing.buckets_by_size(wire, bucket_bytes, packing.computed_order(leaves))
    if registry.runs_lax(implementation):
      out = _on_lax(leaves, wire, buckets, axis_name, mean, scale, transport_dtype)
    else:
      summed = packing.through_buckets(
        lambda flat: all_reduce(flat, names, implementation=implementation),
        [w.reshape(-1) for w in wire],
        buckets,
        [w.size for w in wire],
      )
      out = [
        (part.reshape(leaf.shape).astype(jnp.float32) * scale).astype(leaf.dtype)
        for part, leaf in zip(summed, leaves)
      ]
  return jax.tree.unflatten(treedef, out)
