"""Kernels of different communication patterns back to back, as a training step runs them.

A ResNet step on a 4x4 mesh with batch-norm group 4 sums its statistics over a 1-D ring on
``y`` between 2-D torus all-reduces of the gradients. Each kernel enters through a barrier
on its own neighbour set; kernels of different patterns must use different barrier
semaphores (collective ids), or a device can count a neighbour's entry signal meant for the
other kernel.

Two checks:

* the program -- a ring on ``y`` (the batch-norm group-sum pattern: per-channel sums of an
  activation), a ring on ``x``, the 2-D all-reduce, reduce-scatter and all-gather, back to
  back, inside ``lax.scan`` -- runs in TPU interpret mode with the race detector on and
  NaN-poisoned scratch, and matches lax exactly on integers: twice on 2x4 (this process,
  DMAs "on_wait"), so that the last kernel of one iteration meets the first of the next,
  and once on 4x4 (a 16-device subprocess, DMAs "eager"). 4x4 is the smallest torus on
  which a device's four links lead to four different devices and every ring phase has
  several steps, so the split all-reduce's per-phase capacity handshake runs for real; its
  "gradient" there is two blocks per stream with a padded tail. One iteration on 4x4
  keeps the suite's longest interpret-mode run to a couple of minutes;
* every pallas_call of that program, including those inside the scan body, carries a
  collective id that no kernel of another (kind, axes, torus) pattern uses;
* a split all-reduce of leaves (``kernels.split_leaf_kernels``: a gradient bucket in
  flight) with the blocking kernels of the step between its calls -- the batch-norm ring
  on ``y``, the 2-D all-reduce, reduce-scatter and all-gather -- runs through the
  split-call extension (``testing.split_interpret``) in both DMA modes, race detector on,
  and matches lax exactly on integers; the extension's exit checks that every semaphore a
  split call returned was waited back to zero. Its split calls carry collective ids that
  no blocking kernel uses, one per link (axis and direction).

Interpret mode does not reproduce the hazard itself: it runs each device's kernel body as
host callbacks and is not a timing model, so a device cannot reliably overtake its
neighbour by a whole kernel. The second check is what fails on the old scheme (one id per
kernel kind, whatever its axes).
"""

import os
import re
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_count_subprocess import run_as_script
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.kernels import pallas_backend
from torus_collectives.testing.split_interpret import async_interpret_mode

AXES = ("x", "y")
CHANNELS = 24  # per-channel statistics of the batch-norm group sum
LANES = 128
MARKER = "mixed patterns on 4x4 match lax"
GRADIENT_BLOCKS = tc.KernelConfig(block_rows=16)


def step(v, implementation: str, multi_block: bool):
  """One per-device "training step" mixing every communication pattern of the kernels.

  Small buffers run one-stream schedules; the "gradient" all-reduce is large enough for
  the split schedule's four streams, which use other links: a tile per stream slice, or
  with ``multi_block`` blocks of 16 rows, two per stream slice, less an odd amount
  (padding)."""
  ar = lambda u, axes, **kw: tc.all_reduce(u, axes, implementation=implementation, **kw)
  # Batch-norm group over y: per-channel sums of an (rows, CHANNELS) activation.
  stats = ar(v.reshape(-1, CHANNELS).sum(0), "y")
  ring_x = ar(v, "x")
  torus = ar(v, AXES)
  p = lax.axis_size(AXES)
  if multi_block:
    gradient = ar(jnp.resize(v, p * 4 * 2 * 16 * LANES - 333), AXES, config=GRADIENT_BLOCKS)
  else:
    gradient = ar(jnp.resize(v, p * 4 * 16 * LANES), AXES)
  shard = tc.reduce_scatter(v, AXES, tiled=True, implementation=implementation)
  gathered = tc.all_gather(shard, AXES, tiled=True, implementation=implementation)
  return jnp.concatenate([stats, ring_x, torus, gradient[-v.size :], gathered])


