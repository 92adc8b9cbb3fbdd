"""The alpha-beta cost model against the numpy schedule executor and hand-derived costs."""

import dataclasses

import numpy as np
import pytest

from torus_collectives import cost_model as cm
from torus_collectives import schedule as schedule_lib

V5E = cm.GENERATIONS["v5e"]
NO_LATENCY = dataclasses.replace(V5E, hop_latency=0.0)
COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")
CASES = [
  ((8,), "ring"),
  ((8,), "bidirectional_ring"),
  ((2, 4), "torus_2d"),
  ((2, 4), "torus_2d_split"),
  ((4, 4), "torus_2d_split"),
  ((3, 5), "torus_2d_split"),
]


def _simulated_link_bytes(sched, itemsize, m):
  torus = sched.torus
  buffers = np.arange(np.prod(torus) ** 2 * m, dtype=np.float64).reshape(torus + torus + (m,))
  _, elements = schedule_lib.simulate(sched, buffers)
  return {key: count * itemsize for key, count in elements.items()}


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("torus,variant", CASES)
def test_link_bytes_match_simulation(torus, variant, collective):
  sched = schedule_lib.build(collective, torus, variant)
  itemsize, m = 4, 4 * sched.num_streams
  nbytes = sched.num_devices * m * itemsize
  expected = _simulated_link_bytes(sched, itemsize, m)
  modelled = cm.link_bytes(sched, nbytes)
  got = {cm.link_key(i, torus): b for i, b in enumerate(modelled) if b}
  assert got.keys() == expected.keys()
  for key, value in expected.items():
    assert got[key] == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("torus,variant", CASES)
def test_bytes_per_device_match_schedule_and_theory(torus, variant, collective):
  sched = schedule_lib.build(collective, torus, variant)
  p, nbytes = sched.num_devices, 3.0 * 2**20
  per_device = cm.link_bytes(sched, nbytes).reshape(p, -1).sum(axis=1)
  factor = 2 if collective == "all_reduce" else 1
  np.testing.assert_allclose(per_device, sched.bytes_sent_per_device(nbytes), rtol=1e-12)
  np.testing.assert_allclose(per_device, factor * (p - 1) / p * nbytes, rtol=1e-12)


@pytest.mark.parametrize("generation", sorted(cm.GENERATIONS))
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("torus", [(2, 2), (2, 8), (4, 4), (6, 3), (16, 16)])
def test_no_variant_beats_the_lower_bound(torus, collective, generation):
  gen = cm.GENERATIONS[generation]
  for variant in schedule_lib.Variant:
    pred = cm.predict(collective, torus, variant, 1e8, gen)
    assert pred.time_s >= pred.bound_s * (1 - 1e-12), variant


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_split_halves_meets_the_bandwidth_bound_on_square_tori(n, collective):
  pred = cm.predict(collective, (n, n), "torus_2d_split", 1e8, NO_LATENCY)
  assert pred.time_s == pytest.approx(pred.bound_s, rel=1e-12)
  # The one-direction, one-axis-at-a-time torus uses 1 of 4 links: 4x the bound.
  plain = cm.predict(collective, (n, n), "torus_2d", 1e8, NO_LATENCY)
  assert plain.time_s == pytest.approx(4 * pred.bound_s, rel=1e-12)


@pytest.mark.parametrize(
  "name,torus,factor", [("v3", (32, 32), 1.25), ("v5e", (16, 16), 1.1), ("v6e", (16, 16), 1.15)]
)
def test_split_halves_within_stated_factor_for_resnet50(name, torus, factor):
  pred = cm.predict(
    "all_reduce", torus, "torus_2d_split", cm.RESNET50_PARAMS * 4, cm.GENERATIONS[name]
  )
  assert 1.0 < pred.ratio_to_bound < factor
  assert pred.latency_s == pytest.approx(2 * (2 * torus[0] - 2) * 1e-6)


def test_streams_sharing_a_link_share_its_bandwidth():
  # 2x4 split all-reduce, chunk c = S/8, each of the 4 streams carries c/4 per chunk. The
  # +x/+y pair of streams moves (x-then-y) c, c/4 x6, c and (y-then-x) c/2 x3, c/4 x2,
  # c/2 x3; in steps 1, 2, 5, 6 both are on +y and add up: c (1 + 4 * 3/4 + 2/4 + 1).
  nbytes = 8e6
  pred = cm.predict("all_reduce", (2, 4), "torus_2d_split", nbytes, NO_LATENCY)
  assert pred.bandwidth_s == pytest.approx(5.5 * nbytes / 8 / V5E.link_bandwidth, rel=1e-12)


def test_ring_embeddings_differ_in_hops_not_bytes():
  snake = cm.predict("all_reduce", (4, 4), "ring", 1e6, V5E, order="snake")
  row_major = cm.predict("all_reduce", (4, 4), "ring", 1e6, V5E, order="row_major")
  assert snake.bandwidth_s == pytest.approx(row_major.bandwidth_s, rel=1e-12)
  assert snake.latency_s == pytest.approx(snake.steps * V5E.hop_latency)
  assert row_major.latency_s == pytest.approx(2 * snake.latency_s)  # the row-change hops


