"""Every config field is checked before anything is built: one bad value per rule, each
error naming the field and its valid range. train_and_evaluate raises before it creates
the workdir; the two checks that need the data come before anything compiles."""

import math
import os
import subprocess
import sys

import pytest

from resnet import data_sources, train, validation
from resnet.configs import default
from torus_collectives import registry

# (field, bad value, part of the message). Fields whose type already admits no bad value
# (booleans, data_dir, num_train_steps) are absent: ml_collections keeps each field's type.
BAD_VALUES = [
  ("simulated_cpu_devices", -1, "an integer >= 0"),
  ("mesh_shape", (2, 2, 2, 1), "one, two or three positive integers"),
  ("mesh_shape", (4, 4), "must multiply to the 8 devices"),
  ("mesh_shape", (2, 2, 4), "must multiply to the 8 devices"),
  ("dataset", "mnist", "'digits', 'imagenet2012' or 'folder:<root>'"),
  ("train_split", "", "a non-empty string"),
  ("eval_split", "", "a non-empty string"),
  ("image_size", 0, "an integer >= 1"),
  ("crop_area_range", (0.5, 0.2), "a pair (low, high) with 0 < low <= high <= 1"),
  ("eval_crop_fraction", 1.5, "a finite number in (0, 1]"),
  ("shuffle_buffer", -1, "an integer >= 0"),
  ("prefetch_to_device", 0, "an integer >= 1"),
  ("model", "resnet51", "must be one of ['resnet18', 'resnet34', 'resnet50', 'resnet_tiny']"),
  ("dtype", "int8", "one of 'float32', 'bfloat16', 'float16'"),
  ("bn_momentum", 1.5, "a finite number in [0, 1]"),
  ("bn_span_examples", 0, "an integer >= 1"),
  ("bn_group_size", -1, "an integer >= 0"),
  ("bn_group_size", 3, "must be 0 or divide the 8 devices"),
  ("global_batch_size", -32, "a positive multiple of the device count"),
  ("global_batch_size", 36, "must be a positive multiple of the 8 devices"),
  ("eval_batch_size", 0, "a positive multiple of the device count"),
  ("num_epochs", 0.0, "a finite number in (0, inf)"),
  ("warmup_epochs", -1.0, "a finite number in [0, inf)"),
  ("base_learning_rate", math.nan, "a finite number in (0, inf)"),
  ("end_learning_rate", -1e-4, "a finite number in [0, inf)"),
  ("lr_decay_power", -1.0, "a finite number in [0, inf)"),
  ("weight_decay", -1.0, "a finite number in [0, inf)"),
  ("momentum", 1.0, "a finite number in [0, 1)"),
  ("lars_trust_coefficient", 0.0, "a finite number in (0, inf)"),
  ("lars_eps", -1.0, "a finite number in [0, inf)"),
  ("label_smoothing", 1.0, "a finite number in [0, 1)"),
  ("grad_implementation", "nccl", "must be one of ['auto', 'xla', 'shard_map', 'lax_torus'"),
  ("seed", -1, "an integer in [0, 2**30)"),
  ("log_every_steps", 0, "an integer >= 1"),
  ("eval_every_epochs", 0.0, "a finite number in (0, inf)"),
  ("checkpoint_every_steps", 0, "an integer >= 1"),
  ("heartbeat_timeout_seconds", 1, "an integer >= 2"),
  ("stop_timeout_seconds", 0.0, "a finite number in (0, inf)"),
]


def test_every_config_field_has_a_rule():
  assert set(default.get_config().keys()) == set(validation.RULES)


@pytest.mark.parametrize(
  "field, value, valid", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES]
)
def test_bad_value_is_named_with_its_range_before_anything_is_built(field, value, valid, tmp_path):
  config = default.get_config()
  config[field] = value
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"Invalid config:\n") as error:
    train.train_and_evaluate(config, str(workdir))
  message = str(error.value)
  assert f"config.{field}={value!r}" in message or f"config.{field}={value}" in message, message
  assert valid in message
  assert not workdir.exists()


@pytest.mark.parametrize("shape", [(), (8,), (2, 4), (2, 2, 2)])
def test_torus_meshes_of_one_to_three_axes_are_valid(shape):
  config = default.get_config()
  config.mesh_shape = shape
  validation.validate_config(config, num_devices=8)


def test_the_mesh_axis_limit_is_the_librarys():
  assert validation.MAX_MESH_AXES == registry.MAX_TORUS_AXES


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("data")
  data_sources.write_digits(root / "digits")
  return root


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(global_batch_size=2048), "config.global_batch_size=2048 must be at most the 1438"),
    (
      dict(num_train_steps=4, warmup_epochs=5.0),
      "config.warmup_epochs=5.0 is 110 steps; it must be shorter than the 4 training steps",
    ),
  ],
  ids=["batch larger than the dataset", "warmup longer than the run"],
)
def test_data_dependent_checks_name_the_field(overrides, message, data_dir, tmp_path):
  config = default.get_config()
  config.update(data_dir=str(data_dir), **overrides)
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, str(tmp_path))


def test_command_line_reports_config_errors_without_a_traceback(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "resnet",
      "--config=resnet/configs/default.py",
      f"--workdir={tmp_path / 'run'}",
      "--config.checkpoint_every_steps=0",
      "--config.global_batch_size=-32",
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert result.returncode == 2
  assert "config.checkpoint_every_steps=0 is invalid; it must be an integer >= 1." in result.stderr
  assert "config.global_batch_size=-32 is invalid" in result.stderr
  assert "Traceback" not in result.stderr
