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

Layout (``packing``'s). Every leaf is flattened, zero-padded to a multiple of p and viewed
as ``[p, m]`` (``m = ceil(size / p)``); row d is device d's shard. Leaves are grouped into
flat buckets as ``all_reduce_gradients`` groups them (``packing.buckets_by_size``, one
dtype per bucket, in the order the backward pass produced the gradients, so each bucket's
reduce-scatter can start while the backward pass goes on), and a bucket is the
``[p, sum m]`` concatenation of its leaves' rows, so one tiled reduce-scatter hands device
d row d: a static-shaped shard of *every* leaf; one tiled all-gather of a bucket's shards
returns its rows. Where the collectives resolve to lax, each bucket goes to XLA in the
forms its TPU compiler emits as one genuine reduce-scatter and one genuine all-gather,
where the plain lax forms are all-reduces (``weight_update.xla_collectives``).

Deferred gather. ``apply_gradients(..., gather=False)`` keeps this device's shard of the
new weights; the next step's ``gather_params`` all-gathers them, one bucket at a time in
the order its forward pass first reads them, so the gather can overlap the forward pass
(ZeRO's parameter prefetch). Bitwise the same steps: a gather does no arithmetic.
The tree keeps the parameters' structure, so masks (callables on the tree or trees of
booleans, e.g. LARS's kernel-only weight decay and trust ratio) select exactly the leaves
they select unsharded.

Which transformations are exact. The inner transformation is traced on the leaves' full
shapes and its jaxpr is run on the shards by ``weight_update.sharded_eval``: elementwise arithmetic
runs on the shards; a reduction over a whole leaf or across leaves (a norm, a mean, a
max: ``clip_by_global_norm``, ``lamb``, ``optax.lars``, ``novograd``, ``fromage``,
Adafactor's RMS clipping and parameter scale, a ``jnp.sum`` written by hand) becomes the
local reduction over the shard (padding masked) followed by one ``psum``/``pmax``/``pmin``
over ``axis_name``, all the reductions that can wait for each other sharing one
collective; a ``lax.cond`` on a replicated value (``optax.MultiSteps``) runs its branches
on the shards. Every such transformation equals its unsharded self on the mean gradient up
to the order of float additions. What depends on a leaf's layout is refused at trace time
with ``UnshardableTransformError`` (naming the operation, the leaf and the fix), never
computed on a shard:

* reductions over some axes of a leaf only: Adafactor's factored row and column
  statistics (leaves with two dimensions of at least ``min_dim_size_to_factor``; smaller
  leaves are unfactored and exact), a per-row norm;
* sort, cumulative sums, top-k, argmax, gathers and slices, concatenation, transposes
  that reorder a leaf's axes, broadcasts of a leaf to a larger shape;
* collectives over ``axis_name`` inside the transformation (``lars(axis_name=...)``):
  ``sharded_update`` makes reductions global itself.

State. ``tx.init`` runs on the whole (replicated) parameters; a state leaf that the update
computes from sharded values (moments, traces, accumulated gradients) is stored as this
device's shard, one that it computes from replicated values only (step counts,
hyperparameters, dummy statistics) is stored whole. Which is which is found by running the
update's jaxpr abstractly until the split is stable.

Per-replica gradients: under ``shard_map(check_vma=True)``, ``jax.grad`` with respect to
replicated parameters already sums the gradient over the mesh (the transpose of the
implicit ``pvary``); the reduce-scatter then averages p identical copies of that sum, as
``lax.pmean`` and ``all_reduce_gradients`` would. Differentiate with respect to
``lax.pcast(params, axes, to="varying")`` to reduce each gradient once, here.

Every leaf of the returned state carries a leading axis of one entry per device: pass
``PartitionSpec(axis_name)`` as its ``shard_map`` spec. Globally a sharded leaf is
``[p, m]`` and a whole one of shape ``s`` (a step count) is ``[p, *s]``; per device it is
``[1, m]`` or ``[1, *s]``.

This module needs optax (``pip install 'torus-collectives[optax]'``); the collectives do
not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import axes, collectives, packing, quantization, registry
from torus_collectives._optional import require
from torus_collectives._vma import ensure_varying, mark_invariant
from torus_collectives.collectives import AxisName, all_gather, reduce_scatter
from torus_collectives.gradients import DEFAULT_BUCKET_BYTES, GRADIENT_SCOPE, WEIGHT_GATHER_SCOPE
from torus_collectives.registry import Implementation
from torus_collectives.tiling import ceil_div
from torus_collectives.weight_update import xla_collectives
from torus_collectives.weight_update.sharded_eval import Interpreter, Sharded, Shards, replicated

optax = require("optax", "weight_update")


@dataclasses.dataclass(frozen=True)
class _ShardPlan:
  """How the leaves are sharded and bucketed: each leaf's shape, its shard length m, and
  the buckets (leaf indices)."""

  shapes: tuple[tuple[int, ...], ...]
  shard_sizes: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]

  @classmethod
  def of(cls, leaves, p: int, bucket_bytes: int, order=None) -> _ShardPlan:
    """Buckets filled in ``order`` (leaf indices), or in ``buckets_by_size``'s order."""
    return cls(
      shapes=tuple(tuple(leaf.shape) for leaf in leaves),
      shard_sizes=tuple(ceil_div(math.prod(leaf.shape), p) for leaf in leaves),
      buckets=tuple(tuple(b) for b in packing.buckets_by_size(leaves, bucket_bytes, order)),
    )


def _check_floating(tree: Any, name: str) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(
        f"sharded_update needs floating-point {name}, got dtype {jnp.result_type(leaf)} at "
        f"{jax.tree_util.keystr(path)}; keep integer leaves out of the optimized tree"
      )


class ShardedUpdate(NamedTuple):
  """What ``sharded_update`` returns. ``init`` and ``update`` make it an optax gradient
  transformation; ``apply_gradients`` is the same step returning the new parameters (or,
  with ``gather=False``, this device's shards of them); ``shard_params`` and
  ``gather_params`` convert between whole parameters and shards (deferred gather)."""

  init: Callable[[Any], Any]
  update: Callable[..., tuple[Any, Any]]
  apply_gradients: Callable[..., tuple[Any, Any]]
  shard_params: Callable[[Any], Any]
  gather_params: Callable[..., Any]


class ErrorFeedbackState(NamedTuple):
  """``sharded_update(..., error_feedback=True)``'s state: the inner transformation's,
  and this device's quantization residual of every gradient leaf (float32, whole leaves:
  ``[1, *shape]`` per device), added to the next step's gradients."""

  inner: Any
  residual: Any


@dataclasses.dataclass(frozen=True)
class _Step:
  """What one call knows about the parameters: axes, shard plan, and this device's shards."""

  axes: tuple
  p: int
  plan: _ShardPlan
  treedef: Any
  paths: tuple[str, ...]
  param_shards: tuple[jax.Array, ...]

  @property
  def shards(self) -> Shards:
    return Shards(self.axes, self.p)

  def sharded(self, locals_: list[jax.Array]) -> list[Sharded]:
    return [Sharded(x, s, path) for x, s, path in zip(locals_, self.plan.shapes, self.paths)]


def sharded_update(
  tx: optax.GradientTransformation,
  axis_name: AxisName,
  *,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  implementation: Implementation = "auto",
  transport_dtype: Any = None,
  error_feedback: bool = False,
) -> ShardedUpdate:
  """``tx`` with its update sharded over the devices of ``axis_name`` (see module doc).

  Args:
    tx: an optax transformation written for whole leaves. Its reductions over whole
      leaves are made global; what cannot run on a shard raises
      ``UnshardableTransformError`` when ``init``/``update`` is traced.
    axis_name: the mesh axis, or tuple of axes (the torus), to shard over; bound by the
      enclosing ``jax.shard_map``.
    bucket_bytes: largest flat bucket, as in ``all_reduce_gradients``.
    implementation: the reduce-scatter and all-gather implementation.
    transport_dtype: None, or block-scaled transport for the gradients' reduce-scatter
      (``jnp.int8``, an fp8 dtype, a ``tc.BlockScaled`` or a mapping per axis; see
      ``all_reduce_gradients``). The weights' all-gather is never quantized: it moves the
      parameters themselves, exactly.
    error_feedback: with block-scaled transport, carry what this device's quantizations
      took off the gradients in the state (``ErrorFeedbackState``) and add it to the next
      step's, so that over steps the summed gradients lose only the last residual
      (EF-SGD). Costs a float32 copy of the whole gradient per device.

  Returns:
    ``init(params) -> state``, ``update(grads, state, params) -> (updates, state)`` and
    ``apply_gradients(grads, state, params) -> (new_params, state)``, all called inside
    ``jax.shard_map`` over ``axis_name`` with per-replica ``grads`` (averaged here: do not
    all-reduce them first) and replicated ``params``. Every leaf of the state has a leading
    per-device axis (spec ``PartitionSpec(axis_name)``). ``update`` all-gathers the update
    for ``optax.apply_updates``; ``apply_gradients`` adds it to the parameter shards and
    all-gathers the new parameters, so no device touches more than 1/p of the optimizer's
    arithmetic. Both equal what ``tx`` computes unsharded on the mean gradient, up to the
    order of float additions in its reductions.

    Deferred gather (ZeRO's parameter prefetch): ``apply_gradients(grads, state, params,
    gather=False)`` returns this device's flat ``[m]`` shard of every new leaf instead
    (globally ``[p * m]``, spec ``PartitionSpec(axis_name)``; flat, since a ``[1, m]`` leaf
    gets a tiled layout on TPU that costs a relayout per step), and
    the next step's ``gather_params(shards, like, order)`` all-gathers them, one bucket at a
    time in ``order`` (``packing.first_use_order`` of the forward pass: the first layers'
    weights first), so the gather can run while the forward pass computes. A gather moves
    values without arithmetic: the steps are bitwise those of ``apply_gradients``.
    ``shard_params(params)`` makes the first shards.
  """
  if not bucket_bytes > 0 or not math.isfinite(bucket_bytes):  # NaN fails both
    raise ValueError(f"{bucket_bytes=} must be positive and finite, as in all_reduce_gradients")
  if transport_dtype is not None and not quantization.is_block_scaled(transport_dtype):
    raise ValueError(
      f"sharded_update's transport_dtype takes a block-scaled format (jnp.int8, an fp8 "
      f"dtype, tc.BlockScaled or a mapping per axis), got {transport_dtype!r}"
    )
  if error_feedback and transport_dtype is None:
    raise ValueError("error_feedback=True needs a block-scaled transport_dtype such as jnp.int8")
  sharding = _Sharding(tx, axis_name, bucket_bytes, implementation, transport_dtype, error_feedback)
  return ShardedUpdate(
    sharding.init,
    sharding.update,
    sharding.apply_gradients,
    sharding.shard_params,
    sharding.gather_params,
  )


@dataclasses.dataclass(frozen=True)
class _Sharding:
  """``sharded_update``'s arguments, and the steps of its transformation."""

  tx: Any
  axis_name: AxisName
  bucket_bytes: int
  implementation: str
  transport_dtype: Any = None
  error_feedback: bool = False

  def setup(self, params) -> _Step:
    names, torus = _bound_torus(self.axis_name)
    _check_floating(params, "parameters")
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in with_paths]
    p = math.prod(torus)
    plan = _ShardPlan.of(leaves, p, self.bucket_bytes)
    index = lax.axis_index(names)  # row-major: the chunk a tiled reduce-scatter leaves here
    shards = tuple(
      lax.dynamic_index_in_dim(packing.as_rows(leaf, p), index, keepdims=False) for leaf in leaves
    )
    paths = tuple(jax.tree_util.keystr(path) for path, _ in with_paths)
    return _Step(names, p, plan, treedef, paths, shards)

  def init(self, params):
    step = self.setup(params)
    state = self.tx.init(params)  # whole, on every replica; the sharded leaves are cut below
    leaves, state_def = jax.tree.flatten(state)
    sharded = _sharded_state(self.tx, step, params, state)
    stored = [
      step.shards.cut(leaf, leaf.shape).local if is_sharded else leaf
      for leaf, is_sharded in zip(leaves, sharded)
    ]
    state = jax.tree.unflatten(state_def, [x[None] for x in stored])
    if not self.error_feedback:
      return state
    # Typed varying, as the residual every step returns (each device's own): the state
    # is then a loop carry under check_vma.
    residual = jax.tree.map(
      lambda p: ensure_varying(jnp.zeros((1, *p.shape), jnp.float32), step.axes), params
    )
    return ErrorFeedbackState(state, residual)

  def sharded_step(self, grads, state, params):
    """Reduce-scatter and the inner update on this device's shards: (step, the mean
    gradient's shards, the update's shards, the new state). The reduce-scatter buckets
    follow the order in which the traced program computed the gradients (the backward
    pass's), so each can start while the rest of the backward pass runs."""
    if params is None:
      raise ValueError("sharded_update needs params: call update(grads, state, params)")
    step = self.setup(params)
    _check_floating(grads, "gradients")
    grad_leaves = step.treedef.flatten_up_to(grads)
    residual = None
    if self.error_feedback:
      if not isinstance(state, ErrorFeedbackState):
        raise ValueError("error_feedback=True: pass the state that this sharded_update's init made")
      state, residual = state
      residual = [r[0] for r in step.treedef.flatten_up_to(residual)]
      grad_leaves = [
        (g.astype(jnp.float32) + r).astype(g.dtype) for g, r in zip(grad_leaves, residual)
      ]
    step = dataclasses.replace(step, plan=_ShardPlan.of(grad_leaves, step.p, self.bucket_bytes))
    grad_shards = _mean_shards(
      step, grad_leaves, self.implementation, self.transport_dtype, residual is not None
    )
    if residual is not None:
      grad_shards, residual = grad_shards
    update_shards, new_state = self.update_on_shards(step, grad_shards, state, params, grads)
    if residual is not None:
      new_state = ErrorFeedbackState(new_state, step.treedef.unflatten([r[None] for r in residual]))
    return step, grad_shards, update_shards, new_state

  def update_on_shards(self, step: _Step, grad_shards, state, params, grads):
    """The inner update on this device's shards of the mean gradient (flat ``[m]`` per
    leaf): (the update's shards, the new state as stored). ``params`` and ``grads`` give
    only the whole leaves' shapes and dtypes; the parameters' values are
    ``step.param_shards``."""
    whole_state = jax.eval_shape(self.tx.init, params)
    sharded = _sharded_state(self.tx, step, params, whole_state)
    state_leaves, state_def = jax.tree.flatten(state)
    state_shapes = [leaf.shape for leaf in jax.tree.leaves(whole_state)]
    state_in = [
      Sharded(x[0], shape) if is_sharded else x[0]
      for x, shape, is_sharded in zip(state_leaves, state_shapes, sharded)
    ]
    updates, new_state = _run_update(
      self.tx, step, step.sharded(list(grad_shards)), state_in, state_def, params, grads
    )
    update_shards = [step.shards.cut(u, s).local for u, s in zip(updates, step.plan.shapes)]
    stored = [
      _stored(step, value, shape, is_sharded)
      for value, shape, is_sharded in zip(new_state, state_shapes, sharded)
    ]
    return update_shards, jax.tree.unflatten(state_def, [x[None] for x in stored])

  def gather(self, step: _Step, shards: list[jax.Array]):
    return _all_gather_leaves(step, self.implementation, step.treedef.unflatten(shards))

  def update(self, grads, state, params=None):
    step, _, update_shards, state = self.sharded_step(grads, state, params)
    return self.gather(step, update_shards), state

  def apply_gradients(self, grads, state, params, *, gather=True):
    step, new_shards, state, _ = self.stepped_shards(grads, state, params)
    if not gather:  # deferred: the next step's gather_params all-gathers them
      return step.treedef.unflatten(list(new_shards)), state
    return self.gather(step, new_shards), state

  def stepped_shards(self, grads, state, params):
    """(step, this device's shards of the new parameters, the new state, its shards of
    the mean gradient)."""
    step, grad_shards, update_shards, state = self.sharded_step(grads, state, params)
    return step, optax.apply_updates(list(step.param_shards), update_shards), state, grad_shards

  def shard_params(self, params):
    """This device's flat ``[m]`` shard of every leaf of the replicated ``params``."""
    step = self.setup(params)
    return step.treedef.unflatten(list(step.param_shards))

  def gather_params(self, param_shards, like, order=None):
    """The whole parameters from their shards (flat ``[m]`` leaves, as ``shard_params`` and
    ``apply_gradients(..., gather=False)`` return them): one tiled all-gather per bucket,
    the buckets filled in ``order`` (leaf indices, e.g. ``first_use_order`` of the forward
    pass, so the first layers' weights arrive first) or in tree order. ``like`` gives the
    leaves' shapes and dtypes (arrays or ``jax.ShapeDtypeStruct``)."""
    names, torus = _bound_torus(self.axis_name)
    shapes, treedef = jax.tree.flatten(like)
    shards = treedef.flatten_up_to(param_shards)
    p = math.prod(torus)
    check_shards(shards, shapes, p)
    plan = _ShardPlan.of(shapes, p, self.bucket_bytes, order)
    step = _Step(names, p, plan, treedef, (), ())
    return _all_gather_leaves(step, self.implementation, treedef.unflatten(shards))


