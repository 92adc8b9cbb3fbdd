"""LARS with linear warmup and polynomial decay, as in Google's MLPerf ResNet-50.

The peak learning rate scales linearly with the global batch: ``base_learning_rate`` is
the rate for a batch of 256. Layer-wise trust ratios and weight decay apply to
convolution and dense kernels only; batch-norm scales and offsets and the dense bias use
plain momentum SGD (You et al. 2017; the MLPerf reference excludes them the same way,
since their norms say nothing about a layer's scale).

With ``weight_update_sharding`` the optimizer runs inside ``tc.sharded_update``: gradients
are reduce-scattered, LARS updates each device's 1/p shard of every layer (its layer norms
completed over the shards by ``sharded_update``, one small ``psum`` per step), and the
updates are all-gathered.

With ``grad_error_feedback`` the optimizer state is an ``ErrorFeedbackState``: the
optimizer's own state and each device's quantization residual of every gradient leaf
(float32, ``[1, *shape]`` per device, spec ``P(axes)``), which the next step's gradient
summation adds back. ``tc.sharded_update(..., error_feedback=True)`` keeps it so itself;
without weight-update sharding ``with_error_feedback`` holds it and the train step passes
it through ``tc.all_reduce_gradients(residual=...)``. Either way it is checkpointed with
the rest of the state, and a run without error feedback has the state it always had.
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.weight_update import trust_ratio
from torus_collectives.weight_update.sharded_update import ErrorFeedbackState


def learning_rate_schedule(
  *,
  base_learning_rate: float,
  global_batch: int,
  warmup_steps: int,
  total_steps: int,
  end_learning_rate: float,
  power: float,
) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then (1 - t)^power decay to ``end_learning_rate``."""
  if not 0 <= warmup_steps < total_steps:
    raise ValueError(
      f"Need 0 <= {warmup_steps=} < {total_steps=}; shorten the warmup or train longer."
    )
  peak = base_learning_rate * global_batch / 256
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, peak, warmup_steps),
      optax.polynomial_schedule(peak, end_learning_rate, power, total_steps - warmup_steps),
    ],
    [warmup_steps],
  )


def kernel_mask(params) -> dict:
  """True for the leaves LARS and weight decay act on: kernels, not scales or biases."""
  return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


def lars(
  learning_rate_fn: optax.Schedule,
  *,
  weight_decay: float,
  momentum: float,
  trust_coefficient: float,
  eps: float,
) -> optax.GradientTransformation:
  """LARS on kernels only, the same transformation sharded or not."""
  return trust_ratio.lars(
    learning_rate_fn,
    weight_decay=weight_decay,
    weight_decay_mask=kernel_mask,
    trust_coefficient=trust_coefficient,
    eps=eps,
    trust_ratio_mask=kernel_mask,
    momentum=momentum,
  )


def grad_transport_dtype(config: ml_collections.ConfigDict) -> jax.typing.DTypeLike | None:
  """``config.grad_transport_dtype`` as the ``transport_dtype=`` of the gradient summation
  (``tc.all_reduce_gradients`` or ``tc.sharded_update``): None for '' (the gradients travel
  in their own dtype), else that dtype; the library block-scales int8 and fp8 itself."""
  name = config.grad_transport_dtype
  return jax.numpy.dtype(name) if name else None


def with_error_feedback(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with each device's gradient residual beside its state (``ErrorFeedbackState``,
  as ``tc.sharded_update`` keeps it): ``init`` adds float32 zeros like the parameters with
  a leading device axis of 1 (run under ``shard_map``, out spec ``P(axes)``); ``update``
  runs ``tx`` on the inner state and keeps the residual, which the train step replaces
  with the one the gradient summation returns."""

  def init(params):
    residual = jax.tree.map(lambda p: jnp.zeros((1, *p.shape), jnp.float32), params)
    return ErrorFeedbackState(tx.init(params), residual)

  def update(updates, state, params=None):
    updates, inner = tx.update(updates, state.inner, params)
    return updates, state._replace(inner=inner)

  return optax.GradientTransformation(init, update)


def create_optimizer(
  config: ml_collections.ConfigDict, learning_rate_fn: optax.Schedule, axes: tuple[str, ...]
) -> tuple[optax.GradientTransformation, P]:
  """The config's LARS and the ``shard_map`` spec of its state over the mesh ``axes``:
  replicated, or, with ``config.weight_update_sharding``, split over every device; with
  ``config.grad_error_feedback`` the state holds each device's residual too, split over
  every device (``ErrorFeedbackState``)."""
  sharded = config.weight_update_sharding
  tx = lars(
    learning_rate_fn,
    weight_decay=config.weight_decay,
    momentum=config.momentum,
    trust_coefficient=config.lars_trust_coefficient,
    eps=config.lars_eps,
  )
  if not sharded and config.grad_error_feedback:
    return with_error_feedback(tx), ErrorFeedbackState(inner=P(), residual=P(axes))
  if not sharded:
    return tx, P()
  sharded_tx = tc.sharded_update(
    tx,
    axes,
    bucket_bytes=config.grad_bucket_bytes,
    implementation=config.grad_implementation,
    transport_dtype=grad_transport_dtype(config),
    error_feedback=config.grad_error_feedback,
  )
  return sharded_tx, P(axes)
