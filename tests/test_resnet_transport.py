"""Gradient transport in the ResNet example: ``config.grad_transport_dtype`` reaches the
gradient summation, int8 block-scaled transport trains like bfloat16 transport over a few
steps from the same seed, with ``config.grad_error_feedback`` too (each device's residual
carried in the optimizer state, sharded or not), and the config names a bad
transport dtype (or one that the configured implementation or optimizer cannot carry, or
error feedback without one) before anything is built."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_resnet_train as resnet_train
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import grad_sync, optim, train, validation
from resnet.configs import default
from torus_collectives import quantization

STEPS = 4  # the tiny config's warmup is 2 steps; it must be shorter than the run
data_dir = resnet_train.data_dir  # the digits, shared with the end-to-end tests' fixture


def _train(config):
  """``STEPS`` steps of ``config`` from its seed: the losses, the change of every
  parameter from its initial value, the train step's lowered text and the final state."""
  mesh = train.create_mesh(config)
  data = train._open_data(config, mesh)
  program = train._build_program(config, mesh, data)
  state = program.layout.to_running(program.init_fn(program.key))
  initial = jax.device_get(state.params)
  batches = train._train_batches(config, data, start_step=0)
  losses, lowered = [], None
  for batch, _ in itertools.islice(batches, STEPS):
    lowered = lowered or program.train_step.lower(state, batch).as_text()
    state, metrics = program.train_step(state, batch)
    losses.append(float(metrics["train_loss"]))
  stored = program.layout.to_stored(state)
  final = jax.device_get(stored.params)
  return losses, jax.tree.map(np.subtract, final, initial), lowered, stored


# name -> the overrides of the tiny config; same seed and batches.
RUNS = {
  "bfloat16": dict(grad_transport_dtype="bfloat16"),
  "int8": dict(grad_transport_dtype="int8"),
  "int8 error feedback": dict(grad_transport_dtype="int8", grad_error_feedback=True),
  "int8 error feedback, sharded": dict(
    grad_transport_dtype="int8", grad_error_feedback=True, weight_update_sharding=True
  ),
}


@pytest.fixture(scope="module")
def runs(data_dir):
  """{name in ``RUNS``: ``_train``'s result}."""
  return {
    name: _train(resnet_train.tiny_config(data_dir, num_train_steps=STEPS, **overrides))
    for name, overrides in RUNS.items()
  }


def _norm(tree) -> float:
  return float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))


@pytest.mark.slow
def test_int8_transport_is_block_scaled_and_its_losses_finite(runs):
  """int8 travels as int8 (a collective permute of s8 values in the lowered step), and
  step 1's loss, computed before any gradient travels, is the bfloat16 run's exactly."""
  (bf16_losses, _, bf16_text, _), (int8_losses, _, int8_text, _) = runs["bfloat16"], runs["int8"]
  assert np.all(np.isfinite(bf16_losses)) and np.all(np.isfinite(int8_losses))
  assert int8_losses[0] == bf16_losses[0]
  assert any("collective_permute" in line and "i8" in line for line in int8_text.splitlines())
  assert not any("collective_permute" in line and "i8" in line for line in bf16_text.splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if n != "bfloat16"])