def check_shards(shards, shapes, p: int) -> None:
  """Each of ``shards`` is the flat ``[m]`` shard of the leaf of ``shapes`` beside it."""
  for shard, shape in zip(shards, shapes):
    if jnp.shape(shard) != (ceil_div(math.prod(shape.shape), p),):
      raise ValueError(
        f"a parameter shard of shape {jnp.shape(shard)} does not belong to a leaf of shape "
        f"{shape.shape} sharded over {p} devices: pass the shards that shard_params or "
        "apply_gradients(..., gather=False) returned, and the parameters' shapes as like"
      )


def _stored(step: _Step, value, shape, is_sharded: bool) -> jax.Array:
  """A new state leaf as the state stores it: this device's shard, or the whole value."""
  if is_sharded:
    return step.shards.cut(value, shape).local
  if isinstance(value, Sharded):
    raise AssertionError("a state leaf became sharded after the shard plan was fixed")
  return replicated(value)


def _resolved(op: str, pieces, step: _Step, implementation: str, block_scaled=False) -> str:
  """The implementation that runs ``op`` on all of ``pieces``, resolved once for the whole
  tree."""
  request = collectives.request(op, pieces, step.axes)
  request = dataclasses.replace(request, block_scaled=block_scaled)
  return registry.resolve(implementation, request)


