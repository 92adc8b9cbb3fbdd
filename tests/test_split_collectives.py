"""Torus collectives as chains of split ring phases (``kernels/split_collectives.py``).

In TPU interpret mode through the split-call extension (``testing.split_interpret``), race detector
on, both DMA execution modes, on small integers (exact in float32 and bfloat16 at these
sums): the split all-reduce, reduce-scatter and all-gather over every axis of a 2x4 and a
2x2x2 mesh (and 4x4, in a subprocess with 16 devices) equal ``lax.psum``,
``lax.psum_scatter(tiled=True)`` and ``lax.all_gather(tiled=True)``, with a jnp
computation pinned between every two calls (its results checked too), in one stream and
in the split torus variant's 2N (whose reduce-scatter and all-gather lay each chunk's
slices out in every stream's rotated order and back); two all-reduces
advanced alternately, both in flight at once, equal theirs. The call sequence follows the
torus schedule's phase order, and a buffer that does not split into whole DMA words is
refused before any call.
"""

import os
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_count_subprocess import run_as_script
from jax import lax
from jax.sharding import PartitionSpec as P

from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import split_collectives
from torus_collectives.testing.split_interpret import async_interpret_mode

pytestmark = pytest.mark.timeout(300, method="thread")

MESHES = {"2x4": ((2, 4), ("x", "y")), "2x2x2": ((2, 2, 2), ("x", "y", "z"))}
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
MARKER = "split collectives on 4x4 match lax"


def _run_all_three(mesh, x, mode, variant="torus"):
  """The three split collectives of each device's row of ``x`` over all mesh axes (the
  all-reduce with ``2 v + i`` pinned after call ``i``), and their ``lax`` references."""
  names = mesh.axis_names
  axes = [(name, mesh.shape[name]) for name in names]

  def body(v):
    reduced, hooks = split_collectives.run(
      "all_reduce", v, axes, names, between=lambda i, v: 2 * v + i, operands=(v,), variant=variant
    )
    # The chains share barrier semaphores (one per pattern and axis), so every device must
    # issue their calls in one order; data dependencies fix it (interpret mode runs
    # independent calls of one device concurrently, a TPU one after another).
    _, v = lax.optimization_barrier((reduced, v))
    scattered = split_collectives.run("reduce_scatter", v, axes, names, variant=variant)
    gathered = split_collectives.run("all_gather", scattered, axes, names, variant=variant)
    return (reduced, scattered, gathered), jnp.stack(hooks)

  def references(v):  # a program of its own (see test_split_rings._phase_and_compute)
    scattered = lax.psum_scatter(v, names, tiled=True)
    return lax.psum(v, names), scattered, lax.all_gather(scattered, names, tiled=True)

  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    results, hooks = jax.block_until_ready(harness.per_device(body, mesh, x))
  return results, hooks, harness.per_device(references, mesh, x)


def _check_all_three(mesh, dtype, mode, elements_per_device=8 * 256, variant="torus"):
  devices = mesh.devices.size
  x = harness.small_integers((devices, elements_per_device), np.float32, seed=5).astype(dtype)
  results, hooks, references = _run_all_three(mesh, x, mode, variant)
  for result, reference in zip(results, references):
    assert result.dtype == x.dtype
    np.testing.assert_array_equal(result, reference)
  total = np.asarray(x, np.float64).sum(axis=0)
  np.testing.assert_array_equal(np.asarray(results[0], np.float64), np.broadcast_to(total, x.shape))
  chunk = elements_per_device // devices
  for d in range(devices):  # device d holds chunk d (row-major over the mesh) of the sum
    np.testing.assert_array_equal(
      np.asarray(results[1][d], np.float64), total[d * chunk : (d + 1) * chunk]
    )
  calls = sum(2 * n for n in mesh.shape.values())
  expected_hooks = [2 * np.asarray(x, np.float64) + i for i in range(calls - 1)]
  np.testing.assert_array_equal(np.asarray(hooks, np.float64), np.stack(expected_hooks, axis=1))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(MESHES))
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_split_collectives_match_lax(mode, case, dtype):
  _check_all_three(harness.mesh(*MESHES[case]), DTYPES[dtype], mode)