def test_int8_parameters_stay_within_the_quantization_error_of_bf16(runs, name):
  """The parameters' change over the run differs from bfloat16 transport's by at most
  ``tolerance`` of its norm, and so do the losses' changes (to first order, the gradient
  times the parameters' change).

  The tolerance, a worst case: on the 2x4 torus an all-reduce quantizes a value k = 5
  times (the reduce-scatter once per hop, (2 - 1) + (4 - 1), the all-gather once), each
  moving an element by at most delta = 1/254 (+1.6%) of its block's largest magnitude
  (``BlockScaled.delta``), so the mean gradient moves by at most k * delta ~ 2% of its
  blocks' largest magnitudes (the devices' mean). A factor 3 for how far a block's largest
  value sits above its root mean square (2.6 for 128 normal values) and for the devices'
  cancelling in the mean makes that <= 6% of the gradient's norm; LARS divides each
  kernel's update by its gradient's norm, which can double that (direction and length):
  12%. bfloat16's own rounding (2**-9 per element, 0.3% here against float32 transport)
  is well below it, and 4 steps are too few for the two trajectories to drift apart.
  Rounding errors of random sign keep the measured difference near 2.6%. Error feedback
  adds back what the previous step dropped, which stays within the same bound.
  """
  fmt = quantization.BlockScaled("int8")
  hops = (2 - 1) + (4 - 1) + 1
  tolerance = 3 * 2 * hops * fmt.delta
  (bf16_losses, bf16_delta, _, _), (int8_losses, int8_delta, _, _) = runs["bfloat16"], runs[name]
  difference = _norm(jax.tree.map(np.subtract, int8_delta, bf16_delta)) / _norm(bf16_delta)
  assert 0 < difference <= tolerance, (difference, tolerance)
  bf16_changes = np.subtract(bf16_losses[1:], bf16_losses[0])
  np.testing.assert_allclose(
    np.subtract(int8_losses[1:], int8_losses[0]),
    bf16_changes,
    rtol=0,
    atol=tolerance * np.max(np.abs(bf16_changes)),
  )


@pytest.mark.slow
def test_error_feedback_carries_each_devices_residual(runs):
  """With error feedback the optimizer state carries a residual per device and leaf:
  float32, ``[devices, *shape]`` split over the mesh, nonzero after the steps, different on
  every device (each quantizes its own partial sums); without it the state is LARS's."""
  axes = train.MESH_AXIS_NAMES[:2]
  assert not isinstance(runs["int8"][3].opt_state, optim.ErrorFeedbackState)
  for name in ("int8 error feedback", "int8 error feedback, sharded"):
    assert isinstance(runs[name][3].opt_state, optim.ErrorFeedbackState), name
    residual, params = runs[name][3].opt_state.residual, runs[name][3].params
    assert jax.tree.structure(residual) == jax.tree.structure(params), name
    for r, p in zip(jax.tree.leaves(residual), jax.tree.leaves(params)):
      assert r.shape == (8, *p.shape) and r.dtype == jnp.float32, name
      assert r.sharding.spec == P(axes), name
    total = sum(float(np.abs(np.asarray(r)).sum()) for r in jax.tree.leaves(residual))
    assert total > 0, name
    kernel = np.asarray(max(jax.tree.leaves(residual), key=lambda r: r.size))
    assert len({row.tobytes() for row in kernel}) == 8, name


def _summed_over_steps(config, grads, steps):
  """The sum over ``steps`` steps of the config's gradient mean (``average`` of its
  ``grad_sync.strategy_from_config``, as the train step runs it) of the same
  per-device ``grads`` (leaves ``[8, *shape]``, one row a device) on the 2x4 torus, the
  residual carried as the train state carries it; and the last residual (None without)."""
  mesh = tc.make_torus_mesh((2, 4), axis_names=train.MESH_AXIS_NAMES[:2])
  axes = mesh.axis_names
  optimizer = optim.create_lars(config, optax.constant_schedule(0.1))
  model = train.create_model(config, 10, mesh)
  average = grad_sync.strategy_from_config(config, mesh, optimizer, model=model).average

  def body(grads):
    grads = jax.tree.map(lambda g: g[0], grads)
    residual = jax.tree.map(jnp.zeros_like, grads) if config.grad_error_feedback else None
    total = None
    for _ in range(steps):
      if residual is None:
        mean = average(grads, axes)
      else:
        mean, residual = average(grads, axes, residual=residual)
      total = mean if total is None else jax.tree.map(jnp.add, total, mean)
    residual = jax.tree.map(lambda r: r[None], residual)
    return total, residual

  out_specs = (P(), None if not config.grad_error_feedback else P(axes))
  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=out_specs))
  return run(grads)