def _mean_shards(
  step: _Step, grad_leaves, implementation, transport_dtype, with_residual=False
) -> list[jax.Array] | tuple[list[jax.Array], list[jax.Array]]:
  """This device's shard of the mean of every gradient leaf, one reduce-scatter a bucket
  (on lax in the form XLA's TPU compiler emits as a reduce-scatter: ``xla_collectives``);
  ``with_residual``: and, per leaf, what this device's quantizations took off it (whole
  leaves, error feedback; through the backend itself, which returns it)."""
  plan, p = step.plan, step.p
  with jax.named_scope(GRADIENT_SCOPE):
    pieces = [packing.as_rows(leaf, p) for leaf in grad_leaves]
    implementation = _resolved(
      "reduce_scatter", pieces, step, implementation, transport_dtype is not None
    )
    if transport_dtype is None and registry.runs_lax(implementation):  # [p, sum m] rows
      collective = lambda flat: xla_collectives.reduce_scatter_rows(flat.reshape(p, -1), step.axes)
    elif with_residual:
      collective = functools.partial(
        _reduce_scatter_with_residual, step, implementation, transport_dtype
      )
    else:
      collective = lambda flat: reduce_scatter(
        flat, step.axes, tiled=True, implementation=implementation, transport_dtype=transport_dtype
      )
    summed = packing.through_buckets(
      collective, pieces, plan.buckets, plan.shard_sizes, rows=(None, p) if with_residual else None
    )
  residual = None
  if with_residual:
    summed, residual = summed
    residual = [packing.from_rows(r, shape) for r, shape in zip(residual, plan.shapes)]
  means = [mean_of_sum(piece, p, leaf.dtype) for piece, leaf in zip(summed, grad_leaves)]
  return means if residual is None else (means, residual)


