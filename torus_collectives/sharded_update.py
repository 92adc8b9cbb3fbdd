"""Cross-replica weight-update sharding: reduce-scatter, optimizer on 1/p, all-gather.

Data-parallel training usually all-reduces the gradients and then runs the optimizer on
every replica, so each of the p devices repeats the same optimizer arithmetic and holds a
full copy of its state. Xu et al. 2020 ("Automatic Cross-Replica Sharding of Weight Update
in Data-Parallel Training"; Google's MLPerf ResNet-50 on TPU pods) split the all-reduce
into its two halves and put the optimizer between them:

  1. reduce-scatter the gradients: device d receives the mean of shard d of every leaf;
  2. run the optimizer on that 1/p shard, with the matching shard of the parameters and a
     state that only ever exists as that shard;
  3. add the update to the parameter shard and all-gather the new parameters, so every
     device again holds all of them (replicated).

The bytes on the wire are those of one all-reduce; the optimizer's FLOPs and its state per
device shrink p times. ``sharded_update(tx, axis_name)`` wraps any optax transformation
this way, called inside ``jax.shard_map`` with per-replica gradients and replicated
parameters: ``apply_gradients`` is the step above and returns the new parameters;
``init`` and ``update`` make it an optax gradient transformation too, ``update``
all-gathering the update instead (same bytes) for ``optax.apply_updates``, whose add then
runs on every replica over all the weights (one FLOP per weight, all of them).

Layout. Every leaf is flattened, zero-padded to a multiple of p and viewed as ``[p, m]``
(``m = ceil(size / p)``); row d is device d's shard. Leaves are grouped into flat buckets
as ``all_reduce_gradients`` groups them (same packing, one dtype per bucket), and a bucket
is the ``[p, sum m]`` concatenation of its leaves' rows, so one tiled reduce-scatter hands
device d row d: a static-shaped shard of *every* leaf. The inner transformation therefore
sees a pytree with the parameters' structure whose leaves are 1-D shards, and masks
(callables on the tree or trees of booleans, e.g. LARS's kernel-only weight decay and trust
ratio) select exactly the leaves they select unsharded.

Assumptions: the inner transformation is elementwise within each leaf (momentum, Adam,
weight decay, schedules, masks and their chains), except for reductions over a whole
leaf, which must be summed over ``axis_name``. ``scale_by_trust_ratio`` and ``lars`` here
do that for LARS: each step sums the local squared norms of every masked leaf's parameters
and update in one vector of 2L floats with one ``lax.psum`` (one small reduction per step,
not one per layer). Padding is zeros, so it changes neither sums nor norms, and the padded
updates are dropped when shapes are restored.

Per-replica gradients: under ``shard_map(check_vma=True)``, ``jax.grad`` with respect to
replicated parameters already sums the gradient over the mesh (the transpose of the
implicit ``pvary``); the reduce-scatter then averages p identical copies of that sum, as
``lax.pmean`` and ``all_reduce_gradients`` would. Differentiate with respect to
``lax.pcast(params, axes, to="varying")`` to reduce each gradient once, here.

State. Every leaf of the returned state carries a leading axis of one entry per device:
pass ``PartitionSpec(axis_name)`` as its ``shard_map`` spec. Globally a sharded leaf is
``[p, m]`` and a scalar (a step count) is ``[p]``; per device it is ``[1, m]`` or ``[1]``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from torus_collectives._vma import mark_invariant
from torus_collectives.collectives import AxisName, all_gather, reduce_scatter
from torus_collectives.gradients import DEFAULT_BUCKET_BYTES, _buckets
from torus_collectives.layout import ceil_div, pad_to
from torus_collectives.registry import Implementation


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each leaf lives: its shape, its shard length m, and the buckets (leaf indices)."""

  shapes: tuple[tuple[int, ...], ...]
  shard_sizes: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]

  @classmethod
  def of(cls, leaves: list[jax.Array], p: int, bucket_bytes: int) -> _Layout:
    return cls(
      shapes=tuple(leaf.shape for leaf in leaves),
      shard_sizes=tuple(ceil_div(leaf.size, p) for leaf in leaves),
      buckets=tuple(tuple(b) for b in _buckets(leaves, bucket_bytes)),
    )

  def rows(self, leaf: jax.Array, i: int, p: int) -> jax.Array:
    """``leaf`` flattened, zero-padded and viewed as ``[p, m]``: row d is shard d."""
    m = self.shard_sizes[i]
    return pad_to(leaf.reshape(-1), p * m).reshape(p, m)

  def split(self, flat: jax.Array, bucket: tuple[int, ...]) -> list[jax.Array]:
    """A bucket's ``[..., sum m]`` columns cut back into its leaves' ``[..., m]`` pieces."""
    ends = list(itertools.accumulate(self.shard_sizes[i] for i in bucket))
    return [flat[..., end - self.shard_sizes[i] : end] for i, end in zip(bucket, ends)]


