"""A small data-parallel optimisation run, sharded or not; shared by the one-process tests
and the two-process worker so that both run exactly the same steps.

Parameters look like a ResNet's (a conv kernel, batch-norm scale and bias, a dense kernel
and bias), with sizes that do not divide by 8 so the padding runs. Parameters and the
per-replica gradients of every step are drawn from fixed keys inside jit, so they do not
depend on how the devices are spread over processes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.weight_update import trust_ratio

AXES = ("x", "y")
STEPS = 5  # optimizer steps of the equivalence runs
SHAPES = {
  "conv": {"kernel": (3, 3, 2, 5)},
  "bn": {"scale": (5,), "bias": (5,)},
  "dense": {"kernel": (5, 7), "bias": (7,)},
}


def kernel_mask(params):
  """LARS's exclusions: weight decay and trust ratio on kernels only, not BN or biases."""
  return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


def transform(name: str) -> optax.GradientTransformation:
  """The optimizer ``name``, the same transformation sharded or not."""
  if name == "lars":
    return trust_ratio.lars(
      0.5,
      weight_decay=1e-2,
      weight_decay_mask=kernel_mask,
      trust_coefficient=0.01,
      trust_ratio_mask=kernel_mask,
      momentum=0.9,
    )
  if name == "momentum":
    return optax.sgd(0.1, momentum=0.9)
  if name == "adam":
    return optax.adam(1e-2)
  raise ValueError(name)


@functools.partial(jax.jit, static_argnums=0)
def initial_params(mesh):
  keys = iter(jax.random.split(jax.random.key(0), 8))
  params = jax.tree.map(
    lambda shape: jax.random.normal(next(keys), shape), SHAPES, is_leaf=lambda s: type(s) is tuple
  )
  return jax.lax.with_sharding_constraint(params, NamedSharding(mesh, P()))


def local_grads(params, step):
  """This replica's gradient at ``step``: normal noise plus a pull towards zero."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), step), lax.axis_index(AXES))
  leaves, treedef = jax.tree.flatten(params)
  noise = [
    jax.random.normal(k, p.shape) for k, p in zip(jax.random.split(key, len(leaves)), leaves)
  ]
  return jax.tree.unflatten(treedef, [0.5 * p + n for p, n in zip(leaves, noise)])


def step_fn(mesh, name: str, *, sharded: bool, implementation: str = "xla", gather="params"):
  """One jitted step ``(params, opt_state, step) -> (params, opt_state)`` over ``mesh``;
  sharded, it all-gathers the new parameters (``apply_gradients``), or with
  ``gather="updates"`` the updates (``update``), or with ``gather="deferred"`` carries each
  device's parameter shards from step to step (``apply_gradients(..., gather=False)``) and
  gathers them at the start of the next (``gather_params``, buckets in ``GATHER_ORDER``)."""
  if sharded:
    tx = tc.sharded_update(transform(name), AXES, implementation=implementation)
    state_spec = P(AXES)
  else:
    tx, state_spec = transform(name), P()

  def body(params, opt_state, step):
    if gather == "deferred":
      params = tx.gather_params(params, abstract_params(), order=GATHER_ORDER)
      grads = local_grads(params, step)
      return tx.apply_gradients(grads, opt_state, params, gather=False)
    grads = local_grads(params, step)
    if sharded and gather == "params":
      return tx.apply_gradients(grads, opt_state, params)
    if not sharded:
      grads = tc.all_reduce_gradients(grads, AXES, implementation=implementation)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_spec))
  params_spec = P(AXES) if gather == "deferred" else P()
  step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(params_spec, state_spec, P()),
      out_specs=(params_spec, state_spec),
    )
  )
  return init, step


# Leaves in jax.tree.flatten order: bn bias, bn scale, conv kernel, dense bias, dense kernel.
GATHER_ORDER = (2, 1, 0, 4, 3)  # the forward pass's: conv, bn, dense


def abstract_params():
  return jax.tree.map(
    lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32),
    SHAPES,
    is_leaf=lambda s: type(s) is tuple,
  )


def run(mesh, name: str, steps: int, *, sharded: bool, implementation="xla", gather="params"):
  """Parameters and optimizer state after ``steps`` steps from ``initial_params``."""
  init, step = step_fn(mesh, name, sharded=sharded, implementation=implementation, gather=gather)
  params = initial_params(mesh)
  opt_state = init(params)
  if gather == "deferred":
    tx = tc.sharded_update(transform(name), AXES, implementation=implementation)
    shard_map = functools.partial(jax.shard_map, mesh=mesh)
    params = jax.jit(shard_map(tx.shard_params, in_specs=P(), out_specs=P(AXES)))(params)
  for i in range(steps):
    params, opt_state = step(params, opt_state, jnp.int32(i))
  if gather == "deferred":
    gather_all = lambda shards: tx.gather_params(shards, abstract_params())
    params = jax.jit(shard_map(gather_all, in_specs=P(AXES), out_specs=P()))(params)
  return params, opt_state