def norm_of_shards(shards, axes_) -> jax.Array:
  """The global L2 norm of leaves held as shards over ``axes_`` (zero padding adds
  nothing): the local sum of squares in float32, completed by one scalar ``psum``."""
  local = sum(jnp.sum(jnp.square(s.astype(jnp.float32))) for s in shards)
  return jnp.sqrt(lax.psum(local, axes_))


def mean_of_sum(summed: jax.Array, p: int, dtype) -> jax.Array:
  """The mean of ``p`` devices' values from their sum, rounded as
  ``all_reduce_gradients`` rounds it: scaled in float32, then cast to ``dtype``."""
  return (summed.astype(jnp.float32) * (1.0 / p)).astype(dtype)


def _reduce_scatter_with_residual(step: _Step, implementation, transport_dtype, flat):
  """The backend's block-scaled reduce-scatter of one packed bucket, and its residual."""
  transport = quantization.transport_per_axis(transport_dtype, step.axes)
  sizes = tuple(lax.axis_size(a) for a in step.axes)
  backend = registry.collective_backend(implementation)
  return backend.reduce_scatter(
    ensure_varying(flat, step.axes), step.axes, sizes, transport=transport, with_residual=True
  )


def _run_update(tx, step: _Step, grads, state_in, state_def, params, grad_like):
  """``tx.update`` traced on whole shapes and run on the shards: (updates, state leaves)."""
  abstract = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
  whole_state = jax.tree.unflatten(
    state_def,
    [
      jax.ShapeDtypeStruct(v.shape, v.local.dtype) if isinstance(v, Sharded) else v
      for v in state_in
    ],
  )
  closed, out_shape = jax.make_jaxpr(tx.update, return_shape=True)(
    abstract(grad_like), abstract(whole_state), abstract(params)
  )
  interpreter = Interpreter(step.shards)
  outs = interpreter.run(closed, [*grads, *state_in, *step.sharded(list(step.param_shards))])
  n_updates = len(jax.tree.leaves(out_shape[0]))
  return outs[:n_updates], outs[n_updates:]