def _check_floating(tree: Any, name: str) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(
        f"sharded_update needs floating-point {name}, got dtype {jnp.result_type(leaf)} at "
        f"{jax.tree_util.keystr(path)}; keep integer leaves out of the optimized tree"
      )


class ShardedUpdate(NamedTuple):
  """What ``sharded_update`` returns. ``init`` and ``update`` make it an optax gradient
  transformation; ``apply_gradients`` is the same step returning the new parameters."""

  init: Callable[[Any], Any]
  update: Callable[..., tuple[Any, Any]]
  apply_gradients: Callable[[Any, Any, Any], tuple[Any, Any]]


def sharded_update(
  tx: optax.GradientTransformation,
  axis_name: AxisName,
  *,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  implementation: Implementation = "auto",
) -> ShardedUpdate:
  """``tx`` with its update sharded over the devices of ``axis_name`` (see module doc).

  Args:
    tx: any optax transformation that is elementwise within each leaf; whole-leaf
      reductions must be summed over ``axis_name`` (``scale_by_trust_ratio``, ``lars``).
    axis_name: the mesh axis, or tuple of two (the torus), to shard over; bound by the
      enclosing ``jax.shard_map``.
    bucket_bytes: largest flat bucket, as in ``all_reduce_gradients``.
    implementation: the reduce-scatter and all-gather implementation.

  Returns:
    ``init(params) -> state``, ``update(grads, state, params) -> (updates, state)`` and
    ``apply_gradients(grads, state, params) -> (new_params, state)``, all called inside
    ``jax.shard_map`` over ``axis_name`` with per-replica ``grads`` (averaged here: do not
    all-reduce them first) and replicated ``params``. Every leaf of the state has a leading
    per-device axis (spec ``PartitionSpec(axis_name)``). ``update`` all-gathers the update
    for ``optax.apply_updates``; ``apply_gradients`` adds it to the parameter shards and
    all-gathers the new parameters, so no device touches more than 1/p of the optimizer's
    arithmetic. Both equal what ``tx`` computes unsharded on the mean gradient.
  """
  if bucket_bytes <= 0:
    raise ValueError(f"{bucket_bytes=} must be positive")

  def setup(params):
    axes, torus = _bound_torus(axis_name)
    _check_floating(params, "parameters")
    leaves, treedef = jax.tree.flatten(params)
    p = math.prod(torus)
    layout = _Layout.of(leaves, p, bucket_bytes)
    index = lax.axis_index(axes)  # row-major: the chunk a tiled reduce-scatter leaves here
    shards = [
      lax.dynamic_index_in_dim(layout.rows(leaf, i, p), index, keepdims=False)
      for i, leaf in enumerate(leaves)
    ]
    return axes, p, layout, treedef, jax.tree.unflatten(treedef, shards)

  def init_fn(params):
    *_, param_shards = setup(params)
    return jax.tree.map(lambda x: x[None], tx.init(param_shards))

  def sharded_step(grads, state, params):
    """Reduce-scatter and the inner update on this device's shards."""
    if params is None:
      raise ValueError("sharded_update needs params: call update(grads, state, params)")
    axes, p, layout, treedef, param_shards = setup(params)
    _check_floating(grads, "gradients")
    grad_leaves = treedef.flatten_up_to(grads)
    grad_shards: list[jax.Array | None] = [None] * len(grad_leaves)
    for bucket in layout.buckets:
      rows = jnp.concatenate([layout.rows(grad_leaves[i], i, p) for i in bucket], axis=1)
      summed = reduce_scatter(rows.reshape(-1), axes, tiled=True, implementation=implementation)
      for i, piece in zip(bucket, layout.split(summed, bucket)):
        # The mean, rounded as all_reduce_gradients rounds it.
        grad_shards[i] = (piece.astype(jnp.float32) * (1.0 / p)).astype(grad_leaves[i].dtype)
    update_shards, inner_state = tx.update(
      jax.tree.unflatten(treedef, grad_shards), jax.tree.map(lambda x: x[0], state), param_shards
    )
    gather = functools.partial(_all_gather_leaves, axes, p, layout, treedef, implementation)
    return gather, param_shards, update_shards, jax.tree.map(lambda x: x[None], inner_state)

  def update_fn(grads, state, params=None):
    gather, _, update_shards, state = sharded_step(grads, state, params)
    return gather(update_shards), state

  def apply_gradients(grads, state, params):
    gather, param_shards, update_shards, state = sharded_step(grads, state, params)
    return gather(optax.apply_updates(param_shards, update_shards)), state

  return ShardedUpdate(init_fn, update_fn, apply_gradients)


