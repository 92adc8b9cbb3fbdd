"""From devices to a 2-D torus mesh.

The torus algorithms assume that mesh neighbours along each named axis are physical
neighbours, so that every ring step crosses one link. On TPU, devices expose ``coords``
(and ``core_on_chip``); ``jax.experimental.mesh_utils.create_device_mesh`` already orders
them so that this holds, including the wrap-around links of a torus slice. Elsewhere
(CPU, GPU) device order is all there is, and the mesh is filled row-major.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh


def most_square_shape(num_devices: int) -> tuple[int, int]:
  """The most square ``X x Y`` factorisation of ``num_devices`` with ``X <= Y``."""
  if num_devices < 1:
    raise ValueError(f"{num_devices=} must be positive")
  x = max(d for d in range(1, math.isqrt(num_devices) + 1) if num_devices % d == 0)
  return x, num_devices // x


def make_torus_mesh(
  shape: Sequence[int],
  axis_names: Sequence[str] = ("x", "y"),
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A mesh of ``shape`` over ``devices`` (default: all) whose neighbours are physical.

  The axes are ``Auto`` (not ``Explicit``), so the mesh works with ``jax.shard_map``
  without sharding boilerplate in the caller.
  """
  shape = tuple(int(n) for n in shape)
  axis_names = tuple(axis_names)
  if len(shape) != len(axis_names):
    raise ValueError(f"{shape=} and {axis_names=} must have the same length")
  if any(n < 1 for n in shape):
    raise ValueError(f"{shape=}: every mesh axis needs at least one device")
  if len(shape) not in (1, 2):
    raise ValueError(f"a torus mesh has 1 or 2 axes, got {shape=}")
  if len(set(axis_names)) != len(axis_names):
    raise ValueError(f"axis names must be distinct, got {axis_names=}")
  devices = list(jax.devices() if devices is None else devices)
  if int(np.prod(shape)) != len(devices):
    raise ValueError(
      f"{shape=} needs {int(np.prod(shape))} devices but {len(devices)} were given; "
      "pick a shape whose product is the device count"
    )
  if hasattr(devices[0], "coords"):
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  else:
    grid = np.array(devices, dtype=object).reshape(shape)
  return Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(shape))
