"""How the train step synchronises gradients: one strategy per run, built from the config.

Each device computes the loss and the gradient of its slice of the batch; a strategy turns
the replicas' gradients into one optimizer step. ``strategy_from_config`` is the one place
that reads the config's gradient fields (``weight_update_sharding``,
``defer_weight_gather``, ``grad_overlap``, ``grad_error_feedback``,
``grad_transport_dtype``, ``grad_implementation``, ``grad_bucket_bytes``) and picks one of:

* ``AllReduce``: ``jax.value_and_grad``, the mean over the mesh with
  ``tc.all_reduce_gradients`` (the gradients travel in their own dtype, cast to bfloat16,
  or block-scaled), then LARS on every device;
* ``ErrorFeedbackAllReduce``: the same with block-scaled transport, each device's
  quantization residual kept in the optimizer state (``ErrorFeedbackState``) and added to
  the next step's gradients;
* ``ThreadedAllReduce`` (``grad_overlap``): ``tc.experimental.value_and_summed_grad``,
  each bucket summed as soon as the backward pass has produced it and LARS stepped on its
  leaves while the later buckets are in flight;
* ``ShardedUpdate`` (``weight_update_sharding``): ``tc.sharded_update``, a reduce-scatter,
  LARS on each device's 1/p of the weights (its state split over the devices), and an
  all-gather of the new weights;
* ``DeferredShardedUpdate`` (and ``defer_weight_gather``): the same with that all-gather
  moved to the start of the next step, where it can overlap the forward pass; the running
  state holds each device's shards (``ParamsLayout``).

A strategy is frozen. It holds the optimizer as the train state keeps it (``tx``: the LARS
it was given, wrapped for error feedback or sharding), the ``shard_map`` spec of that state
(``opt_state_spec``) and the parameters' running ``layout``; the train step calls its
``value_and_update(loss_fn, params, opt_state, axes)`` inside ``shard_map`` and gets
``((loss, aux), (new params, new optimizer state, gradient norm))``. ``strategy_from_config``
refuses the combinations ``validation`` refuses (``validation.gradient_sync_problems``),
with the same messages.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import validation
from torus_collectives.weight_update.sharded_update import ErrorFeedbackState


@dataclasses.dataclass(frozen=True)
class ParamsLayout:
  """How the state holds the parameters while it trains.

  Checkpoints, evaluation and ``train.make_init_fn`` always see them whole and replicated
  (the *stored* state). With a deferred weight gather the *running* state holds each
  device's flat shard of every leaf instead (spec ``P(axes)``): the train step all-gathers
  them at its start (``gather``, in ``shard_map``), one bucket at a time in the order the
  forward pass first reads them (``tc.packing.first_use_order``), and leaves the new
  weights as shards, so the gather can overlap the next forward pass. ``to_running`` and
  ``to_stored`` convert a state between the two (identities when nothing is deferred).
  """

  spec: P = P()
  gather: Callable | None = None  # per-device shards -> whole parameters, in shard_map
  to_running: Callable = lambda state: state
  to_stored: Callable = lambda state: state


def _value_and_grad(loss_fn: Callable, params, axes: tuple[str, ...]):
  """``jax.value_and_grad`` (with aux) of ``loss_fn`` at a per-replica copy of ``params``.

  The copy is varying over ``axes``: otherwise, under shard_map's varying-axes typing, the
  transpose of the replicated parameters' implicit broadcast already sums the gradient over
  the mesh, and averaging it again would train on the replicas' sum instead of their mean.
  """
  return jax.value_and_grad(loss_fn, has_aux=True)(lax.pcast(params, axes, to="varying"))


def _step_on_mean(tx: optax.GradientTransformation, grads, opt_state, params):
  """``tx``'s step on the mean gradient: (new params, new state, the gradient's norm)."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


def _replicas_rms_norm(grads, axes: tuple[str, ...]) -> jax.Array:
  """The replicas' RMS gradient norm: where the mean gradient exists only as shards, an
  upper bound of its norm that is just as non-finite when it is."""
  return jnp.sqrt(lax.pmean(optax.tree.norm(grads) ** 2, axes))


@dataclasses.dataclass(frozen=True)
class AllReduce:
  """``value_and_grad``, then ``average(grads, axes)``, the mean over the mesh, then ``tx``
  on it, replicated."""

  tx: optax.GradientTransformation
  average: Callable  # (grads, axes) -> their mean over axes
  opt_state_spec: Any = P()
  layout: ParamsLayout = ParamsLayout()

  def value_and_update(self, loss_fn, params, opt_state, axes):
    value, grads = _value_and_grad(loss_fn, params, axes)
    return value, _step_on_mean(self.tx, self.average(grads, axes), opt_state, params)