SPLIT_CASES = [  # every mesh once; both DMA modes and both dtypes among them
  ("eager", "2x4", "float32"),
  ("on_wait", "2x2x2", "float32"),
  ("eager", "8", "bfloat16"),
]


@pytest.mark.interpret
@pytest.mark.parametrize("mode, case, dtype", SPLIT_CASES, ids=["-".join(c) for c in SPLIT_CASES])
def test_split_torus_variant_matches_lax(mode, case, dtype):
  """The 2N-stream all-reduce, reduce-scatter and all-gather (each stream rotated over the
  axes, in both directions; the last two with every chunk's slices laid out in each
  stream's rotated order): on 2x4 four streams, on 2x2x2 six, on a ring of 8 two (the
  bidirectional ring)."""
  mesh = harness.mesh((8,), ("x",)) if case == "8" else harness.mesh(*MESHES[case])
  streams = split_collectives.stream_count("all_reduce", mesh.shape.items(), "torus_split")
  assert streams == 2 * len(mesh.axis_names)
  _check_all_three(mesh, DTYPES[dtype], mode, streams * 8 * 256, variant="torus_split")


def test_split_torus_streams_follow_the_schedule():
  """The streams' phases are those of ``schedule.build("all_reduce", torus, "torus_split")``,
  one part of the buffer each; the rotated row orders invert each other."""
  axes = [("x", 2), ("y", 4)]
  expected = [
    [(p.kind, axes[p.axis][0], p.direction) for p in stream]
    for stream in schedule_lib.build("all_reduce", (2, 4), "torus_split").streams
  ]
  streams = split_collectives._stream_phases("all_reduce", axes, "torus_split")
  assert sorted([(kind, name, d) for kind, name, _, d in s] for s in streams) == sorted(expected)
  grid = jnp.arange(24 * 3).reshape(24, 3)
  sizes = (2, 3, 4)
  for r in range(3):
    rotated = split_collectives._to_rotated(grid, sizes, r)
    np.testing.assert_array_equal(split_collectives._from_rotated(rotated, sizes, r), grid)
  # Rotated by 1 (axes y, z, x): device (i, j, k) at row (j * 4 + k) * 2 + i.
  rotated = split_collectives._to_rotated(grid, sizes, 1)
  i, j, k = 1, 2, 3
  np.testing.assert_array_equal(rotated[(j * 4 + k) * 2 + i], grid[(i * 3 + j) * 4 + k])


@pytest.mark.interpret
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_two_all_reduces_in_flight_at_once(mode):
  """Two buckets of different sizes, advanced alternately (a call of one, a matmul, a call
  of the other), both started before either finishes: each equals its ``lax.psum``."""
  mesh = harness.mesh((2, 4), ("x", "y"))
  axes = [("x", 2), ("y", 4)]
  a = harness.small_integers((8, 8 * 128), np.int32, seed=6)
  b = harness.small_integers((8, 3 * 8 * 128), np.float32, seed=7)
  w = harness.small_integers((8, 128, 128), np.float32, seed=8)

  def body(a, b, w):
    first = split_collectives.SplitCollective("all_reduce", a, axes, ("x", "y"))
    second = split_collectives.SplitCollective("all_reduce", b, axes, ("x", "y"))
    assert first.calls_left == second.calls_left == 12
    products = []
    first.advance()
    while second.calls_left:
      second.advance()
      w_ready = second.pin(first.pin(w))
      product = w_ready @ w_ready.T
      products.append(first.pin(second.pin(product)))
      if first.calls_left:
        first.advance()
    return first.finish(), second.finish()

  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    first, second = jax.block_until_ready(harness.per_device(body, mesh, a, b, w))
  first_ref, second_ref = harness.per_device(
    lambda a, b: (lax.psum(a, ("x", "y")), lax.psum(b, ("x", "y"))), mesh, a, b
  )
  np.testing.assert_array_equal(first, first_ref)
  np.testing.assert_array_equal(second, second_ref)
  np.testing.assert_array_equal(first[0], a.sum(axis=0))


