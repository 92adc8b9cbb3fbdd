"""Gradient transport in the ResNet example: ``config.grad_transport_dtype`` reaches the
gradient summation, int8 block-scaled transport trains like bfloat16 transport over a few
steps from the same seed, and the config names a bad transport dtype (or one that the
configured implementation or optimizer cannot carry) before anything is built."""

import itertools

import jax
import numpy as np
import pytest
import test_resnet_train as resnet_train

from resnet import train, validation
from resnet.configs import default
from torus_collectives import quantization

STEPS = 4  # the tiny config's warmup is 2 steps; it must be shorter than the run
data_dir = resnet_train.data_dir  # the digits, shared with the end-to-end tests' fixture


def _train(config):
  """``STEPS`` steps of ``config`` from its seed: the losses, the change of every
  parameter from its initial value, and the train step's lowered text."""
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
  final = jax.device_get(program.layout.to_stored(state).params)
  return losses, jax.tree.map(np.subtract, final, initial), lowered


@pytest.fixture(scope="module")
def runs(data_dir):
  """{transport dtype: ``_train``'s result} for bfloat16 and int8, same seed and batches."""
  return {
    dtype: _train(
      resnet_train.tiny_config(data_dir, num_train_steps=STEPS, grad_transport_dtype=dtype)
    )
    for dtype in ("bfloat16", "int8")
  }


def _norm(tree) -> float:
  return float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))


@pytest.mark.slow
def test_int8_transport_is_block_scaled_and_its_losses_finite(runs):
  """int8 travels as int8 (a collective permute of s8 values in the lowered step), and
  step 1's loss, computed before any gradient travels, is the bfloat16 run's exactly."""
  (bf16_losses, _, bf16_text), (int8_losses, _, int8_text) = runs["bfloat16"], runs["int8"]
  assert np.all(np.isfinite(bf16_losses)) and np.all(np.isfinite(int8_losses))
  assert int8_losses[0] == bf16_losses[0]
  assert any("collective_permute" in line and "i8" in line for line in int8_text.splitlines())
  assert not any("collective_permute" in line and "i8" in line for line in bf16_text.splitlines())


@pytest.mark.slow
def test_int8_parameters_stay_within_the_quantization_error_of_bf16(runs):
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
  Rounding errors of random sign keep the measured difference near 2.6%.
  """
  fmt = quantization.BlockScaled("int8")
  hops = (2 - 1) + (4 - 1) + 1
  tolerance = 3 * 2 * hops * fmt.delta
  (bf16_losses, bf16_delta, _), (int8_losses, int8_delta, _) = runs["bfloat16"], runs["int8"]
  difference = _norm(jax.tree.map(np.subtract, int8_delta, bf16_delta)) / _norm(bf16_delta)
  assert 0 < difference <= tolerance, (difference, tolerance)
  bf16_changes = np.subtract(bf16_losses[1:], bf16_losses[0])
  np.testing.assert_allclose(
    np.subtract(int8_losses[1:], int8_losses[0]),
    bf16_changes,
    rtol=0,
    atol=tolerance * np.max(np.abs(bf16_changes)),
  )


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
  ],
  ids=["unknown dtype", "int8 on xla", "bfloat16 with sharded update"],
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
