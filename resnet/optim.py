"""LARS with linear warmup and polynomial decay, as in Google's MLPerf ResNet-50.

The peak learning rate scales linearly with the global batch: ``base_learning_rate`` is
the rate for a batch of 256. Layer-wise trust ratios and weight decay apply to
convolution and dense kernels only; batch-norm scales and offsets and the dense bias use
plain momentum SGD (You et al. 2017; the MLPerf reference excludes them the same way,
since their norms say nothing about a layer's scale).
"""

import jax
import optax


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
      f'Need 0 <= {warmup_steps=} < {total_steps=}; shorten the warmup or train longer.'
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
  return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == 'kernel', params)


def lars(
  learning_rate_fn: optax.Schedule,
  *,
  weight_decay: float,
  momentum: float,
  trust_coefficient: float,
  eps: float,
) -> optax.GradientTransformation:
  """optax LARS with the kernel-only trust ratio and weight decay of ``kernel_mask``."""
  return optax.lars(
    learning_rate_fn,
    weight_decay=weight_decay,
    weight_decay_mask=kernel_mask,
    trust_coefficient=trust_coefficient,
    eps=eps,
    trust_ratio_mask=kernel_mask,
    momentum=momentum,
  )
