"""The ResNet example's ``config.grad_overlap``: the train step's gradient mean summed during
the backward pass (``tc.experimental.value_and_summed_grad``).

A tiny ResNet on a 2x2 mesh (four chains a bucket, one per axis and direction) with small
buckets (several in flight): one train step with the split Pallas kernels, in TPU
interpret mode through the split-call extension (race detector on), gives the weights,
batch statistics and metrics of the plain step (``value_and_grad``, then
``all_reduce_gradients``) within float32 rounding (the two sum in different orders); two
steps with "xla", bitwise, so the threaded step's state carries into the next. The plain
steps are run once for both. Validation refuses what the threading cannot do.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import grad_sync, models, optim, train, validation
from resnet.configs import default
from torus_collectives.testing.split_interpret import async_interpret_mode

BUCKET_BYTES = 320 * 1024  # two buckets of the tiny ResNet's 0.5 MB gradient
# Both directions of both axes in use, at the fewest calls a chain: the interpreted calls
# (each a callback-laden program per device) are most of this file's time.
MESH_SHAPE = (2, 2)


@functools.cache
def _initial_variables():
  """The tiny ResNet's variables from key 0, as host arrays, shared by every run: one
  jitted init (the model's eager init compiles a program per parameter shape)."""
  model = models.create_model("resnet_tiny", num_classes=10, dtype=jnp.float32)
  init = jax.jit(lambda key: model.init(key, jnp.zeros((1, 16, 16, 3)), train=False))
  return jax.device_get(init(jax.random.key(0)))


def _steps(implementation: str, overlap: bool, steps: int = 2):
  """``(state, metrics)`` after each of ``steps`` train steps (the state's parameters as
  stored)."""
  mesh = tc.make_torus_mesh(MESH_SHAPE, devices=jax.devices()[: math.prod(MESH_SHAPE)])
  axes = mesh.axis_names
  model = models.create_model("resnet_tiny", num_classes=10, dtype=jnp.float32, axis_name=axes)
  config = default.get_config()
  config.image_size = 16
  config.grad_implementation = implementation
  config.grad_bucket_bytes = BUCKET_BYTES
  config.grad_overlap = overlap
  learning_rate_fn = optax.constant_schedule(0.1)
  sync = grad_sync.strategy_from_config(
    config, mesh, optim.create_lars(config, learning_rate_fn), model=model
  )
  rng = np.random.default_rng(0)
  batch = jax.device_put(
    {
      "image": jnp.asarray(rng.standard_normal((16, 16, 16, 3)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, 10, 16), jnp.int32),
    },
    NamedSharding(mesh, P(axes)),
  )
  variables = _initial_variables()
  state = train.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    opt_state=jax.jit(
      jax.shard_map(sync.tx.init, mesh=mesh, in_specs=P(), out_specs=sync.opt_state_spec)
    )(variables["params"]),
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
  after = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    after.append(jax.device_get((sync.layout.to_stored(state), metrics)))
  return after


def _compare(ours, reference, **tolerance):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
    if tolerance:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tolerance)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def plain_steps():
  return _steps("xla", overlap=False)


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.timeout(600, method="thread")
def test_threaded_pallas_step_matches_the_plain_step(plain_steps):
  with async_interpret_mode("on_wait", deadlock_timeout_s=120.0):
    threaded = _steps("pallas", overlap=True, steps=1)
  _compare(threaded, plain_steps[:1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_threading_on_xla_is_the_plain_step_bitwise(plain_steps):
  _compare(_steps("xla", overlap=True), plain_steps)


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"weight_update_sharding": True}, "with config.weight_update_sharding=True is not offered"),
    (
      {"weight_update_sharding": True, "defer_weight_gather": True},
      "with config.weight_update_sharding=True is not offered",
    ),
    ({"grad_transport_dtype": "bfloat16"}, "sums the gradients in their own dtype"),
  ],
)
def test_validation_refuses_what_threading_cannot_do(changes, message):
  config = default.get_config()
  config.grad_overlap = True
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    validation.validate_config(config)
