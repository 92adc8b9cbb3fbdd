"""From devices to a torus mesh of one, two or three axes.

The torus algorithms assume that mesh neighbours along each named axis are physical
neighbours, so that every ring step crosses one link. On TPU, devices expose ``coords``
(the chip's position in the slice's 3-D torus, or 2-D with a trailing 0) and
``core_on_chip``:

* when the requested shape is the slice's physical shape (size-1 physical dimensions left
  out; on chips that expose two devices, such as v4 without megacore, the two cores of a
  chip sit next to each other along the last axis), every device is placed at its own
  coordinates, so a mesh neighbour is a physical neighbour along every axis. This is how a
  v4 or v5p slice becomes a 3-D mesh that uses all six links of a chip;
* otherwise ``jax.experimental.mesh_utils.create_device_mesh`` orders them (it also handles,
  for instance, a 2-D mesh over a 3-D slice).

The wrap-around link of an axis exists only where the slice spans the whole torus
dimension (on v4 and v5p, slices whose dimensions are multiples of 4); on smaller slices the
ring's closing hop is routed back across the axis. Twisted-torus slices (v4, v5p) wire the
wrap-around links with an offset; rings along an axis still follow the mesh. Elsewhere (CPU,
GPU) device order is all there is, and the mesh is filled row-major.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# The torus implementations run on tori of at most this many named mesh axes (TPU v4 and
# v5p are 3-D tori).
MAX_TORUS_AXES = 3


def most_square_shape(num_devices: int) -> tuple[int, int]:
  """The most square ``X x Y`` factorisation of ``num_devices`` with ``X <= Y``."""
  if num_devices < 1:
    raise ValueError(f"{num_devices=} must be positive")
  x = max(d for d in range(1, math.isqrt(num_devices) + 1) if num_devices % d == 0)
  return x, num_devices // x


def physical_grid(shape: Sequence[int], devices: Sequence[jax.Device]) -> np.ndarray | None:
  """``devices`` placed at their chip coordinates, if ``shape`` is their physical shape.

  The physical shape is the bounding box of the devices' ``coords`` without its size-1
  dimensions, with the last dimension multiplied by the devices per chip (the cores of a
  chip are consecutive along it). Returns None when the shapes differ or the devices do
  not fill the box.
  """
  coords = np.array([d.coords for d in devices], dtype=np.int64)
  cores = np.array([getattr(d, "core_on_chip", 0) for d in devices], dtype=np.int64)
  coords -= coords.min(axis=0)
  kept = [a for a in range(coords.shape[1]) if coords[:, a].max() > 0]
  coords = coords[:, kept]
  per_chip = int(cores.max()) + 1
  if not kept:  # one chip
    coords = np.zeros((len(devices), 1), dtype=np.int64)
  coords[:, -1] = coords[:, -1] * per_chip + cores
  if tuple(coords.max(axis=0) + 1) != tuple(shape):
    return None
  grid = np.full(tuple(shape), None, dtype=object)
  for device, index in zip(devices, map(tuple, coords)):
    if grid[index] is not None:
      return None
    grid[index] = device
  return grid


def make_torus_mesh(
  shape: Sequence[int],
  axis_names: Sequence[str] = ("x", "y"),
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A mesh of ``shape`` over ``devices`` whose mesh neighbours are physical neighbours.

  On TPU, where ``shape`` is the slice's physical shape (size-one dimensions left out),
  every device sits at its chip coordinates, so each ring step of the torus collectives
  crosses one link; for other shapes ``jax.experimental.mesh_utils.create_device_mesh``
  orders the devices. Devices without coordinates (CPU, GPU) fill the mesh in the order
  given, row-major. The axes are ``Auto`` (not ``Explicit``, ``jax.make_mesh``'s
  default), so the mesh works with ``jax.shard_map`` without sharding boilerplate.

  Args:
    shape: one, two or three axis sizes, e.g. ``(2, 4)`` for an X x Y torus; their
      product must be the number of devices.
    axis_names: one distinct name per axis (default ``("x", "y")``; ``("x", "y", "z")``
      for a 3-D torus). Pass them to the collectives as ``axis_name``.
    devices: the devices to lay out (default: ``jax.devices()``, all of them).

  Returns:
    A ``jax.sharding.Mesh`` of ``shape`` with axes ``axis_names``, all ``AxisType.Auto``.

  Raises:
    ValueError: ``shape`` and ``axis_names`` of different lengths, an axis of size below
      one, fewer than one or more than three axes, repeated axis names, or a product of
      ``shape`` that is not the number of devices (pick a shape whose product is the
      device count).
  """
  shape = tuple(int(n) for n in shape)
  axis_names = tuple(axis_names)
  if len(shape) != len(axis_names):
    raise ValueError(f"{shape=} and {axis_names=} must have the same length")
  if any(n < 1 for n in shape):
    raise ValueError(f"{shape=}: every mesh axis needs at least one device")
  if not 1 <= len(shape) <= MAX_TORUS_AXES:
    raise ValueError(f"a torus mesh has 1 to {MAX_TORUS_AXES} axes, got {shape=}")
  if len(set(axis_names)) != len(axis_names):
    raise ValueError(f"axis names must be distinct, got {axis_names=}")
  devices = list(jax.devices() if devices is None else devices)
  if int(np.prod(shape)) != len(devices):
    raise ValueError(
      f"{shape=} needs {int(np.prod(shape))} devices but {len(devices)} were given; "
      "pick a shape whose product is the device count"
    )
  if hasattr(devices[0], "coords"):
    grid = physical_grid(shape, devices)
    if grid is None:
      grid = mesh_utils.create_device_mesh(shape, devices=devices)
  else:
    grid = np.array(devices, dtype=object).reshape(shape)
  return Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(shape))
