"""LARS (You et al. 2017) with one reduction per step: the trust ratio of every leaf from
independent squared norms.

``optax.lars`` takes each leaf's norms through ``optax.safe_norm``, whose second norm
depends on the first; inside ``sharded_update`` that is two rounds of reductions per step.
``scale_by_trust_ratio`` here computes the same ratio (``max(norm, min_norm)``, and a ratio
of 1 where either norm is zero, as optax) from plain norms: all of a step's squared norms
are independent, so ``sharded_update`` completes them with one ``psum`` of 2L floats for L
leaves (its interpreter batches the deferred reductions). Unsharded it equals optax's
bitwise, and each leaf's update reads that leaf's norms only, so
``value_and_summed_grad(update=...)`` can step a leaf as soon as its bucket is summed.

``axis_name`` is for code that runs the transformation on shards itself, without
``sharded_update``: the squared norms are then summed over ``axis_name`` explicitly.
Inside ``sharded_update`` leave it ``None``; ``sharded_update`` refuses a transformation
that communicates over its own axes.

This module needs optax (``pip install 'torus-collectives[optax]'``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives._optional import require
from torus_collectives.collectives import AxisName

optax = require("optax", "trust_ratio")


def scale_by_trust_ratio(
  min_norm: float = 0.0,
  trust_coefficient: float = 1.0,
  eps: float = 0.0,
  *,
  axis_name: AxisName | None = None,
) -> optax.GradientTransformation:
  """``optax.scale_by_trust_ratio`` from plain norms, all independent (module doc); with
  ``axis_name``, on leaves sharded over it, the squared norms summed over the shards in one
  vector."""

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("scale_by_trust_ratio needs params")
    leaves, treedef = jax.tree.flatten(updates)
    param_leaves = treedef.flatten_up_to(params)
    if not leaves:
      return updates, state
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in param_leaves + leaves]
    if axis_name is None:  # each leaf's ratio reads its own norms only
      norms = [jnp.sqrt(square) for square in squares]
    else:  # one psum of all of them
      norms = jnp.sqrt(lax.psum(jnp.stack(squares), axis_name))
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
  """``optax.lars``'s chain (decayed weights, masked trust ratio, learning rate, momentum)
  with this module's one-reduction trust ratio; ``axis_name`` as there."""
  return optax.chain(
    optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
    optax.masked(
      scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps, axis_name=axis_name),
      mask=trust_ratio_mask,
    ),
    optax.scale_by_learning_rate(learning_rate),
    optax.trace(decay=momentum, nesterov=nesterov),
  )