def program(implementation: str, iterations: int = 2, multi_block: bool = False):
  """``step`` ``iterations`` times inside ``lax.scan``: the kernels run back to back within a
  step, and the last kernel of one iteration meets the first of the next."""

  def per_device(v):
    def body(carry, _):
      out = step(carry, implementation, multi_block)
      return out[-carry.size :] % 7, out

    _, outs = lax.scan(body, v, length=iterations)
    return outs.reshape(-1)

  return per_device


def _run(mesh, x, implementation: str, iterations: int, multi_block: bool):
  fn = jax.shard_map(
    lambda v: program(implementation, iterations, multi_block)(v[0])[None],
    mesh=mesh,
    in_specs=P(AXES),
    out_specs=P(AXES),
    check_vma=False,
  )
  return jax.jit(fn)(x)


def _inputs(p: int):
  # Per device: p chunks, each a few rows of CHANNELS plus a ragged remainder.
  n = p * CHANNELS * 3
  return jnp.asarray(np.random.default_rng(1).integers(-8, 8, size=(p, n)), jnp.int32)


def run_and_compare(mesh, iterations: int, dma_mode: str, multi_block: bool) -> None:
  x = _inputs(mesh.size)
  want = _run(mesh, x, "xla", iterations, multi_block)
  got = harness.interpreted(dma_mode, _run, mesh, x, "pallas", iterations, multi_block)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _kernel_patterns(jaxpr, mesh) -> dict[int, set]:
  """collective id -> the (kernel name, streams) patterns of the pallas_calls using it:
  streams is the first dimension of the kernel's first DMA semaphore array (1 for a
  single semaphore, as a split call's)."""
  from torus_collectives.testing import aot  # kernels inside the torus primitives too

  ids: dict[int, set] = {}
  for eqn in aot.pallas_calls(jaxpr, mesh):
    cid = eqn.params["compiler_params"].collective_id
    sems = [v.aval.shape for v in eqn.params["jaxpr"].invars if "dma_sem" in str(v.aval)]
    ids.setdefault(cid, set()).add((eqn.params["name"], sems[0][0] if sems and sems[0] else 1))
  return ids


@pytest.mark.parametrize("shape", [(2, 4), (4, 4)])
def test_each_pattern_has_its_own_collective_id(shape):
  """Kernel names and their axes, against their collective ids, over the whole program.

  Tracing only (no kernel runs), so 4x4 works on an abstract mesh of 16 devices."""
  mesh = jax.sharding.AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * 2)
  p = shape[0] * shape[1]
  x = jax.ShapeDtypeStruct((p, p * CHANNELS * 3), jnp.int32)
  fn = jax.shard_map(
    lambda v: program("pallas")(v[0])[None],
    mesh=mesh,
    in_specs=P(AXES),
    out_specs=P(AXES),
    check_vma=False,
  )
  with harness.interpret_mode():
    ids = _kernel_patterns(jax.make_jaxpr(fn)(x).jaxpr, mesh)
  patterns = [pattern for group in ids.values() for pattern in group]
  # ring y, ring x, 2-D torus with one stream and 2-D torus split in four, each as a
  # reduce-scatter and an all-gather kernel.
  assert len(set(patterns)) == 8, ids
  assert all(len(group) == 1 for group in ids.values()), ids


def split_between_blocking(g, v):
  """A split all-reduce of ``g`` as a ``[rows, 128]`` leaf (four chains, as a gradient
  bucket's) with the step's blocking kernels on ``v`` between its calls, each pinned to
  the split sequence where it stands (every device issues them in one order). Returns the
  split result and the blocking kernels' results."""
  torus = [lax.axis_size(name) for name in AXES]
  split = pallas_backend.split_all_reduce_leaves([g.reshape(-1, LANES)], AXES, torus)
  ar = lambda u, over: tc.all_reduce(u, over, implementation="pallas")
  blocking = [
    lambda u: ar(u.reshape(-1, CHANNELS).sum(0), "y"),
    lambda u: ar(u, AXES),
    lambda u: tc.all_gather(
      tc.reduce_scatter(u, AXES, tiled=True, implementation="pallas"),
      AXES,
      tiled=True,
      implementation="pallas",
    ),
  ]
  results = []
  split.advance()
  for kernel in blocking:
    (u,) = split.pin([v])
    (out,) = split.pin([kernel(u)])
    results.append(out)
    split.advance()
  return split.finish_parts()[0].reshape(-1), results


