"""ResNet v1.5 in flax linen, with batch norm over a group of data-parallel replicas.

ResNet v1.5 (the MLPerf / torchvision variant) puts the stride-2 of a bottleneck block in
its 3x3 convolution rather than in the first 1x1. Layout is NHWC. Parameters are float32
and the forward pass runs in ``dtype`` (bfloat16 by default, as on TPUs): flax casts the
float32 kernels to ``dtype`` inside each layer, so optimizer state stays float32.

The last batch norm of each residual branch starts with scale 0, so every block begins as
the identity; this is what lets very large batches train from step 0 (Goyal et al. 2017).

The normalisation layer is the ``norm`` field: ``torus_collectives.norm.linen.BatchNorm`` by
default, whose statistics are averaged over ``bn_group_size`` consecutive replicas of
``axis_name`` (the paper's distributed batch norm); any module with flax.linen.BatchNorm's
fields fits (``flax.linen.BatchNorm`` itself, with ``bn_group_size=None``, is the usual
whole-axis baseline). With ``axis_name`` set, the model must be applied inside a
``jax.shard_map`` that binds it whenever ``train=True``.
"""

import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from torus_collectives.norm import linen as tc_nn


class BottleneckBlock(nn.Module):
  """1x1 -> 3x3 (strided) -> 1x1 with a 4x wider output; projection shortcut if needed."""

  filters: int
  strides: int
  conv: functools.partial
  norm: functools.partial

  @nn.compact
  def __call__(self, x):
    residual = x
    y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.conv(self.filters, (3, 3), (self.strides, self.strides))(y)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros)(y)
    if residual.shape != y.shape:
      residual = self.conv(
        self.filters * 4, (1, 1), (self.strides, self.strides), name="proj_conv"
      )(residual)
      residual = self.norm(name="proj_bn")(residual)
    return nn.relu(residual + y)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions (ResNet-18/34)."""

  filters: int
  strides: int
  conv: functools.partial
  norm: functools.partial

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), (self.strides, self.strides))(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros)(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), (self.strides, self.strides), name="proj_conv")(
        residual
      )
      residual = self.norm(name="proj_bn")(residual)
    return nn.relu(residual + y)


class ResNet(nn.Module):
  """ImageNet ResNet: 7x7/2 stem, 3x3/2 max pool, four stages, global average pool."""

  stage_sizes: Sequence[int]
  block_cls: type[nn.Module]
  num_classes: int
  num_filters: int = 64
  dtype: jnp.dtype = jnp.bfloat16
  axis_name: str | tuple[str, ...] | None = None
  # A flax.linen.BatchNorm-like module class (or partial). ``bn_group_size``, when set,
  # reaches it as ``group_size``; None leaves the norm's default (all of axis_name).
  norm: Callable[..., nn.Module] = tc_nn.BatchNorm
  bn_group_size: int | None = None
  bn_momentum: float = 0.9
  bn_epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x, *, train: bool):
    conv = functools.partial(
      nn.Conv,
      use_bias=False,
      dtype=self.dtype,
      kernel_init=nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
    )
    norm = functools.partial(
      self.norm,
      use_running_average=not train,
      momentum=self.bn_momentum,
      epsilon=self.bn_epsilon,
      dtype=self.dtype,
      axis_name=self.axis_name if train else None,
    )
    if self.bn_group_size is not None:  # evaluation normalises with no cross-replica group
      norm = functools.partial(norm, group_size=self.bn_group_size if train else None)
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="stem_conv")(
      x.astype(self.dtype)
    )
    x = nn.relu(norm(name="stem_bn")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for stage, num_blocks in enumerate(self.stage_sizes):
      for block in range(num_blocks):
        strides = 2 if stage > 0 and block == 0 else 1
        x = self.block_cls(self.num_filters * 2**stage, strides, conv, norm)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.normal(0.01))(x)
    return x.astype(jnp.float32)


ARCHITECTURES = {
  "resnet18": dict(stage_sizes=(2, 2, 2, 2), block_cls=BasicBlock),
  "resnet34": dict(stage_sizes=(3, 4, 6, 3), block_cls=BasicBlock),
  "resnet50": dict(stage_sizes=(3, 4, 6, 3), block_cls=BottleneckBlock),
  # Four one-block stages of width 8: every code path of ResNet-50 in a few thousand
  # parameters, for tests.
  "resnet_tiny": dict(stage_sizes=(1, 1, 1, 1), block_cls=BottleneckBlock, num_filters=8),
}


def create_model(name: str, **kwargs) -> ResNet:
  """Builds the named architecture; ``kwargs`` are the remaining ResNet fields."""
  if name not in ARCHITECTURES:
    raise ValueError(f"Unknown model {name=}; choose one of {sorted(ARCHITECTURES)}.")
  return ResNet(**ARCHITECTURES[name], **kwargs)
