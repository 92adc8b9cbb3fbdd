"""The leaf kernels' all-reduce as chains of split calls (``kernels/split_leaf_kernels.py``).

In TPU interpret mode through the split-call extension (``testing.split_interpret``), race
detector on, both DMA execution modes: ``pallas_backend.split_all_reduce_leaves`` of a
bucket of leaves in their own shapes (convolution kernels, a dense kernel taken
transposed, a vector and a stem kernel moved whole, a scalar packed) equals ``lax.psum``
of each leaf bitwise on small integers, with a jnp computation pinned between every two
calls (its results checked too), on a 2-D torus (four chains, one per link) and a 3-D
one (six), in float32 and bfloat16. Leaves with fewer tiles than parts (and whole leaves)
receive nothing on some devices, which the extension must keep in step. Pure: each chain
runs the reduce-scatter's hops of its stream then the all-gather's, in a few kernels per
phase, and the traffic the calls declare is the schedule's.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from torus_collectives.kernels import leaf_grid, pallas_backend, split_leaf_kernels
from torus_collectives.testing.split_interpret import async_interpret_mode

pytestmark = pytest.mark.timeout(300, method="thread")

SHAPES = [(3, 3, 16, 16), (1, 1, 128, 40), (16, 1000), (16,), (7, 7, 3, 8), ()]
CASES = [("eager", (2, 4), "float32"), ("on_wait", (2, 2, 2), "bfloat16")]


@pytest.mark.interpret
@pytest.mark.parametrize("mode, shape, dtype", CASES, ids=["eager-2x4-f32", "on_wait-2x2x2-bf16"])
def test_split_leaf_all_reduce_matches_psum(mode, shape, dtype):
  mesh = harness.mesh(shape)
  axes, p = mesh.axis_names, mesh.size
  torus = tuple(mesh.shape[a] for a in axes)
  dtype = jnp.dtype(dtype)
  leaves = [
    harness.small_integers((p, *s), np.float32, seed=i).astype(dtype) for i, s in enumerate(SHAPES)
  ]
  h = harness.small_integers((p, 8, 128), np.float32, seed=9)

  def body(h, *leaves):
    split = pallas_backend.split_all_reduce_leaves(list(leaves), axes, torus)
    calls = split.calls_left
    hooks = []
    while split.calls_left:
      split.advance()
      (h,) = split.pin([2 * h + 1])
      hooks.append(h)
    return split.finish_parts(), jnp.stack(hooks), jnp.int32(calls)[None]

  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    got, hooks, calls = jax.block_until_ready(
      harness.per_device(body, mesh, h, *leaves, check_vma=False)
    )
  want = harness.per_device(lambda *ls: [lax.psum(v, axes) for v in ls], mesh, *leaves)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  hops = 2 * sum(n - 1 for n in torus)  # every stream visits every axis twice
  assert (np.asarray(calls) == hops + 1).all()
  expected = h.astype(np.float64)
  for i in range(hops + 1):
    expected = 2 * expected + 1
    np.testing.assert_array_equal(np.asarray(hooks)[:, i], expected)


def _chains(torus, shapes, itemsize=4):
  reduce, gather = leaf_grid.all_reduce_grids(shapes, itemsize, torus)
  names = ("x", "y", "z")[: len(torus)]
  return [
    split_leaf_kernels._Chain(reduce, gather, s, names, names)
    for s in range(reduce.schedule.num_streams)
  ]


@pytest.mark.parametrize("torus", [(16, 16), (2, 4), (8,), (4, 4, 4)])
def test_each_chain_is_its_streams_hops_in_few_kernels(torus):
  """A chain: its stream's reduce-scatter transfers, then its all-gather transfers; one
  call per hop and a done, whose kernels are one per boundary between phases (the start
  and the done among them) and one per phase of more than one hop: on 16x16 nine for 61
  calls."""
  for chain in _chains(torus, [(8 * 40, 128), (3, 3, 64, 128)]):
    reduce, gather = (
      g.schedule.stream_transfers(chain.stream) for g in (chain.reduce, chain.gather)
    )
    assert [tr for _, tr, _ in chain.hops] == [*reduce, *gather]
    calls = [split_leaf_kernels._Call.of(chain, k) for k in range(len(chain.hops) + 1)]
    hops_per_phase = [n - 1 for n in torus] * 2
    interiors = sum(1 for hops in hops_per_phase if hops > 1)
    assert len(set(calls)) == len(hops_per_phase) + 1 + interiors
    names = [call.name for call in calls]
    assert names[0].startswith("async_leaf_reduce_scatter") and "_start_" in names[0]
    assert names[-1].startswith("async_leaf_all_gather") and "_done_" in names[-1]


@pytest.mark.parametrize("torus", [(16, 16), (2, 4), (8,)])
def test_declared_traffic_is_the_schedules(torus):
  """The calls' ``remote_bytes_transferred`` over every chain: what a device sends on
  average in the reduce-scatter and the all-gather of the bucket (``bytes_sent_per_device``);
  each reduce-scatter hop's adds are declared by the next call."""
  shapes = [(8 * 300, 128), (3, 3, 64, 128), (1, 1, 8, 256)]
  chains = _chains(torus, shapes)
  total = sum(np.prod(s) for s in shapes) * 4
  costs = [split_leaf_kernels._cost(c, k) for c in chains for k in range(len(c.hops) + 1)]
  sent = sum(cost.remote_bytes_transferred for cost in costs)
  schedules = [chains[0].reduce.schedule, chains[0].gather.schedule]
  expected = sum(s.bytes_sent_per_device(total) for s in schedules)
  assert abs(sent - expected) <= len(costs)  # each call rounds up once
  reduce_sent = schedules[0].bytes_sent_per_device(total)
  added = sum(cost.flops for cost in costs) * 4
  assert abs(added - reduce_sent) <= len(costs) * 4
  # What the threading paces the calls by (``plan.call_points``): each hop's bytes over
  # the chains, the traffic the calls starting them declare.
  names = ("x", "y", "z")[: len(torus)]
  split = split_leaf_kernels.SplitLeafAllReduce(
    [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], names, torus, names
  )
  assert len(split.hop_bytes) == split.calls_left - 1
  per_hop = [
    sum(split_leaf_kernels._cost(c, k).remote_bytes_transferred for c in chains)
    for k in range(len(split.hop_bytes))
  ]
  assert split.hop_bytes == per_hop
