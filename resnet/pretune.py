"""Tuning before training (``config.tune``): measure this model's collectives on this mesh.

The gradient summation of the model's parameter tree and batch norm on the activation
shapes the model normalizes (per replica) are timed with ``torus_collectives.tuning.tuner.tune_for``
on every process; process 0's timings and table file decide for all. The run is added to
the user cache and the result installed, so the train step traced afterwards runs what
the rule of ``torus_collectives.tuning.tables`` confirms: a torus implementation only once it
beat XLA with confidence in this run and in an earlier one, from another process, that
the cache holds. The run log says which implementation each op got.
"""

from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import linen as nn

from torus_collectives.norm import linen as tc_nn
from torus_collectives.tuning import tuner


def batch_norm_shapes(model: nn.Module, variables: Any, image_shape) -> list[tuple]:
  """``(shape, dtype)`` of the input of every batch norm of ``model`` on a per-replica
  batch of ``image_shape`` (NHWC), in order; shapes only, nothing is computed."""
  seen = []

  def record(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, tc_nn.BatchNorm) and context.method_name == "__call__":
      x = args[0]
      seen.append((tuple(x.shape), jnp.promote_types(x.dtype, module.dtype or x.dtype)))
    return next_fun(*args, **kwargs)

  def apply(variables, image):
    with nn.intercept_methods(record):
      return model.apply(variables, image, train=False)

  jax.eval_shape(apply, variables, jax.ShapeDtypeStruct(tuple(image_shape), model.dtype))
  return seen


def tune_model(
  model: nn.Module,
  abstract_state: Any,
  mesh: jax.sharding.Mesh,
  *,
  per_replica_batch: int,
  image_size: int,
  bn_group_size: int,
  **kwargs,
) -> dict[str, str]:
  """Tunes ``model``'s gradient summation and batch norms on ``mesh``; logs and returns
  ``{op: implementation}``. ``abstract_state`` has ``params`` and ``batch_stats`` (shapes
  suffice, e.g. ``jax.eval_shape(init, key)``). Keyword arguments go to ``tune_cases``."""
  variables = {"params": abstract_state.params, "batch_stats": abstract_state.batch_stats}
  shapes = batch_norm_shapes(model, variables, (per_replica_batch, image_size, image_size, 3))
  choices = tuner.tune_for(
    abstract_state.params,
    shapes,
    mesh,
    group_size=bn_group_size,
    label=type(model).__name__,
    **kwargs,
  )
  if jax.process_index() == 0:
    for op, implementation in choices.items():
      logging.warning("tuned: %s -> %s", op, implementation)
  return choices