@dataclasses.dataclass(frozen=True)
class ErrorFeedbackAllReduce:
  """``AllReduce`` carrying each device's quantization residual in the optimizer state
  (``ErrorFeedbackState``, ``[1, *shape]`` per device): ``average(grads, axes,
  residual=...)`` adds it back and returns the mean and the next residual (EF-SGD)."""

  tx: optax.GradientTransformation  # with_error_feedback(LARS)
  average: Callable  # (grads, axes, residual=) -> (mean, residual)
  opt_state_spec: Any
  layout: ParamsLayout = ParamsLayout()

  def value_and_update(self, loss_fn, params, opt_state, axes):
    value, grads = _value_and_grad(loss_fn, params, axes)
    residual = jax.tree.map(lambda r: r[0], opt_state.residual)
    grads, residual = self.average(grads, axes, residual=residual)
    params, opt_state, grad_norm = _step_on_mean(self.tx, grads, opt_state, params)
    opt_state = opt_state._replace(residual=jax.tree.map(lambda r: r[None], residual))
    return value, (params, opt_state, grad_norm)


@dataclasses.dataclass(frozen=True)
class ThreadedAllReduce:
  """``value_and_averaged_grad(loss_fn, axes, update=...)`` in place of ``value_and_grad``
  and the mean both: the mean summed while the backward pass runs, and ``tx``'s step of
  each bucket's leaves while the later buckets are in flight."""

  tx: optax.GradientTransformation
  value_and_averaged_grad: Callable  # (loss_fn, axes, update=) -> params -> (value, update(mean))
  opt_state_spec: Any = P()
  layout: ParamsLayout = ParamsLayout()

  def value_and_update(self, loss_fn, params, opt_state, axes):
    update = lambda grads: _step_on_mean(self.tx, grads, opt_state, params)
    per_replica = lax.pcast(params, axes, to="varying")  # as in _value_and_grad
    return self.value_and_averaged_grad(loss_fn, axes, update=update)(per_replica)


@dataclasses.dataclass(frozen=True)
class ShardedUpdate:
  """``tx`` (a ``tc.sharded_update``) reduce-scatters the gradients, steps each device's
  shard and all-gathers the new weights within the step."""

  tx: Any  # tc.ShardedUpdate
  opt_state_spec: Any
  layout: ParamsLayout = ParamsLayout()

  def value_and_update(self, loss_fn, params, opt_state, axes):
    value, grads = _value_and_grad(loss_fn, params, axes)
    params, opt_state = self.tx.apply_gradients(grads, opt_state, params, gather=True)
    return value, (params, opt_state, _replicas_rms_norm(grads, axes))


@dataclasses.dataclass(frozen=True)
class DeferredShardedUpdate:
  """``ShardedUpdate`` on a running state of shards: ``layout.gather`` all-gathers them at
  the start of the step, and the new weights stay shards."""

  tx: Any  # tc.ShardedUpdate
  opt_state_spec: Any
  layout: ParamsLayout

  def value_and_update(self, loss_fn, params, opt_state, axes):
    params = self.layout.gather(params)
    value, grads = _value_and_grad(loss_fn, params, axes)
    params, opt_state = self.tx.apply_gradients(grads, opt_state, params, gather=False)
    return value, (params, opt_state, _replicas_rms_norm(grads, axes))


GradSync = (
  AllReduce | ErrorFeedbackAllReduce | ThreadedAllReduce | ShardedUpdate | DeferredShardedUpdate
)


def all_reduce_from_config(config: ml_collections.ConfigDict) -> Callable:
  """``tc.all_reduce_gradients`` with the config's bucket size, transport dtype and
  implementation: ``(grads, axes, residual=None)``."""
  return functools.partial(
    tc.all_reduce_gradients,
    bucket_bytes=config.grad_bucket_bytes,
    transport_dtype=transport_dtype(config),
    implementation=config.grad_implementation,
  )


def summed_during_backward_from_config(config: ml_collections.ConfigDict) -> Callable:
  """``tc.experimental.value_and_summed_grad`` (the mean, with the config's bucket size and
  implementation) as ``(loss_fn, axes, update=None)``: each bucket's summation starts as
  soon as its gradients exist, and ``update`` (the optimizer's step) runs on each bucket's
  leaves as soon as they are summed."""

  def value_and_averaged_grad(loss_fn, axes, update=None):
    return tc.experimental.value_and_summed_grad(
      loss_fn,
      axes,
      bucket_bytes=config.grad_bucket_bytes,
      implementation=config.grad_implementation,
      has_aux=True,
      update=update,
    )

  return value_and_averaged_grad