def split_between_blocking_reference(g, v):
  stats = lax.psum(v.reshape(-1, CHANNELS).sum(0), "y")
  return lax.psum(g, AXES), [stats, lax.psum(v, AXES), lax.psum(v, AXES)]


def _split_inputs(p: int):
  # A [32 p, 128] leaf per device: whole tiles of 8 rows for each of p parts and 4 chains.
  g = np.random.default_rng(2).integers(-8, 8, size=(p, 4 * p * 8 * LANES))
  return jnp.asarray(g, jnp.int32), _inputs(p)


@pytest.mark.interpret
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_split_calls_between_blocking_kernels_match_lax(mode):
  mesh = harness.mesh((2, 4))
  g, v = _split_inputs(mesh.size)
  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    got = jax.block_until_ready(
      harness.per_device(split_between_blocking, mesh, g, v, check_vma=False)
    )
  # a program of its own
  want = harness.per_device(split_between_blocking_reference, mesh, g, v, check_vma=False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(got[0][0]), np.asarray(g).sum(axis=0))


def test_split_calls_and_blocking_kernels_use_distinct_ids():
  mesh = jax.sharding.AbstractMesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
  g, v = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _split_inputs(8))
  body = lambda g, v: split_between_blocking(g[0], v[0])[0][None]
  fn = jax.shard_map(
    body, mesh=mesh, in_specs=(P(AXES), P(AXES)), out_specs=P(AXES), check_vma=False
  )
  with async_interpret_mode("eager"):
    ids = _kernel_patterns(jax.make_jaxpr(fn)(g, v).jaxpr, mesh)
  # The split calls that send share their link's barrier id; a done sends nothing and
  # uses none.
  dones = ids.pop(None)
  assert all(re.fullmatch(r"async_leaf_\w+_done_\w+", name) for name, _ in dones), dones
  split_ids = {cid for cid, group in ids.items() if all(n.startswith("async_") for n, _ in group)}
  blocking_ids = {
    cid for cid, group in ids.items() if all(n.startswith("torus_") for n, _ in group)
  }
  assert split_ids and blocking_ids and split_ids | blocking_ids == set(ids), ids
  link = lambda name: re.fullmatch(r"async_leaf_[a-z_]+?(_ccw)?_(start|step)_(\w+)", name).group(
    1, 3
  )
  assert all(len({link(name) for name, _ in ids[cid]}) == 1 for cid in split_ids), ids
  blocking_pattern = lambda name: re.sub(r"_(start|step)_", "_", name)
  assert all(len({blocking_pattern(n) for n, _ in ids[cid]}) == 1 for cid in blocking_ids), ids
  # ring y and the 2-D torus, each as a reduce-scatter and an all-gather kernel; the split
  # calls' four links: x and y, in both directions.
  assert len(blocking_ids) == 4 and len(split_ids) == 4, ids


@pytest.mark.interpret
def test_mixed_patterns_on_2x4_match_lax():
  run_and_compare(harness.mesh((2, 4)), iterations=2, dma_mode="on_wait", multi_block=False)


@pytest.mark.interpret
@pytest.mark.slow
def test_mixed_patterns_on_4x4_match_lax():
  run_as_script(__file__, 16, MARKER, timeout=900)


if __name__ == "__main__":
  sys.path.insert(0, os.getcwd())
  run_and_compare(harness.mesh((4, 4)), iterations=1, dma_mode="eager", multi_block=True)
  print(MARKER)
