"""The ResNet example's ``config.grad_overlap``: the train step's gradient mean summed during
the backward pass (``tc.value_and_summed_grad``).

Two train steps of a tiny ResNet on a 2x4 mesh with small buckets (several in flight):
with the split Pallas kernels, in TPU interpret mode through the split-call extension
(race detector on), the weights, batch statistics and metrics equal those of the plain
step (``value_and_grad``, then ``all_reduce_gradients``) within float32 rounding (the two
sum in different orders); with "xla", bitwise. With weight-update sharding and the
deferred gather, the layout's threaded sharded step (``tx.value_and_apply``) on "xla" is
the plain sharded step bitwise; with the split kernels it stalls on this model in TPU
interpret mode (one device never enters the next kernel call while the others wait in
it), so validation refuses that combination, as it refuses the option wherever it cannot
apply.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from async_interpret import async_interpret_mode
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import models, optim, train, validation
from resnet.configs import default

BUCKET_BYTES = 320 * 1024  # two buckets of the tiny ResNet's 0.5 MB gradient


def _two_steps(implementation: str, overlap: bool, sharded: bool = False):
  """Two train steps; ``sharded``: with weight-update sharding and the deferred gather
  (the state's parameters returned whole, as stored)."""
  mesh = tc.make_torus_mesh((2, 4))
  axes = mesh.axis_names
  model = models.create_model("resnet_tiny", num_classes=10, dtype=jnp.float32, axis_name=axes)
  config = default.get_config()
  config.image_size = 16
  config.grad_implementation = implementation
  config.grad_bucket_bytes = BUCKET_BYTES
  config.grad_overlap = overlap
  config.weight_update_sharding = config.defer_weight_gather = sharded
  learning_rate_fn = optax.constant_schedule(0.1)
  tx, spec = optim.create_optimizer(config, learning_rate_fn, axes)
  rng = np.random.default_rng(0)
  batch = jax.device_put(
    {
      "image": jnp.asarray(rng.standard_normal((16, 16, 16, 3)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, 10, 16), jnp.int32),
    },
    NamedSharding(mesh, P(axes)),
  )
  variables = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)
  state = train.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    opt_state=jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(
      variables["params"]
    ),
  )
  layout = train.params_layout(config, model, tx, mesh, jax.eval_shape(lambda: state))
  state = layout.to_running(state)
  step = jax.jit(
    train.make_train_step(
      model,
      tx,
      learning_rate_fn,
      mesh,
      num_classes=10,
      label_smoothing=0.1,
      average_gradients=train.gradient_averaging(config),
      opt_state_spec=spec,
      layout=layout,
      value_and_averaged_grad=train.gradient_threading(config),
    )
  )
  metrics = []
  for _ in range(2):
    state, m = step(state, batch)
    metrics.append(m)
  return jax.device_get((layout.to_stored(state), metrics))


def _compare(ours, reference, **tolerance):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
    if tolerance:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tolerance)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.timeout(600, method="thread")
def test_threaded_pallas_step_matches_the_plain_step():
  with async_interpret_mode("on_wait", deadlock_timeout_s=120.0):
    threaded = _two_steps("pallas", overlap=True)
  plain = _two_steps("xla", overlap=False)
  _compare(threaded, plain, rtol=1e-5, atol=1e-6)


def _without_grad_norm(steps):
  state, metrics = steps
  return state, [{k: v for k, v in m.items() if k != "grad_norm"} for m in metrics]


@pytest.mark.slow
def test_threaded_sharded_step_on_xla_is_the_plain_sharded_step_bitwise():
  ours, plain = _two_steps("xla", True, sharded=True), _two_steps("xla", False, sharded=True)
  _compare(_without_grad_norm(ours), _without_grad_norm(plain))


@pytest.mark.slow
def test_threading_on_xla_is_the_plain_step_bitwise():
  _compare(_two_steps("xla", overlap=True), _two_steps("xla", overlap=False))


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