def transport_dtype(config: ml_collections.ConfigDict) -> jax.typing.DTypeLike | None:
  """``config.grad_transport_dtype`` as the ``transport_dtype=`` of the gradient summation:
  None for '' (the gradients travel in their own dtype), else that dtype; the library
  block-scales int8 and fp8 itself."""
  name = config.grad_transport_dtype
  return jnp.dtype(name) if name else None


def with_error_feedback(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with each device's gradient residual beside its state (``ErrorFeedbackState``,
  as ``tc.sharded_update`` keeps it): ``init`` adds float32 zeros like the parameters with
  a leading device axis of 1 (run under ``shard_map``, out spec ``P(axes)``); ``update``
  runs ``tx`` on the inner state and keeps the residual, which ``ErrorFeedbackAllReduce``
  replaces with the one the gradient summation returns."""

  def init(params):
    residual = jax.tree.map(lambda p: jnp.zeros((1, *p.shape), jnp.float32), params)
    return ErrorFeedbackState(tx.init(params), residual)

  def update(updates, state, params=None):
    updates, inner = tx.update(updates, state.inner, params)
    return updates, state._replace(inner=inner)

  return optax.GradientTransformation(init, update)


def strategy_from_config(
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  optimizer: optax.GradientTransformation,
  *,
  model,
) -> GradSync:
  """The config's gradient synchronisation on ``mesh`` around ``optimizer`` (LARS, written
  for whole replicated leaves). ``model``: the network the step trains; a deferred gather
  fills its buckets in the order its forward pass reads the parameters.

  Raises:
    ValueError: for the combinations ``validation`` refuses, with its messages.
  """
  problems = validation.gradient_sync_problems(config)
  if problems:
    raise ValueError("Invalid config:\n  " + "\n  ".join(problems))
  path = _path(config)
  tx, spec = _optimizer(path, config, optimizer, mesh.axis_names)
  return _build(path, config, mesh, tx, spec, model)


def _optimizer(
  path: type[GradSync], config, optimizer: optax.GradientTransformation, axes
) -> tuple[Any, Any]:
  """``(tx, opt_state_spec)``: ``optimizer`` as the strategy ``path`` keeps it on the mesh
  ``axes``."""
  if path in (ShardedUpdate, DeferredShardedUpdate):
    tx = tc.sharded_update(
      optimizer,
      axes,
      bucket_bytes=config.grad_bucket_bytes,
      implementation=config.grad_implementation,
      transport_dtype=transport_dtype(config),
      error_feedback=config.grad_error_feedback,
    )
    return tx, P(axes)
  if path is ErrorFeedbackAllReduce:
    return with_error_feedback(optimizer), ErrorFeedbackState(inner=P(), residual=P(axes))
  return optimizer, P()


def _path(config: ml_collections.ConfigDict) -> type[GradSync]:
  """The one decision: the strategy the config's gradient fields describe (for a config
  that ``validation`` refuses, the one their precedence gives)."""
  if config.weight_update_sharding:
    return DeferredShardedUpdate if config.defer_weight_gather else ShardedUpdate
  if config.grad_overlap:
    return ThreadedAllReduce
  return ErrorFeedbackAllReduce if config.grad_error_feedback else AllReduce


def _build(path: type[GradSync], config, mesh, tx, spec, model) -> GradSync:
  """The strategy ``path`` around ``tx`` (kept as ``spec`` says) with the config's
  settings."""
  if path is ShardedUpdate:
    return ShardedUpdate(tx, spec)
  if path is DeferredShardedUpdate:
    return DeferredShardedUpdate(tx, spec, _deferred_layout(config, mesh, tx, model))
  if path is ThreadedAllReduce:
    return ThreadedAllReduce(tx, summed_during_backward_from_config(config), spec)
  return path(tx, all_reduce_from_config(config), spec)  # AllReduce, ErrorFeedbackAllReduce


def _deferred_layout(config, mesh, tx, model) -> ParamsLayout:
  """The layout of a running state of shards (``ParamsLayout``), its gather's buckets
  filled in the order ``model``'s forward pass reads the parameters."""
  axes = mesh.axis_names
  image = jax.ShapeDtypeStruct((1, config.image_size, config.image_size, 3), model.dtype)
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros(image.shape, image.dtype), train=False)
  )
  like = variables["params"]
  forward = lambda params, batch_stats, x: model.apply(
    {"params": params, "batch_stats": batch_stats}, x, train=False
  )
  order = tc.packing.first_use_order(forward, like, variables["batch_stats"], image)
  gather = functools.partial(tx.gather_params, like=like, order=order)

  def converter(body, in_spec, out_spec):
    convert = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
    return lambda state: state.replace(params=convert(state.params))

  return ParamsLayout(
    spec=P(axes),
    gather=gather,
    to_running=converter(tx.shard_params, P(), P(axes)),
    to_stored=converter(gather, P(axes), P()),
  )
