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
  """``optax.scale_by_trust_ratio`` with one reduction per step: each leaf's update scaled
  by ``trust_coefficient * max(|param|, min_norm) / (max(|update|, min_norm) + eps)``, and
  by 1 where either norm is zero, as optax.

  The norms are plain (float32) norms, all independent of each other, so
  ``sharded_update`` completes all of a step's norms with one ``psum``; unsharded the
  result equals optax's bitwise.

  Args:
    min_norm: the smallest norm used for the parameters and the updates (default 0.0).
    trust_coefficient: multiplies the ratio (default 1.0).
    eps: added to the update's norm in the denominator (default 0.0).
    axis_name: None (default, and what ``sharded_update`` needs: it makes the norms
      global itself), or the axes over which code that runs the transformation on its own
      shards holds each leaf sharded: the squared norms are then summed over them with
      one ``lax.psum``.

  Returns:
    An ``optax.GradientTransformation`` with an empty state; its ``update`` takes
    ``(updates, state, params)`` and returns ``(scaled updates, state)``, the updates of
    their own structure and shapes.

  Raises:
    ValueError: when its ``update`` is called without ``params``.
    UnshardableTransformError: inside ``sharded_update`` with ``axis_name`` over its own
      axes, when traced (build it with ``axis_name=None`` there).
    ImportError: on import of this module without optax: install it with
      ``pip install 'torus-collectives[optax]'``.
  """

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "scale_by_trust_ratio needs params: call update(updates, state, params), as optax.lars does"
      )
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
  """LARS (You et al. 2017): ``optax.lars`` with the one-reduction trust ratio of
  ``scale_by_trust_ratio``, for ``sharded_update``.

  The same chain as ``optax.lars``, with the same arguments: decayed weights, the masked
  trust ratio, the learning rate, momentum. Unsharded it equals ``optax.lars`` bitwise;
  inside ``sharded_update`` all of a step's norms complete in one ``psum``, where
  ``optax.lars`` needs two (``optax.safe_norm``).

  Args:
    learning_rate: a float, or an optax schedule of the step count.
    weight_decay: the weight decay added to the updates (default 0.0).
    weight_decay_mask: which leaves get weight decay: True (default: all), or a pytree of
      bools like (or a prefix of) the parameters, or a callable returning one.
    trust_coefficient: multiplies the trust ratio (default 0.001).
    eps: added to the update's norm in the ratio's denominator (default 0.0).
    trust_ratio_mask: which leaves the trust ratio scales, as ``weight_decay_mask``
      (default True: all); biases and batch-norm parameters are commonly left out.
    momentum: the momentum's decay rate (default 0.9).
    nesterov: use Nesterov momentum (default False).
    axis_name: as in ``scale_by_trust_ratio``: None (default) inside ``sharded_update``;
      the sharding axes for code that runs the transformation on shards itself.

  Returns:
    An ``optax.GradientTransformation``, used as ``optax.lars``'s is
    (``updates, state = tx.update(grads, state, params)``, then
    ``optax.apply_updates(params, updates)``).

  Raises:
    ValueError: when its ``update`` is called without ``params``.
    UnshardableTransformError: inside ``sharded_update`` with ``axis_name`` over its own
      axes, when traced (build it with ``axis_name=None`` there).
    ImportError: on import of this module without optax: install it with
      ``pip install 'torus-collectives[optax]'``.
  """
  return optax.chain(
    optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
    optax.masked(
      scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps, axis_name=axis_name),
      mask=trust_ratio_mask,
    ),
    optax.scale_by_learning_rate(learning_rate),
    optax.trace(decay=momentum, nesterov=nesterov),
  )
