"""Gradient summation for data-parallel training: ``all_reduce_gradients``.

A ResNet-50 gradient is 161 arrays; one collective each would pay the per-collective
latency 161 times. As Horovod's tensor fusion and PyTorch DDP's buckets do, leaves are
grouped, in the order the backward pass produces them (last layers first), into a few
buckets of at most ``bucket_bytes`` (a larger leaf gets a bucket of its own, and each
bucket holds one dtype), and each bucket is reduced by one collective that depends only on
its own leaves, so it can run while the rest of the backward pass computes.
With ``transport_dtype`` (e.g. bfloat16) the buckets travel in that dtype; the torus
implementations still accumulate floating-point partial sums in float32. With a
block-scaled one (``jnp.int8``, fp8, ``tc.BlockScaled``, per axis) they travel as int8 or
fp8 blocks with a scale each, requantized at every hop (``torus_collectives.quantization``:
the format, the error bound), optionally with error feedback (``residual=``).

"pallas" takes a bucket's leaves where they lie: the leaves of two or more dimensions
whose second-minor one is a whole number of tiles go to its leaf kernels in their own
shapes and come back summed in place; only the rest (vectors, odd shapes) is packed, into
one more small leaf (the backend's ``all_reduce_leaves``). The other torus
implementations pack each bucket into one flat buffer (the layout of ``packing``) and
reduce it with one collective. When the implementation is XLA (what
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

A whole-train-step tuning (``tuning.step_tuning.tune_step``) times the user's step with each
implementation and bucket size; where it measured one for this tree (device kind,
topology, dominant dtype, size bucket of its bytes), "auto" runs that implementation, and
that bucket size unless the caller passes ``bucket_bytes`` (``registry.tuned_step``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import axes, packing, quantization, registry
from torus_collectives._vma import ensure_varying, mark_invariant
from torus_collectives.collectives import AxisName, all_reduce

DEFAULT_BUCKET_BYTES = 32 * 2**20
# The named scopes (``jax.named_scope``) of the data-parallel step's collectives: every
# op of a gradient summation (here, and ``sharded_update``'s reduce-scatter) and of
# ``sharded_update``'s weight all-gather carries one in its compiled ``op_name``, which is
# how ``bench.overlap_report`` tells them from the step's other collectives.
GRADIENT_SCOPE = "gradient_summation"
WEIGHT_GATHER_SCOPE = "weight_gather"

_recorders: list[list[registry.Request]] = []


@contextlib.contextmanager
def recorded_requests():
  """Collects the ``registry.Request`` of every ``all_reduce_gradients`` call traced inside
  (a list, filled as they are traced): how the step tuner learns which gradient summation
  a train step makes, the key of what it measures."""
  seen: list[registry.Request] = []
  _recorders.append(seen)
  try:
    yield seen
  finally:
    _recorders.remove(seen)


def _check_arguments(leaves, bucket_bytes) -> None:
  if not bucket_bytes > 0 or not math.isfinite(bucket_bytes):
    raise ValueError(f"{bucket_bytes=} must be a positive, finite number of bytes")
  for leaf in leaves:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(
        f"gradients must be floating point, got a leaf of dtype {leaf.dtype}; "
        "filter integer leaves out of the tree first"
      )


def summation_request(
  wire: list, torus: tuple[int, ...], block_scaled: bool = False
) -> registry.Request:
  """The gradient summation of the leaves ``wire`` (arrays or their shapes, as sent) as
  one request: its bytes on the wire, over ``torus``, looked up for the dtype that
  carries most of them."""
  nbytes = sum(w.size * w.dtype.itemsize for w in wire)
  dtype = max(wire, key=lambda w: w.size * w.dtype.itemsize).dtype if wire else jnp.float32
  dtypes = tuple(dict.fromkeys([jnp.dtype(dtype), *(w.dtype for w in wire)]))
  return registry.Request("all_reduce_gradients", dtypes, nbytes, torus, block_scaled=block_scaled)


def _cast_transport(transport_dtype, names):
  """``(cast dtype, block-scaled transport)`` of a ``transport_dtype=`` argument: a
  floating dtype is a cast before the collective, an int8 or fp8 dtype, a
  ``BlockScaled`` or a mapping per axis is block-scaled transport
  (``quantization.transport_per_axis``). Any other dtype is refused: a cast to an integer
  would truncate every gradient to whole numbers."""
  if transport_dtype is None or quantization.is_block_scaled(transport_dtype):
    return None, quantization.transport_per_axis(transport_dtype, names)
  dtype = jnp.dtype(transport_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"transport_dtype={dtype.name} is neither a floating dtype nor a block-scaled format: "
      "casting gradients to it would truncate them; pass jnp.int8 (block-scaled), a "
      "floating dtype such as jnp.bfloat16, or None"
    )
  return dtype, None


def _block_scaled_sum(flat, names, implementation, transport, with_residual: bool):
  """The all-reduce of one packed bucket with block-scaled transport; with error feedback
  through the backend itself, which also returns what this device's quantizations took
  off (see ``backends.shard_map``)."""
  if not with_residual:
    per_axis = dict(zip(names, transport))
    return all_reduce(flat, names, implementation=implementation, transport_dtype=per_axis)
  sizes = tuple(lax.axis_size(a) for a in names)
  backend = registry.collective_backend(implementation)
  total, residual = backend.all_reduce(
    ensure_varying(flat, names), names, sizes, transport=transport, with_residual=True
  )
  return mark_invariant(total, names), residual


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


def _leaves_backend(implementation: str):
  """The backend's sum of a bucket's leaves where they lie, or None where it has none."""
  return registry.collective_backend(implementation).all_reduce_leaves


def _where_they_lie(all_reduce_leaves, wire, buckets, names, torus) -> list[jax.Array]:
  """One call per bucket on its leaves as they are: no concatenation packs them and no
  slice unpacks the sums (the backend packs only leaves its kernels cannot take)."""
  out: list[jax.Array | None] = [None] * len(wire)
  for bucket in buckets:
    sums = all_reduce_leaves([ensure_varying(wire[i], names) for i in bucket], names, torus)
    for i, total in zip(bucket, sums):
      out[i] = mark_invariant(total, names)
  return out


def all_reduce_gradients(
  tree: Any,
  axis_name: AxisName,
  *,
  mean: bool = True,
  bucket_bytes: int | None = None,
  transport_dtype: Any = None,
  implementation: str = "auto",
  residual: Any = None,
) -> Any:
  """Sums (``mean=False``) or averages a gradient pytree over ``axis_name``, in buckets.

  Call it inside ``jax.shard_map`` on each device's gradients, where ``lax.pmean(grads,
  axes)`` would go. The leaves are grouped, in the order the backward pass produces them,
  into buckets of one dtype and at most ``bucket_bytes``, and each bucket is reduced by
  one collective (module ``torus_collectives.gradients``). On XLA, without
  ``transport_dtype``, each bucket is one variadic ``lax.psum`` / ``lax.pmean`` of its
  leaves, and the result equals ``lax.pmean`` (``lax.psum``) of the tree bitwise.

  Args:
    tree: a pytree of floating-point gradients.
    axis_name: the mesh axis, or tuple of axes, bound by the enclosing ``shard_map``.
    mean: True (default): divide the sums by the number of devices; False: sums.
    bucket_bytes: the largest bucket (a larger leaf gets one of its own); a positive,
      finite number of bytes. None (default): ``DEFAULT_BUCKET_BYTES`` (32 MiB), or under
      "auto" the bucket size a whole-step tuning measured for this tree
      (``tuning.step_tuning``).
    transport_dtype: None (default: the gradients' own dtype), a floating dtype (each
      bucket is cast to it, e.g. ``jnp.bfloat16``, and the result cast back), or
      block-scaled transport: ``jnp.int8``, an fp8 dtype, a ``tc.BlockScaled`` (to choose
      the block size), or a mapping from axis name to one of those (e.g.
      ``{"dcn": jnp.int8}``: quantize only the hops between slices). Block-scaled
      transport is lossy within ``quantization.error_bound`` and not differentiable;
      "auto" runs it on an implementation that has it ("shard_map"), "xla" and
      "lax_torus" refuse it, "pallas" runs int8 blocks of 128 on every axis.
    implementation: ``"auto"`` (default): the implementation and bucket size a
      whole-step tuning measured for this tree, where one did; otherwise what a tuning
      table measured for op ``"all_reduce_gradients"`` at this size (``resolve``), XLA
      where nothing was. Or ``"xla"``, ``"shard_map"``, ``"lax_torus"``, ``"pallas"``
      (see ``Implementation``) or a registered name.
    residual: None (default), or error feedback, with block-scaled transport only: a
      tree like ``tree`` of float32 leaves, zeros at the first step; each device's own,
      so typed varying over the axes under ``check_vma`` (``lax.pcast(zeros, axes,
      to="varying")`` in a loop carry). It is added to the gradients before they are
      summed. Over the devices the residuals sum to the step's error, so what a step
      drops the next one sends: the summed gradients of steps 1..T differ from the exact
      ones by the last residual alone, not by T steps of error (EF-SGD). Runs on
      "shard_map" (and "auto", which picks it).

  Returns:
    The means (or sums), a tree of ``tree``'s structure, shapes and dtypes. With
    ``residual``, a pair ``(that tree, new_residual)``, where ``new_residual`` is what
    this device's quantizations took off, to pass to the next step.

  Raises:
    ValueError: before any work: a ``bucket_bytes`` that is not a positive, finite
      number; a leaf that is not floating point (filter integer leaves out first); a
      ``transport_dtype`` that is neither floating nor block-scaled (pass ``jnp.int8``,
      a floating dtype or None), or a mapping that names an axis outside ``axis_name``;
      ``residual`` without block-scaled transport (pass ``transport_dtype=jnp.int8``);
      an unknown ``implementation``; an explicit implementation that does not run the
      summation (block-scaled transport on "xla" or "lax_torus", ``residual`` or another
      format than int8 blocks of 128 on "pallas", a dtype "pallas" lacks): the message
      names one that does. When compiled: ``"pallas"`` for a device that is not a TPU,
      outside TPU interpret mode.
    NotImplementedError: differentiating through a block-scaled summation; ``"pallas"``
      on TPU v2 or v3; more than three mesh axes on a torus implementation.
    NameError: ``axis_name`` names an axis that nothing binds.
  """
  names = axes.names(axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  _check_arguments(leaves, DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
  cast, transport = _cast_transport(transport_dtype, names)
  if residual is not None and transport is None:
    raise ValueError(
      "residual= (error feedback) needs a block-scaled transport_dtype such as jnp.int8"
    )
  if residual is not None:
    residual_leaves = treedef.flatten_up_to(residual)
    leaves = [(g.astype(jnp.float32) + r).astype(g.dtype) for g, r in zip(leaves, residual_leaves)]
  torus = tuple(lax.axis_size(a) for a in names)
  scale = 1.0 / math.prod(torus) if mean else 1.0
  with jax.named_scope(GRADIENT_SCOPE):
    wire = [leaf if cast is None else leaf.astype(cast) for leaf in leaves]
    request = summation_request(wire, torus, block_scaled=transport is not None)
    for seen in _recorders:
      seen.append(request)
    step = registry.tuned_step(request) if implementation == "auto" else None
    if step is not None:  # a whole-step tuning's choice, its bucket size if ours is unset
      implementation, tuned_bucket = step
      bucket_bytes = tuned_bucket if bucket_bytes is None else bucket_bytes
    implementation = registry.resolve(implementation, request)
    bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    # The gradients' own order (the casts to the transport dtype run in tree order).
    buckets = packing.buckets_by_size(wire, bucket_bytes, packing.computed_order(leaves))
    new_residual = None
    if registry.runs_lax(implementation):
      out = _on_lax(leaves, wire, buckets, axis_name, mean, scale, cast)
    elif transport is None and (leaf_sum := _leaves_backend(implementation)) is not None:
      summed = _where_they_lie(leaf_sum, wire, buckets, names, torus)
      out = [
        (part.astype(jnp.float32) * scale).astype(leaf.dtype) for part, leaf in zip(summed, leaves)
      ]
    else:
      if transport is None:
        collective = lambda flat: all_reduce(flat, names, implementation=implementation)
      else:
        collective = functools.partial(
          _block_scaled_sum,
          names=names,
          implementation=implementation,
          transport=transport,
          with_residual=residual is not None,
        )
      summed = packing.through_buckets(
        collective, [w.reshape(-1) for w in wire], buckets, [w.size for w in wire]
      )
      if residual is not None:
        summed, new_residual = summed
      out = [
        (part.reshape(leaf.shape).astype(jnp.float32) * scale).astype(leaf.dtype)
        for part, leaf in zip(summed, leaves)
      ]
  result = jax.tree.unflatten(treedef, out)
  if residual is None:
    return result
  residuals = [r.reshape(leaf.shape) for r, leaf in zip(new_residual, leaves)]
  return result, jax.tree.unflatten(treedef, residuals)