def test_error_feedback_sums_lose_only_the_last_residual():
  """The config's gradient mean with error feedback keeps the promise of
  ``tc.all_reduce_gradients``: over T steps of the same gradients, the summed means differ
  from T times the exact mean by the mean of the last residuals alone, where without
  feedback the same quantization error repeats every step."""
  steps = 4
  keys = jax.random.split(jax.random.key(0), 2)
  grads = {
    "kernel": jax.random.normal(keys[0], (8, 3, 3, 4, 8)),
    "bias": jax.random.normal(keys[1], (8, 200)) * 1e-3,
  }
  exact = jax.tree.map(lambda g: steps * np.mean(np.asarray(g, np.float64), axis=0), grads)
  errors = {}
  for feedback in (False, True):
    config = default.get_config()
    config.update(grad_transport_dtype="int8", grad_error_feedback=feedback)
    total, residual = _summed_over_steps(config, grads, steps)
    error = jax.tree.map(np.subtract, jax.device_get(total), exact)
    errors[feedback] = _norm(error)
    if feedback:
      last = jax.tree.map(lambda r: np.mean(np.asarray(r, np.float64), axis=0), residual)
      assert _norm(last) > 0
      for e, r, t in zip(*map(jax.tree.leaves, (error, last, exact))):
        np.testing.assert_allclose(e, -r, rtol=0, atol=1e-6 * np.max(np.abs(t)))
  assert 0 < errors[True] < errors[False], errors


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      dict(grad_transport_dtype="float16"),
      "config.grad_transport_dtype='float16' is invalid; it must be '' (gradients travel in "
      "their own dtype), 'bfloat16' or a block-scaled format, 'int8', 'float8_e4m3fn', "
      "'float8_e5m2'.",
    ),
    (
      dict(grad_transport_dtype="int8", grad_implementation="xla"),
      "config.grad_transport_dtype='int8' is block-scaled: config.grad_implementation must "
      "be one of ['auto', 'shard_map', 'pallas'], not 'xla'",
    ),
    (
      dict(grad_transport_dtype="bfloat16", weight_update_sharding=True),
      "config.grad_transport_dtype='bfloat16' needs config.weight_update_sharding=False",
    ),
    (
      dict(grad_error_feedback=True),
      "config.grad_error_feedback=True needs a block-scaled config.grad_transport_dtype "
      "('int8', 'float8_e4m3fn', 'float8_e5m2'), not '': only quantization leaves a residual "
      "to feed back. Set config.grad_transport_dtype='int8' or config.grad_error_feedback=False.",
    ),
    (
      dict(grad_error_feedback=True, grad_transport_dtype="bfloat16"),
      "config.grad_error_feedback=True needs a block-scaled config.grad_transport_dtype "
      "('int8', 'float8_e4m3fn', 'float8_e5m2'), not 'bfloat16'",
    ),
    (
      dict(grad_error_feedback=True, grad_transport_dtype="int8", grad_implementation="pallas"),
      "config.grad_error_feedback=True needs config.grad_implementation in ['auto', "
      "'shard_map'], not 'pallas', which returns no quantization residual. Set "
      "config.grad_implementation='shard_map' or config.grad_error_feedback=False.",
    ),
  ],
  ids=[
    "unknown dtype",
    "int8 on xla",
    "bfloat16 with sharded update",
    "error feedback without transport",
    "error feedback with bfloat16",
    "error feedback on pallas",
  ],
)
def test_a_transport_dtype_that_cannot_run_is_named(overrides, message):
  config = default.get_config()
  config.update(overrides)
  with pytest.raises(ValueError) as error:
    validation.validate_config(config, num_devices=8)
  assert message in str(error.value)


@pytest.mark.parametrize("dtype", ["", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"])
def test_every_transport_dtype_is_valid_on_auto(dtype):
  config = default.get_config()
  config.grad_transport_dtype = dtype
  validation.validate_config(config, num_devices=8)


@pytest.mark.parametrize("dtype", validation.BLOCK_SCALED_TRANSPORT_DTYPES)
@pytest.mark.parametrize("implementation", validation.ERROR_FEEDBACK_IMPLEMENTATIONS)
@pytest.mark.parametrize("sharded", [False, True])
def test_error_feedback_is_valid_with_every_block_scaled_transport(dtype, implementation, sharded):
  config = default.get_config()
  config.update(
    grad_transport_dtype=dtype,
    grad_error_feedback=True,
    grad_implementation=implementation,
    weight_update_sharding=sharded,
  )
  validation.validate_config(config, num_devices=8)
