"""Weight-update sharding threaded through the step: ``ShardedUpdate.value_and_apply``.

A step of weight-update sharding with the deferred gather is three collectives around the
model: the parameters' all-gather before the forward pass (``gather_params``), the
gradients' reduce-scatter after the backward pass and the optimizer on this device's
shards (``apply_gradients(..., gather=False)``). Blocking Pallas calls hold the
TensorCore, so with kernels both collectives are exposed. Here the whole step is one
re-evaluated program (``overlap._Threaded``), with split collectives (a start, per-hop
steps and a done per ring phase: ``kernels.split_collectives``) on both sides:

1. ``jax.value_and_grad(fun)`` is traced on per-replica (varying) parameters of the
   gathered shapes, and its calls inlined.
2. *Forward pass* (``overlap.Gathering``): the parameter leaves are packed into buckets
   in the order the program first reads them (the first layers' weights first), what the
   first ``C`` heavy equations read in the first bucket, ``C`` a gather's calls, since
   nothing before it can cover its gather and a later bucket needs ``C`` windows. Two
   buckets' split all-gathers are in flight at a time (``overlap.GATHERS_IN_FLIGHT``):
   the first two start before the first equation, and each later one when the one two
   before it is read. Each issues its calls spread evenly over the heavy equations
   (convolutions, matmuls) before its first read, each call after the one before it
   (operand-side and result-side barriers, as in ``overlap``), and the rest at that
   read. So the first (small) bucket is exposed and the later ones overlap the layers
   before them (ZeRO's prefetch, one program).
3. *Backward pass* (``overlap.Summation``): each bucket of gradients, once its last leaf
   exists, is laid out as ``sharded_update`` lays it (``[p, sum m]`` rows, row ``d``
   device ``d``'s shard of every leaf; the backend pads each row to whole DMA words) and
   its split reduce-scatter is threaded through the rest of the backward pass.
4. *Tail*: the mean of each shard and the inner transformation on the shards
   (``_Sharding.update_on_shards``, with ``sharded_update``'s exactness rules), then the
   new parameter shards, evaluated while the last buckets' calls are issued
   (``overlap._Tail``).

The result is ``(value, (new_param_shards, new_state))``: what ``gather_params``, then
``jax.value_and_grad(fun)`` of the parameters made per replica (``lax.pcast(...,
to="varying")``), then ``apply_gradients(grads, state, params, gather=False)`` return,
up to the order of float additions (the blocking and split reduce-scatters cut the
buffer into chunks alike here; integers are exact in both).

Assumptions and limits:

* The implementation must have split reduce-scatter and all-gather
  (``registry.CollectiveBackend``: today "pallas"); "auto" resolves as
  ``sharded_update``'s reduce-scatter does. Otherwise, and with block-scaled transport or
  error feedback (no split form), the step is run as the three blocking parts above,
  which is the same result.
* ``fun(params, *args)`` differentiates with respect to the first argument, whose leaves
  must be floating (``sharded_update``'s rule).
* Every limit of ``overlap`` holds: windows are counted, not timed; a scanned model is one
  heavy equation; every device issues the calls in one order.
* Nothing here has run on a TPU: exactness is verified in TPU interpret mode against the
  blocking parts on lax, and the program order on traced programs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from torus_collectives import collectives, packing, registry
from torus_collectives._vma import ensure_varying
from torus_collectives.layout import ceil_div
from torus_collectives.overlap import Gathering, Summation, _Threaded
from torus_collectives.weight_update import sharded_update as su

optax = su.optax


def value_and_apply(
  sharding: su._Sharding,
  fun: Callable,
  like: Any,
  *,
  has_aux: bool = False,
  grad_norm: bool = False,
) -> Callable:
  """The step on the shards (module doc): ``run(param_shards, state, *args) -> (value,
  (new_param_shards, new_state))``, called inside the ``shard_map`` over the sharding's
  axes. ``like``: the parameters' shapes and dtypes (arrays or ``jax.ShapeDtypeStruct``).
  ``grad_norm``: also return the mean gradient's global L2 norm, ``(value,
  (new_param_shards, new_state, norm))``, from its shards (one scalar ``psum``; the
  mean gradient itself never exists whole)."""
  grad_fn = jax.value_and_grad(fun, has_aux=has_aux)

  def run(param_shards, state, *args):
    names, torus = su._bound_torus(sharding.axis_name)
    p = math.prod(torus)
    like_leaves, treedef = jax.tree.flatten(like)
    su._check_floating(like, "parameters")
    shards = treedef.flatten_up_to(param_shards)
    su.check_shards(shards, like_leaves, p)
    backend = _split_backend(sharding, like_leaves, names, p)
    if backend is None:
      value, result = _blocking(sharding, grad_fn, fun, like, param_shards, state, args, names)
      return value, result if grad_norm else result[:2]
    with_paths = jax.tree_util.tree_flatten_with_path(like)[0]
    step = su._Step(
      names,
      p,
      su._Layout.of(like_leaves, p, sharding.bucket_bytes),
      treedef,
      tuple(jax.tree_util.keystr(path) for path, _ in with_paths),
      tuple(shards),
    )
    # Per-replica stand-ins of the gathered parameters: the program is traced on their
    # types, and their values come from the gathers.
    stand_ins = [ensure_varying(jnp.zeros(x.shape, x.dtype), names) for x in like_leaves]
    params_in = treedef.unflatten(stand_ins)
    closed, (value_shapes, grad_shapes) = jax.make_jaxpr(grad_fn, return_shape=True)(
      params_in, *args
    )
    grad_leaves, grad_tree = jax.tree.flatten(grad_shapes)
    su._check_floating(grad_shapes, "gradients")

    def gradient_then(summed):  # the summed shards, flat [m] -> (new shards, new state)
      means = [su.mean_of_sum(s, p, g.dtype) for s, g in zip(summed, grad_leaves)]
      update_shards, new_state = sharding.update_on_shards(
        step, means, state, like, jax.tree.unflatten(grad_tree, grad_leaves)
      )
      new_shards = treedef.unflatten(optax.apply_updates(list(step.param_shards), update_shards))
      if grad_norm:
        return new_shards, new_state, su.norm_of_shards(means, names)
      return new_shards, new_state

    count = len(like_leaves)
    gathering = Gathering(
      indices=tuple(range(count)),
      like=tuple(like_leaves),
      # One stream, a ring phase over n devices being n calls (kernels.split_collectives).
      calls=sum(n for n in torus if n > 1),
      pack=lambda bucket: packing.pack([shards[i] for i in bucket]),
      start=lambda flat: backend.split_all_gather(flat, names, torus),
      unpack=lambda bucket, parts: _unpack_gathered(bucket, parts, like_leaves, p),
    )
    summation = Summation(
      pack=lambda leaves: packing.pack([packing.as_rows(g, p) for g in leaves]),
      start=lambda flat: backend.split_reduce_scatter(flat, names, torus),
      width=lambda leaf: ceil_div(math.prod(leaf.shape), p),
    )
    threaded = _Threaded(summation, names, torus, sharding.bucket_bytes, gathering)
    flat_args = [*stand_ins, *jax.tree.leaves(args)]
    value_leaves, result = threaded.run(closed, flat_args, grad_leaves, gradient_then, True)
    return jax.tree.unflatten(jax.tree.structure(value_shapes), value_leaves), result

  return run


def _split_backend(sharding: su._Sharding, like_leaves, names, p: int):
  """The collective backend whose split reduce-scatter and all-gather run the step, or
  None where the step runs blocking (module doc)."""
  if sharding.transport_dtype is not None or sharding.error_feedback:
    return None
  pieces = [jnp.zeros((p, ceil_div(math.prod(x.shape), p)), x.dtype) for x in like_leaves]
  request = collectives.request("reduce_scatter", pieces, names)
  implementation = registry.resolve(sharding.implementation, request)
  if registry.runs_lax(implementation):
    return None
  backend = registry.collective_backend(implementation)
  if backend.split_reduce_scatter is None or backend.split_all_gather is None:
    return None
  return backend


def _blocking(sharding, grad_fn, fun, like, param_shards, state, args, names):
  """The step as its three blocking parts (gather, gradient, sharded update): (value,
  (new shards, new state, the mean gradient's norm))."""
  order = packing.first_use_order(fun, like, *args)
  params = sharding.gather_params(param_shards, like, order)
  per_replica = jax.tree.map(lambda x: ensure_varying(x, names), params)
  value, grads = grad_fn(per_replica, *args)
  step, new_shards, state, grad_shards = sharding.stepped_shards(grads, state, params)
  norm = su.norm_of_shards(grad_shards, names)
  return value, (step.treedef.unflatten(list(new_shards)), state, norm)


def _unpack_gathered(bucket, parts, like_leaves, p: int) -> list[jax.Array]:
  """A bucket's gathered ``[p * W']`` (one part: the rows, each padded after its ``W``)
  -> its whole leaves."""
  (gathered,) = parts
  widths = [ceil_div(math.prod(like_leaves[i].shape), p) for i in bucket]
  rows = packing.unpack(gathered, widths, rows=p)
  return [
    packing.from_rows(r, like_leaves[i].shape).astype(like_leaves[i].dtype)
    for r, i in zip(rows, bucket)
  ]