def _sharded_state(tx, step: _Step, params, whole_state) -> list[bool]:
  """Which state leaves the update computes from sharded values (a fixed point: a leaf
  read as sharded can make others sharded)."""
  leaves, state_def = jax.tree.flatten(whole_state)
  sharded = [False] * len(leaves)
  while True:

    def probe(sharded=tuple(sharded)):
      state_in = [
        step.shards.cut(jnp.zeros(x.shape, x.dtype), x.shape) if s else jnp.zeros(x.shape, x.dtype)
        for x, s in zip(leaves, sharded)
      ]
      grads = step.sharded([jnp.zeros_like(x) for x in step.param_shards])
      _, state_out = _run_update(tx, step, grads, state_in, state_def, params, params)
      return state_out

    kinds = jax.eval_shape(probe)
    grown = [s or isinstance(k, Sharded) for s, k in zip(sharded, kinds)]
    if grown == sharded:
      return sharded
    sharded = grown


def _bound_torus(axis_name: AxisName) -> tuple[tuple, tuple[int, ...]]:
  """The named axes and their sizes; a clear error where one is not bound."""
  names = axes.names(axis_name)
  sizes = []
  for axis in names:
    try:
      sizes.append(lax.axis_size(axis))
    except NameError as e:
      raise ValueError(
        f"axis {axis!r} is not bound here: call sharded_update's init, update and "
        "apply_gradients inside jax.shard_map over a mesh with that axis"
      ) from e
  return names, tuple(sizes)


def _all_gather_leaves(step: _Step, implementation, shards):
  """Shards of every leaf -> whole leaves, one tiled all-gather per bucket."""
  leaves = step.treedef.flatten_up_to(shards)
  pieces = list(leaves)
  for bucket in step.plan.buckets:  # one dtype per buffer
    dtype = jnp.result_type(*(leaves[i] for i in bucket))
    for i in bucket:
      pieces[i] = leaves[i].astype(dtype)

  implementation = _resolved("all_gather", pieces, step, implementation)

  def gather(flat):
    if registry.runs_lax(implementation):
      gathered = xla_collectives.all_gather_shards(flat, step.axes)
    else:
      gathered = all_gather(flat, step.axes, tiled=True, implementation=implementation)
    # Identical on every device: type it replicated, as a psum's result would be.
    return mark_invariant(gathered, step.axes)

  with jax.named_scope(WEIGHT_GATHER_SCOPE):
    rows = packing.through_buckets(
      gather, pieces, step.plan.buckets, step.plan.shard_sizes, rows=step.p
    )
  out = [
    packing.from_rows(r, shape).astype(leaf.dtype)
    for r, shape, leaf in zip(rows, step.plan.shapes, leaves)
  ]
  return jax.tree.unflatten(step.treedef, out)
