"""Tuning a ResNet's gradient summation and batch norms before training (config.tune)."""

import harness
import jax
import jax.numpy as jnp
import pytest

from resnet import models, pretune, train

pytestmark = pytest.mark.usefixtures("isolated_tables")  # tests/conftest.py


def _tiny(mesh):
  model = models.create_model(
    "resnet_tiny", num_classes=10, dtype=jnp.float32, axis_name=mesh.axis_names, bn_group_size=4
  )
  variables = jax.eval_shape(
    lambda k: model.init(k, jnp.zeros((1, 16, 16, 3)), train=False), jax.random.key(0)
  )
  state = train.TrainState(
    step=0, params=variables["params"], batch_stats=variables["batch_stats"], opt_state=None
  )
  return model, state


def test_batch_norm_shapes_are_the_inputs_of_every_batch_norm():
  model, state = _tiny(harness.mesh((2, 4)))
  variables = {"params": state.params, "batch_stats": state.batch_stats}
  shapes = pretune.batch_norm_shapes(model, variables, (4, 16, 16, 3))
  # stem + 4 bottleneck blocks of 3 norms each, + one projection norm per block.
  assert len(shapes) == 1 + 4 * 4
  assert shapes[0] == ((4, 8, 8, 8), jnp.float32)  # stem: 7x7/2 conv, 8 filters
  assert shapes[-1][0] == (4, 1, 1, 256)


def test_tune_model_logs_what_each_op_got(tmp_path):
  """On the CPU only XLA runs batch norm, and the tiny gradient is below the latency
  floor: every op gets XLA without a single timed round."""

  def no_timing(name, call):
    raise AssertionError(f"{name} was timed")

  mesh = harness.mesh((2, 4))
  model, state = _tiny(mesh)
  choices = pretune.tune_model(
    model,
    state,
    mesh,
    per_replica_batch=4,
    image_size=16,
    bn_group_size=4,
    timer=no_timing,
    output=str(tmp_path / "t.json"),
  )
  assert any(op.startswith("all_reduce_gradients ResNet") for op in choices)
  variables = {"params": state.params, "batch_stats": state.batch_stats}
  distinct = set(pretune.batch_norm_shapes(model, variables, (4, 16, 16, 3)))
  assert sum(op.startswith("batch_norm float32") for op in choices) == len(distinct) == 11
  assert set(choices.values()) == {"xla"}
