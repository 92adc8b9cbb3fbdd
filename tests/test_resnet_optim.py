"""LARS leaves batch-norm parameters and biases alone: no trust ratio, no weight decay; with
weight-update sharding it gives the same weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import grad_sync, models, optim, train
from resnet.configs import default, imagenet, pod

LR, TRUST, WD = 0.5, 0.01, 1e-2


def _params():
  return {
    "conv": {"kernel": jnp.full((3, 3, 2, 4), 2.0)},
    "bn": {"scale": jnp.full((4,), 3.0), "bias": jnp.full((4,), -1.0)},
    "dense": {"kernel": jnp.full((4, 5), 0.5), "bias": jnp.full((5,), 4.0)},
  }


def test_kernel_mask_selects_only_kernels_of_a_resnet():
  model = models.create_model("resnet_tiny", num_classes=3, dtype=jnp.float32)
  init = functools.partial(model.init, train=False)
  params = jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, 16, 16, 3)))["params"]
  flat = jax.tree_util.tree_flatten_with_path(optim.kernel_mask(params))[0]
  for path, included in flat:
    assert included == (path[-1].key == "kernel"), path
  assert any(included for _, included in flat) and not all(included for _, included in flat)


def test_lars_scales_kernels_and_leaves_bn_and_biases_to_plain_sgd():
  params = _params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
  tx = optim.lars(
    optax.constant_schedule(LR), weight_decay=WD, momentum=0.9, trust_coefficient=TRUST, eps=0.0
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  for name in ("bn", "dense"):
    for leaf in ("scale", "bias"):
      if leaf in updates[name]:
        np.testing.assert_allclose(updates[name][leaf], -LR * 0.25, rtol=1e-6)
  for name in ("conv", "dense"):
    w = params[name]["kernel"]
    g = grads[name]["kernel"] + WD * w
    expected = -LR * TRUST * jnp.linalg.norm(w) / jnp.linalg.norm(g) * g
    np.testing.assert_allclose(updates[name]["kernel"], expected, rtol=1e-5)


def test_learning_rate_warms_up_linearly_then_decays_to_the_end_rate():
  learning_rate_fn = optim.learning_rate_schedule(
    base_learning_rate=2.0,
    global_batch=512,
    warmup_steps=10,
    total_steps=30,
    end_learning_rate=0.01,
    power=2.0,
  )
  np.testing.assert_allclose(
    [learning_rate_fn(0), learning_rate_fn(5), learning_rate_fn(10)], [0.0, 2.0, 4.0]
  )
  np.testing.assert_allclose(learning_rate_fn(20), 0.01 + (4.0 - 0.01) * 0.25, rtol=1e-6)
  np.testing.assert_allclose(learning_rate_fn(30), 0.01, rtol=1e-6)


def test_weight_update_sharding_is_on_at_scale_and_off_for_digits():
  assert not default.get_config().weight_update_sharding
  assert imagenet.get_config().weight_update_sharding
  assert pod.get_config().weight_update_sharding


@pytest.mark.slow
def test_weight_update_sharding_matches_replicated_lars_in_the_train_step():
  """Two train steps of a tiny ResNet: sharded LARS state, same weights as replicated LARS
  (within float32 rounding: the sharded trust ratio sums its norms in another order); with
  the weight gather deferred to the next step (``config.defer_weight_gather``), bitwise the
  weights of the sharded steps, the running state holding one shard of them per device."""
  mesh = tc.make_torus_mesh((2, 4))
  axes = mesh.axis_names
  model = models.create_model(
    "resnet_tiny", num_classes=10, dtype=jnp.float32, axis_name=axes, bn_group_size=8
  )
  learning_rate_fn = optax.constant_schedule(0.5)
  rng = np.random.default_rng(0)
  batch = jax.device_put(
    {
      "image": jnp.asarray(rng.standard_normal((16, 16, 16, 3)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, 10, 16), jnp.int32),
    },
    NamedSharding(mesh, P(axes)),
  )
  # One jitted init: the model's eager init compiles a program per parameter shape.
  init = jax.jit(lambda key: model.init(key, jnp.zeros((1, 16, 16, 3)), train=False))
  variables = init(jax.random.key(0))
  results = {}
  for variant in ("replicated", "sharded", "deferred"):
    config = default.get_config()
    config.weight_update_sharding = variant != "replicated"
    config.defer_weight_gather = variant == "deferred"
    config.image_size = 16
    sync = grad_sync.strategy_from_config(
      config, mesh, optim.create_lars(config, learning_rate_fn), model=model
    )
    init = jax.jit(
      jax.shard_map(sync.tx.init, mesh=mesh, in_specs=P(), out_specs=sync.opt_state_spec)
    )
    state = train.TrainState(
      step=jnp.zeros((), jnp.int32),
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      opt_state=init(variables["params"]),
    )
    state = sync.layout.to_running(state)
    step = jax.jit(
      train.make_train_step(
        model,
        sync.tx,
        learning_rate_fn,
        mesh,
        num_classes=10,
        label_smoothing=0.1,
        sync=sync,
      )
    )
    for _ in range(2):
      state, _ = step(state, batch)
    if variant == "deferred":
      assert all(leaf.sharding.spec == P(axes) for leaf in jax.tree.leaves(state.params))
    results[variant] = sync.layout.to_stored(state)
  for leaf in jax.tree.leaves(results["sharded"].opt_state):
    assert leaf.sharding.spec == P(axes)
  for ours, deferred, ref in zip(
    jax.tree.leaves(results["sharded"].params),
    jax.tree.leaves(results["deferred"].params),
    jax.tree.leaves(results["replicated"].params),
    strict=True,
  ):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(deferred), np.asarray(ours))


def test_moving_statistics_average_when_a_bn_group_spans_a_whole_axis():
  """A batch-norm group of 4 on a 2x4 mesh spans the whole "y" axis, so its statistics
  vary over "x" only; lax.pmean over both axes refuses such a value, the step's average
  of the moving statistics does not, and gives the mean over the groups."""
  mesh = tc.make_torus_mesh((2, 4))

  def body(x):
    group_statistic = lax.pmean(x, "y")  # varies over "x" only
    return train._mean_over_mesh(group_statistic, ("x", "y"))

  x = jnp.arange(8.0).reshape(8, 1)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("x", "y")), out_specs=P()))
  np.testing.assert_array_equal(np.asarray(f(x)), [[3.5]])  # the mean of 0..7
  with pytest.raises(ValueError, match="varying, unreduced, reduced or invarying"):
    jax.jit(
      jax.shard_map(
        lambda x: lax.pmean(lax.pmean(x, "y"), ("x", "y")),
        mesh=mesh,
        in_specs=P(("x", "y")),
        out_specs=P(),
      )
    )(x)
