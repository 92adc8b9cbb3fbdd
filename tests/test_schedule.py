"""The schedules, run by the numpy executor: exact sums, chunk ownership, bytes moved."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torus_collectives import schedule as S

TORUS = [S.Variant.TORUS, S.Variant.TORUS_SPLIT]
ONE_D = [S.Variant.RING, S.Variant.BIDIRECTIONAL_RING]


def _random_buffers(torus, chunk, seed):
  # Small integers: float64 sums are exact in any order, so equality is exact.
  rng = np.random.default_rng(seed)
  return rng.integers(-8, 8, size=torus + torus + (chunk,)).astype(np.float64)


def _check(collective, torus, variant, seed):
  sched = S.build(collective, torus, variant)
  chunk = 2 * sched.num_streams
  buffers = _random_buffers(torus, chunk, seed)
  out, link_bytes = S.simulate(sched, buffers)
  devices = list(np.ndindex(*torus))
  total = sum(buffers[d] for d in devices)
  for d in devices:
    if collective == "all_reduce":
      np.testing.assert_array_equal(out[d], total)
    elif collective == "reduce_scatter":
      np.testing.assert_array_equal(out[d][d], total[d])
    else:
      for c in devices:
        np.testing.assert_array_equal(out[d][c], buffers[c][c])
  p = math.prod(torus)
  full = p * chunk  # elements of the full, unscattered buffer
  per_device = {d: 0 for d in devices}
  for (d, _, _), n in link_bytes.items():
    per_device[d] += n
  factor = 2 if collective == "all_reduce" else 1
  for d in devices:
    assert per_device[d] == factor * (p - 1) * full // p
  assert sched.bytes_sent_per_device(full) == pytest.approx(factor * (p - 1) / p * full)
  return sched


@settings(max_examples=40, deadline=None)
@given(
  x=st.integers(1, 6),
  y=st.integers(1, 6),
  seed=st.integers(0, 2**16),
  variant=st.sampled_from(TORUS),
  collective=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]),
)
def test_two_d_variants_are_exact(x, y, seed, variant, collective):
  sched = _check(collective, (x, y), variant, seed)
  rings = 2 if collective == "all_reduce" else 1
  assert sched.num_steps == rings * ((x - 1) + (y - 1))


@settings(max_examples=30, deadline=None)
@given(
  p=st.integers(1, 16),
  seed=st.integers(0, 2**16),
  variant=st.sampled_from(ONE_D),
  collective=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]),
)
def test_ring_variants_are_exact(p, seed, variant, collective):
  sched = _check(collective, (p,), variant, seed)
  rings = 2 if collective == "all_reduce" else 1
  assert sched.num_steps == rings * (p - 1)


# 3-D tori up to 4x4x4, sizes 1 and 2 along some axes included.
@settings(max_examples=40, deadline=None)
@given(
  torus=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
  seed=st.integers(0, 2**16),
  variant=st.sampled_from(TORUS),
  collective=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]),
)
@example(torus=(4, 4, 4), seed=0, variant=S.Variant.TORUS_SPLIT, collective="all_reduce")
@example(torus=(1, 2, 4), seed=1, variant=S.Variant.TORUS_SPLIT, collective="reduce_scatter")
@example(torus=(4, 1, 2), seed=2, variant=S.Variant.TORUS, collective="all_gather")
def test_three_d_variants_are_exact(torus, seed, variant, collective):
  sched = _check(collective, torus, variant, seed)
  rings = 2 if collective == "all_reduce" else 1
  assert sched.num_steps == rings * sum(n - 1 for n in torus)
  assert sched.num_streams == (6 if variant == S.Variant.TORUS_SPLIT else 1)


@pytest.mark.parametrize("torus", [(4, 4), (3, 3, 3), (4, 4, 4)])
def test_split_torus_uses_every_link_every_step(torus):
  """On equal axis sizes the 2N streams cover all 2N links of a chip in every step."""
  sched = S.build("all_reduce", torus, S.Variant.TORUS_SPLIT)
  every_link = {(a, d) for a in range(len(torus)) for d in (1, -1)}
  for step in sched.steps():
    links = [(t.phase.axis, t.phase.direction) for t in step]
    assert sorted(links) == sorted(every_link)


@pytest.mark.parametrize(
  "torus,fewer,steps", [((4, 4, 8), 14, 26), ((2, 2, 4), 6, 10), ((4, 8), 8, 20)]
)
def test_split_torus_on_unequal_axes_leaves_links_idle_in_some_steps(torus, fewer, steps):
  """On unequal axis sizes the rotations drift out of phase: the figure in docs/algorithm.md for
  4x4x8 (14 of the all-reduce's 26 steps use fewer than six links)."""
  sched = S.build("all_reduce", torus, S.Variant.TORUS_SPLIT)
  every_link = {(a, d) for a in range(len(torus)) for d in (1, -1)}
  used = [{(t.phase.axis, t.phase.direction) for t in step} for step in sched.steps()]
  assert len(used) == steps
  assert sum(links != every_link for links in used) == fewer


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_split_3d_loads_all_six_links_of_every_chip_equally(collective):
  sched = S.build(collective, (4, 4, 4), S.Variant.TORUS_SPLIT)
  m = sched.num_streams
  _, link_bytes = S.simulate(sched, np.ones((4,) * 6 + (m,)))
  assert len(link_bytes) == 64 * 6
  factor = 2 if collective == "all_reduce" else 1
  # Each chip sends factor * (p - 1)/p of the p * m element buffer, spread over 6 links.
  assert set(link_bytes.values()) == {factor * 63 * m / 6}


def test_split_streams_visit_the_dimensions_in_rotated_order():
  sched = S.build("reduce_scatter", (2, 3, 4), S.Variant.TORUS_SPLIT)
  orders = [(tuple(p.axis for p in phases), phases[0].direction) for phases in sched.streams]
  assert orders == [
    ((0, 1, 2), 1),
    ((0, 1, 2), -1),
    ((1, 2, 0), 1),
    ((1, 2, 0), -1),
    ((2, 0, 1), 1),
    ((2, 0, 1), -1),
  ]


def test_split_on_one_axis_is_the_bidirectional_ring():
  split = S.build("all_reduce", (8,), S.Variant.TORUS_SPLIT)
  assert split == S.build("all_reduce", (8,), S.Variant.BIDIRECTIONAL_RING)


def test_default_variant_is_split_on_several_axes():
  assert S.default_variant((8,)) == S.Variant.BIDIRECTIONAL_RING
  assert S.default_variant((2, 4)) == S.default_variant((2, 2, 4)) == S.Variant.TORUS_SPLIT


def test_torus_steps_are_fewer_than_ring():
  ring = S.build("all_reduce", (32 * 32,), S.Variant.RING)
  torus = S.build("all_reduce", (32, 32), S.Variant.TORUS)
  cube = S.build("all_reduce", (8, 8, 16), S.Variant.TORUS)
  assert (ring.num_steps, torus.num_steps, cube.num_steps) == (2 * 1023, 4 * 31, 2 * 29)


def test_send_and_recv_slabs_pair_up_between_neighbours():
  phase = S.Phase("reduce_scatter", axis=0, direction=-1)
  for step in range(4):
    for r in range(5):
      neighbour = (r + phase.direction) % 5
      assert phase.send_slab(r, step, 5) == phase.recv_slab(neighbour, step, 5)


@pytest.mark.parametrize("variant,torus", [("ring", (2, 4)), ("torus", ())])
def test_variant_rejects_wrong_torus_rank(variant, torus):
  with pytest.raises(ValueError, match="torus"):
    S.build("all_reduce", torus, variant)


def test_unknown_variant_is_rejected():
  with pytest.raises(ValueError, match="not a valid Variant"):
    S.build("all_reduce", (2, 2), "tree")


def test_phase_rejects_bad_direction():
  with pytest.raises(ValueError, match="direction"):
    S.Phase("reduce_scatter", 0, 2)


def test_simulate_rejects_bad_buffer_shape():
  sched = S.build("all_reduce", (2, 2), "torus")
  with pytest.raises(ValueError, match="shape"):
    S.simulate(sched, np.zeros((2, 2, 2, 4)))