def _bound_torus(axis_name: AxisName) -> tuple[tuple, tuple[int, ...]]:
  """The named axes and their sizes; a clear error where one is not bound."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  sizes = []
  for axis in axes:
    try:
      sizes.append(lax.axis_size(axis))
    except NameError as e:
      raise ValueError(
        f"axis {axis!r} is not bound here: call sharded_update's init, update and "
        "apply_gradients inside jax.shard_map over a mesh with that axis"
      ) from e
  return axes, tuple(sizes)


def _all_gather_leaves(axes, p, layout: _Layout, treedef, implementation, shards):
  """Shards of every leaf -> whole leaves, one tiled all-gather per bucket."""
  leaves = treedef.flatten_up_to(shards)
  out: list[jax.Array | None] = [None] * len(leaves)
  for bucket in layout.buckets:
    dtype = jnp.result_type(*(leaves[i] for i in bucket))
    flat = jnp.concatenate([leaves[i].astype(dtype) for i in bucket])
    gathered = all_gather(flat, axes, tiled=True, implementation=implementation)
    # Identical on every device: type it replicated, as a psum's result would be.
    columns = layout.split(mark_invariant(gathered, axes).reshape(p, -1), bucket)
    for i, rows in zip(bucket, columns):
      n = math.prod(layout.shapes[i])
      out[i] = rows.reshape(-1)[:n].reshape(layout.shapes[i]).astype(leaves[i].dtype)
  return jax.tree.unflatten(treedef, out)


def scale_by_trust_ratio(
  min_norm: float = 0.0,
  trust_coefficient: float = 1.0,
  eps: float = 0.0,
  *,
  axis_name: AxisName | None = None,
) -> optax.GradientTransformation:
  """``optax.scale_by_trust_ratio`` on leaves sharded over ``axis_name``.

  Each leaf's parameter and update norms are summed over the shards: the local squared
  norms of all leaves go into one vector, reduced by one ``lax.psum`` per step. With
  ``axis_name=None`` this is ``optax.scale_by_trust_ratio`` itself.
  """
  if axis_name is None:
    return optax.scale_by_trust_ratio(min_norm, trust_coefficient, eps)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("scale_by_trust_ratio needs params")
    leaves, treedef = jax.tree.flatten(updates)
    param_leaves = treedef.flatten_up_to(params)
    if not leaves:
      return updates, state
    squares = jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in param_leaves + leaves])
    norms = jnp.sqrt(lax.psum(squares, axis_name))
    scaled = []
    for i, (update, param) in enumerate(zip(leaves, param_leaves)):
      param_norm = jnp.maximum(norms[i], min_norm)
      update_norm = jnp.maximum(norms[len(leaves) + i], min_norm)
      ratio = trust_coefficient * param_norm / (update_norm + eps)
      # As optax: a ratio of 1 where either norm is zero, so such leaves still move.
      zero = jnp.logical_or(param_norm == 0.0, update_norm == 0.0)
      scaled.append(update * jnp.where(zero, 1.0, ratio).astype(param.dtype))
    return jax.tree.unflatten(treedef, scaled), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def lars(
  learning_rate: optax.ScalarOrSchedule,
  weight_decay: float = 0.0,
  weight_decay_mask: Any = True,
  trust_coefficient: float = 0.001,
  eps: float = 0.0,
  trust_ratio_mask: Any = True,
  momentum: float = 0.9,
  nesterov: bool = False,
  *,
  axis_name: AxisName | None = None,
) -> optax.GradientTransformation:
  """``optax.lars`` whose trust ratio sums its norms over ``axis_name`` (for use inside
  ``sharded_update``); with ``axis_name=None`` it is ``optax.lars`` itself."""
  if axis_name is None:
    return optax.lars(
      learning_rate,
      weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask,
      trust_coefficient=trust_coefficient,
      eps=eps,
      trust_ratio_mask=trust_ratio_mask,
      momentum=momentum,
      nesterov=nesterov,
    )
  return optax.chain(
    optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
    optax.masked(
      scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps, axis_name=axis_name),
      mask=trust_ratio_mask,
    ),
    optax.scale_by_learning_rate(learning_rate),
    optax.trace(decay=momentum, nesterov=nesterov),
  )