def test_calls_follow_the_torus_schedule():
  """Phases in the order of ``schedule.build(kind, torus, "torus")``'s stream, each a start,
  ``n - 2`` steps and a done on its axis; size-1 axes contribute nothing."""
  mesh = harness.mesh((2, 4), ("x", "y"))
  torus_axes = [("x", 2), ("y", 4)]
  for collective in ("all_reduce", "reduce_scatter", "all_gather"):
    (stream,) = schedule_lib.build(collective, (2, 4), "torus").streams
    expected = []
    for phase in stream:
      name, n = torus_axes[phase.axis]
      prefix = f"async_{phase.kind}"
      expected += [f"{prefix}_start_{name}"] + [f"{prefix}_step_{name}"] * (n - 2)
      expected += [f"{prefix}_done_{name}"]
    length = 8 * 256 if collective != "all_gather" else 256

    def body(v, collective=collective):
      axes = [("x", 2), ("unit", 1), ("y", 4)]
      return split_collectives.run(collective, v[0], axes, ("x", "y"))[None]

    fn = jax.shard_map(
      body, mesh=mesh, in_specs=P(("x", "y")), out_specs=P(("x", "y")), check_vma=False
    )
    jaxpr = jax.make_jaxpr(fn)(jnp.zeros((8, length), jnp.float32))
    names = [e.params["name"] for e in harness.pallas_calls(jaxpr.jaxpr)]
    assert names == expected, collective


def test_padded_elements_and_refusals():
  assert split_collectives.padded_elements(1, (2, 4), 4) == 8 * 128
  assert split_collectives.padded_elements(8 * 128, (2, 4), 4) == 8 * 128
  assert split_collectives.padded_elements(8 * 256 + 1, (2, 4), 2) == 2 * 8 * 256
  axes = [("x", 2), ("y", 4)]
  with pytest.raises(ValueError, match="multiple of 1024 elements"):
    split_collectives.SplitCollective("all_reduce", jnp.zeros((1000,)), axes, ("x", "y"))
  with pytest.raises(ValueError, match="multiple of 2048 elements"):
    split_collectives.SplitCollective(
      "reduce_scatter", jnp.zeros((1024,), jnp.bfloat16), axes, ("x", "y")
    )
  with pytest.raises(ValueError, match="1-D buffer"):
    split_collectives.SplitCollective("all_reduce", jnp.zeros((8, 128)), axes, ("x", "y"))
  with pytest.raises(ValueError, match="not one of"):
    split_collectives.SplitCollective("all_reduce", jnp.zeros((1024,)), axes, ("x",))
  done = split_collectives.SplitCollective("all_gather", jnp.zeros((128,)), [("x", 1)], ("x",))
  assert done.calls_left == 0
  with pytest.raises(ValueError, match="issued all its calls"):
    done.advance()


@pytest.mark.interpret
@pytest.mark.timeout(900, method="thread")
def test_split_collectives_on_4x4_in_a_subprocess():
  run_as_script(__file__, 16, MARKER, timeout=900)


if __name__ == "__main__":
  sys.path.insert(0, os.getcwd())
  _check_all_three(harness.mesh((4, 4), ("x", "y")), np.float32, "eager", 16 * 256)
  _check_all_three(harness.mesh((4, 4), ("x", "y")), jnp.bfloat16, "on_wait", 16 * 256)
  _check_all_three(
    harness.mesh((4, 4), ("x", "y")), np.float32, "eager", 4 * 16 * 256, "torus_split"
  )
  print(MARKER)
