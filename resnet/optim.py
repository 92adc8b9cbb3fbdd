"""LARS with linear warmup and polynomial decay, as in Google's MLPerf ResNet-50.

The peak learning rate scales linearly with the global batch: ``base_learning_rate`` is
the rate for a batch of 256. Layer-wise trust ratios and weight decay apply to
convolution and dense kernels only; batch-norm scales and offsets and the dense bias use
plain momentum SGD (You et al. 2017; the MLPerf reference excludes them the same way,
since their norms say nothing about a layer's scale).

How the optimizer meets the gradient synchronisation is ``grad_sync``'s choice
(``grad_sync.strategy_from_config`` wraps ``create_lars`` as the config says): with
``weight_update_sharding`` it runs inside ``tc.sharded_update`` (gradients reduce-scattered,
LARS on each device's 1/p shard of every layer, its layer norms completed over the shards
by one small ``psum`` per step, the updates all-gathered); with ``grad_error_feedback`` its
state is an ``ErrorFeedbackState``: the optimizer's own state and each device's
quantization residual of every gradient leaf (float32, ``[1, *shape]`` per device, spec
``P(axes)``), which the next step's gradient summation adds back, checkpointed with the rest
of the state. A run without error feedback has the state it always had.
"""

import jax
import ml_collections
import optax

from torus_collectives.weight_update import trust_ratio
from torus_collectives.weight_update.sharded_update import (
  ErrorFeedbackState as ErrorFeedbackState,  # the state with error feedback, re-exported
)


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


def create_lars(
  config: ml_collections.ConfigDict, learning_rate_fn: optax.Schedule
) -> optax.GradientTransformation:
  """The config's LARS, for whole replicated leaves (``grad_sync`` shards or wraps it)."""
  return lars(
    learning_rate_fn,
    weight_decay=config.weight_decay,
    momentum=config.momentum,
    trust_coefficient=config.lars_trust_coefficient,
    eps=config.lars_eps,
  )
