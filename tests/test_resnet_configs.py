"""Config arithmetic: the MLPerf LARS table, BN group spans, torus shapes."""

import pytest

from resnet import train
from resnet.configs import default, imagenet, pod
from torus_collectives.topology import most_square_shape


@pytest.mark.parametrize(
  "batch, peak, warmup", [(4096, 5.0, 5), (8192, 10.0, 5), (16384, 25.0, 5), (32768, 32.0, 14)]
)
def test_imagenet_peak_learning_rate_follows_the_table(batch, peak, warmup):
  config = imagenet.get_config(global_batch=batch)
  assert config.base_learning_rate * batch / 256 == pytest.approx(peak)
  assert config.warmup_epochs == warmup


def test_pod_config_is_a_32x32_torus_with_bn_over_64_examples():
  config = pod.get_config()
  assert tuple(config.mesh_shape) == (32, 32)
  per_device = config.global_batch_size // 1024
  assert train.replicas_per_bn_group(config.bn_span_examples, per_device, 1024) * per_device == 64


@pytest.mark.parametrize(
  "span, per_replica, replicas, group",
  [(64, 8, 8, 8), (64, 16, 8, 4), (64, 32, 1024, 2), (64, 128, 8, 1), (64, 12, 6, 3)],
)
def test_replicas_per_bn_group(span, per_replica, replicas, group):
  assert train.replicas_per_bn_group(span, per_replica, replicas) == group


@pytest.mark.parametrize(
  "devices, shape", [(8, (2, 4)), (1024, (32, 32)), (6, (2, 3)), (7, (1, 7))]
)
def test_default_torus_shape_is_most_square(devices, shape):
  assert most_square_shape(devices) == shape


def test_default_runs_digits_on_a_2x4_torus():
  config = default.get_config()
  assert (config.dataset, tuple(config.mesh_shape), config.simulated_cpu_devices) == (
    "digits",
    (2, 4),
    8,
  )
