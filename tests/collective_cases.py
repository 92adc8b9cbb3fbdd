"""Shared helpers for running collectives per device on simulated CPU meshes."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import torus_collectives as tc

MESHES = {
  "2x4": (2, 4),
  "4x2": (4, 2),
  "1x8": (1, 8),
  "8x1": (8, 1),
  "2x2": (2, 2),
  "2x2x2": (2, 2, 2),
  "2x2x4": (2, 2, 4),  # 16 devices: subprocess tests only
}


def mesh_of(name: str):
  shape = MESHES[name]
  axis_names = ("x", "y", "z")[: len(shape)]
  return tc.make_torus_mesh(shape, axis_names, devices=jax.devices()[: math.prod(shape)])


def sharded(fn, mesh, check_vma=True):
  """Jitted ``fn`` on device-local slices: inputs have a leading axis of one entry per
  device (row-major over the mesh); outputs come back the same way."""
  everything = P(tuple(mesh.axis_names))

  def body(*local):
    outs = fn(*jax.tree.map(lambda v: v[0], local))
    return jax.tree.map(lambda o: o[None], outs)

  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=everything, out_specs=everything, check_vma=check_vma)
  )


def per_device(fn, mesh, *inputs, check_vma=True):
  """Runs ``fn`` once on device-local slices (see ``sharded``)."""
  return sharded(fn, mesh, check_vma)(*inputs)


def small_integers(shape, dtype, seed=0):
  """Values in [-4, 4]: every partial sum of up to 16 of them is exact in bf16 and f32."""
  return np.random.default_rng(seed).integers(-4, 5, size=shape).astype(dtype)