def test_row_major_ring_routes_each_row_change_over_two_links():
  sched = schedule_lib.build("all_gather", (16,), "ring")
  per_hop = cm.link_bytes(sched, 16.0, (4, 4), order="snake").max()
  loads = cm.link_bytes(sched, 16.0, (4, 4), order="row_major")
  assert loads.sum() == pytest.approx(per_hop * (16 + 4))  # 16 hops, 4 of them 2 links long


def test_time_grows_with_size_and_chips_and_falls_with_bandwidth():
  for variant in schedule_lib.Variant:
    small, large = (cm.predict("all_reduce", (8, 8), variant, s, V5E) for s in (1e6, 1e8))
    assert large.time_s > small.time_s
    grows = [cm.predict("all_reduce", (n, n), variant, 1e8, V5E).time_s for n in (2, 4, 8, 16)]
    assert np.all(np.diff(grows) > 0), variant
    faster = cm.predict("all_reduce", (8, 8), variant, 1e8, cm.GENERATIONS["v6e"])
    assert faster.time_s < large.time_s


def test_ranking_on_the_paper_pod():
  times = {
    v.value: cm.predict(
      "all_reduce", (32, 32), v, cm.RESNET50_PARAMS * 4, cm.GENERATIONS["v3"]
    ).time_s
    for v in schedule_lib.Variant
  }
  assert times["torus_2d_split"] < times["torus_2d"] < times["bidirectional_ring"] < times["ring"]


def test_predict_rejects_a_3d_torus():
  with pytest.raises(ValueError, match="2-D tori"):
    cm.predict("all_reduce", (4, 4, 4), "torus_2d", 1e6, V5E)


def test_predict_rejects_nonpositive_size():
  with pytest.raises(ValueError, match="nbytes must be positive"):
    cm.predict("all_reduce", (4, 4), "torus_2d", 0, V5E)


def test_unknown_ring_order_is_rejected():
  with pytest.raises(ValueError, match="ring order"):
    cm.predict("all_reduce", (4, 4), "ring", 1e6, V5E, order="hilbert")


def test_schedule_of_another_shape_is_rejected():
  sched = schedule_lib.build("all_reduce", (2, 4), "torus_2d")
  with pytest.raises(ValueError, match="cannot be laid onto"):
    cm.link_bytes(sched, 1e6, (4, 2))


def test_invalid_generation_is_rejected():
  with pytest.raises(ValueError, match="invalid generation"):
    cm.Generation("v0", links_per_chip=0, link_bandwidth=1e9)


def test_cli_prints_every_pod_dtype_and_variant(capsys, tmp_path):
  plot = tmp_path / "time_vs_p.png"
  cm.main(["--alpha", "0", "--plot", str(plot)])
  out = capsys.readouterr().out
  assert "not measured" in out
  rows = [line for line in out.splitlines() if line.startswith(("v3 ", "v5e ", "v6e "))]
  assert len(rows) == len(cm.PODS) * len(cm.DTYPE_BYTES) * len(schedule_lib.Variant)
  split = [line.split() for line in rows if "torus_2d_split" in line]
  assert all(float(cols[-1]) == pytest.approx(1.0) for cols in split)  # alpha 0: at the bound
  assert plot.read_bytes().startswith(b"\x89PNG")


def test_pipelined_adds_hide_behind_the_links():
  """Unpipelined, a reduce-scatter step is transfer + add; in k pieces the add overlaps
  the transfer but for one piece, so the exposed add falls by k when the link dominates."""
  nbytes = cm.RESNET50_PARAMS * 4
  link_only = cm.predict("reduce_scatter", (16, 16), "torus_2d_split", nbytes, V5E)
  whole = cm.predict("reduce_scatter", (16, 16), "torus_2d_split", nbytes, V5E, reduce_pieces=1)
  piped = cm.predict("reduce_scatter", (16, 16), "torus_2d_split", nbytes, V5E, reduce_pieces=8)
  adds = 3 * (255 / 256) * nbytes / V5E.hbm_bandwidth  # every received byte: 2 reads, 1 write
  assert link_only.reduce_s == 0
  assert whole.reduce_s == pytest.approx(adds, rel=1e-9)
  assert piped.reduce_s == pytest.approx(adds / 8, rel=1e-9)
  assert link_only.time_s < piped.time_s < whole.time_s
  gather = cm.predict("all_gather", (16, 16), "torus_2d_split", nbytes, V5E, reduce_pieces=1)
  assert gather.reduce_s == 0
  with pytest.raises(ValueError, match="reduce_pieces"):
    cm.predict("all_reduce", (4, 4), "torus_2d_split", nbytes, V5E, reduce_pieces=0)
