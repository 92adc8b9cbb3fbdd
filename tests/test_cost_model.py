"""The alpha-beta cost model against the numpy schedule executor and hand-derived costs."""

import dataclasses
import math

import numpy as np
import pytest

from bench import cost_model_report
from torus_collectives import cost_model as cm
from torus_collectives import quantization
from torus_collectives import schedule as schedule_lib

V5E = cm.GENERATIONS["v5e"]
NO_LATENCY = dataclasses.replace(V5E, hop_latency=0.0)
COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")
CASES = [
  ((8,), "ring"),
  ((8,), "bidirectional_ring"),
  ((2, 4), "torus"),
  ((2, 4), "torus_split"),
  ((4, 4), "torus_split"),
  ((3, 5), "torus_split"),
  ((2, 2, 2), "torus"),
  ((2, 2, 2), "torus_split"),
  ((3, 3, 3), "torus_split"),
  ((2, 3, 4), "torus_split"),
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
  pred = cm.predict(collective, (n, n), "torus_split", 1e8, NO_LATENCY)
  assert pred.time_s == pytest.approx(pred.bound_s, rel=1e-12)
  # The one-direction, one-axis-at-a-time torus uses 1 of 4 links: 4x the bound.
  plain = cm.predict(collective, (n, n), "torus", 1e8, NO_LATENCY)
  assert plain.time_s == pytest.approx(4 * pred.bound_s, rel=1e-12)


@pytest.mark.parametrize(
  "name,torus,factor", [("v3", (32, 32), 1.25), ("v5e", (16, 16), 1.1), ("v6e", (16, 16), 1.15)]
)
def test_split_halves_within_stated_factor_for_resnet50(name, torus, factor):
  pred = cm.predict(
    "all_reduce", torus, "torus_split", cm.RESNET50_PARAMS * 4, cm.GENERATIONS[name]
  )
  assert 1.0 < pred.ratio_to_bound < factor
  assert pred.latency_s == pytest.approx(2 * (2 * torus[0] - 2) * 1e-6)


def test_streams_sharing_a_link_share_its_bandwidth():
  # 2x4 split all-reduce, chunk c = S/8, each of the 4 streams carries c/4 per chunk. The
  # +x/+y pair of streams moves (x-then-y) c, c/4 x6, c and (y-then-x) c/2 x3, c/4 x2,
  # c/2 x3; in steps 1, 2, 5, 6 both are on +y and add up: c (1 + 4 * 3/4 + 2/4 + 1).
  nbytes = 8e6
  pred = cm.predict("all_reduce", (2, 4), "torus_split", nbytes, NO_LATENCY)
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
  assert times["torus_split"] < times["torus"] < times["bidirectional_ring"] < times["ring"]


def test_predict_rejects_a_3d_torus_on_four_link_chips():
  with pytest.raises(ValueError, match="up to 2 dimensions"):
    cm.predict("all_reduce", (4, 4, 4), "torus", 1e6, V5E)


def test_predict_rejects_nonpositive_size():
  with pytest.raises(ValueError, match="nbytes must be positive"):
    cm.predict("all_reduce", (4, 4), "torus", 0, V5E)


def test_unknown_ring_order_is_rejected():
  with pytest.raises(ValueError, match="ring order"):
    cm.predict("all_reduce", (4, 4), "ring", 1e6, V5E, order="hilbert")


def test_schedule_of_another_shape_is_rejected():
  sched = schedule_lib.build("all_reduce", (2, 4), "torus")
  with pytest.raises(ValueError, match="cannot be laid onto"):
    cm.link_bytes(sched, 1e6, (4, 2))


def test_invalid_generation_is_rejected():
  with pytest.raises(ValueError, match="invalid generation"):
    cm.Generation("v0", links_per_chip=0, link_bandwidth=1e9)


def test_cli_prints_every_pod_dtype_and_variant(capsys, tmp_path):
  plot = tmp_path / "time_vs_p.png"
  cost_model_report.main(["--alpha", "0", "--plot", str(plot)])
  out = capsys.readouterr().out
  assert "not measured" in out
  rows = [line for line in out.splitlines() if line.startswith(("v3 ", "v5e ", "v6e "))]
  assert len(rows) == 3 * len(cost_model_report.DTYPE_BYTES) * len(schedule_lib.Variant)
  rows_3d = [line for line in out.splitlines() if line.startswith(("v4 ", "v5p "))]
  assert len(rows_3d) == 4 * len(cost_model_report.DTYPE_BYTES) * (len(schedule_lib.Variant) + 2)
  # alpha 0: the split schedule on the physical torus (2-D or 3-D) sits at the bound.
  split = [line.split() for line in rows + rows_3d]
  split = [cols for cols in split if cols[3] == "torus_split" and cols[4] == cols[1]]
  assert len(split) == len(cost_model_report.PODS) * len(cost_model_report.DTYPE_BYTES)
  assert all(float(cols[-1]) == pytest.approx(1.0) for cols in split)  # alpha 0: at the bound
  assert plot.read_bytes().startswith(b"\x89PNG")


V5P = cm.GENERATIONS["v5p"]
V5P_NO_LATENCY = dataclasses.replace(V5P, hop_latency=0.0)


@pytest.mark.parametrize("generation", ["v4", "v5p"])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_split_3d_meets_the_six_link_bound_on_cubic_tori(n, collective, generation):
  gen = dataclasses.replace(cm.GENERATIONS[generation], hop_latency=0.0)
  pred = cm.predict(collective, (n, n, n), "torus_split", 1e8, gen)
  p, factor = n**3, 2 if collective == "all_reduce" else 1
  six_links = factor * (p - 1) / p * 1e8 / (6 * gen.link_bandwidth)
  assert pred.bound_s == pytest.approx(six_links, rel=1e-12)
  assert pred.time_s == pytest.approx(six_links, rel=1e-12)
  # One axis and one direction at a time: 1 of 6 links.
  plain = cm.predict(collective, (n, n, n), "torus", 1e8, gen)
  assert plain.time_s == pytest.approx(6 * six_links, rel=1e-12)


@pytest.mark.parametrize("n", [4, 8])
def test_split_3d_beats_every_2d_and_1d_schedule_on_the_same_chips(n):
  nbytes = cm.RESNET50_PARAMS * 4
  times = {
    (v.value, logical): cm.predict("all_reduce", (n,) * 3, v, nbytes, V5P, logical=logical).time_s
    for v, logical in cm.compared_schedules((n,) * 3)
  }
  best = times["torus_split", (n, n, n)]
  assert best == min(times.values())
  # A 2-D schedule reaches at most 4 of the 6 links: at least 1.5x the 3-D split.
  assert times["torus_split", (n, n * n)] > 1.5 * best * (1 - 1e-12)


@pytest.mark.parametrize("torus", [(8, 8, 8), (16, 16, 16)])
def test_split_3d_latency_is_one_hop_per_step_for_resnet50(torus):
  pred = cm.predict("all_reduce", torus, "torus_split", cm.RESNET50_PARAMS * 4, V5P)
  assert pred.steps == 2 * sum(n - 1 for n in torus)
  assert pred.latency_s == pytest.approx(pred.steps * V5P.hop_latency)
  assert pred.bandwidth_s == pytest.approx(pred.bound_s, rel=1e-12)


def test_folded_2d_schedule_link_bytes_add_up():
  """X x YZ on X x Y x Z: every logical hop crosses one physical link (the snake)."""
  sched = schedule_lib.build("all_reduce", (4, 16), "torus_split")
  loads = cm.link_bytes(sched, 3.0 * 2**20, (4, 4, 4))
  np.testing.assert_allclose(loads.sum(), 64 * 2 * 63 / 64 * 3.0 * 2**20, rtol=1e-12)
  assert cm.predict("all_reduce", (4, 4, 4), "ring", 1e6, V5P).latency_s == pytest.approx(
    2 * 63 * V5P.hop_latency
  )


def test_snake_visits_every_chip_of_a_3d_torus_through_neighbours():
  order = cm.ring_order((2, 3, 4))
  assert sorted(order) == list(np.ndindex(2, 3, 4))
  for a, b in zip(order, order[1:] + order[:1]):
    assert sum(x != y for x, y in zip(a, b)) == 1


@pytest.mark.parametrize(("generation", "torus"), [(V5E, (16, 16)), (V5P, (8, 8, 8))])
def test_pipelined_adds_hide_behind_the_links(generation, torus):
  """Unpipelined, a reduce-scatter step is transfer + add; in k pieces the add overlaps
  the transfer but for one piece, and within a ring phase the next step's pieces follow
  the adds, so when the link dominates only the first step of each phase exposes an add,
  of one piece."""
  nbytes, p = cm.RESNET50_PARAMS * 4, math.prod(torus)

  def predict(collective, **kw):
    return cm.predict(collective, torus, "torus_split", nbytes, generation, **kw)

  link_only = predict("reduce_scatter")
  whole = predict("reduce_scatter", reduce_pieces=1)
  piped = predict("reduce_scatter", reduce_pieces=8)
  # every received byte: 2 reads, 1 write
  adds = 3 * (p - 1) / p * nbytes / generation.hbm_bandwidth
  assert link_only.reduce_s == 0
  assert whole.reduce_s == pytest.approx(adds, rel=1e-9)
  sched = schedule_lib.build("reduce_scatter", torus, "torus_split")
  chunk = nbytes / p / sched.num_streams
  phase_starts = [step for step in sched.steps() if any(t.step == 0 for t in step)]
  first_adds = sum(
    3 * t.slab_elements(torus, 1) * chunk / generation.hbm_bandwidth
    for step in phase_starts
    for t in step
  )
  assert piped.reduce_s == pytest.approx(first_adds / 8, rel=1e-9)
  assert link_only.time_s < piped.time_s < whole.time_s
  assert predict("all_gather", reduce_pieces=1).reduce_s == 0
  with pytest.raises(ValueError, match="reduce_pieces"):
    predict("all_reduce", reduce_pieces=0)


# ---------------------------------------------------------------------------------------
# Block-scaled transport and multislice.

INT8 = quantization.BlockScaled("int8", 128)  # 128 int8 values + a bfloat16 scale: 130 bytes
V6E = cm.GENERATIONS["v6e"]


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("torus,variant", [((8,), "ring"), ((4, 4), "torus_split")])
def test_int8_transport_prices_bandwidth_at_the_wire_byte_ratio(torus, variant, itemsize):
  nbytes = 1e8
  plain = cm.predict("all_reduce", torus, variant, nbytes, V5E)
  int8 = cm.predict("all_reduce", torus, variant, nbytes, V5E, transport=INT8, itemsize=itemsize)
  assert int8.bandwidth_s == pytest.approx(plain.bandwidth_s * 130 / 128 / itemsize, rel=1e-12)
  assert int8.latency_s == plain.latency_s  # same steps, same hops
  assert int8.bound_s == plain.bound_s  # the unquantized dtype's bound
  assert int8.transport == (INT8,) * len(torus)


def test_transport_on_one_axis_scales_only_its_hops():
  # The plain torus on 2x4, chunk c = S/8, one stream: x reduce-scatter moves one row of
  # 4 chunks (4c), y three steps of c, then the gather back: 14c over one link at a time,
  # 8c of it along x. With int8 from bfloat16 on x only: 8c * 130/256 + 6c.
  nbytes = 8e6
  c = nbytes / 8
  plain = cm.predict("all_reduce", (2, 4), "torus", nbytes, NO_LATENCY)
  x_only = cm.predict(
    "all_reduce", (2, 4), "torus", nbytes, NO_LATENCY, transport=(INT8, None), itemsize=2
  )
  assert plain.bandwidth_s == pytest.approx(14 * c / V5E.link_bandwidth, rel=1e-12)
  assert x_only.bandwidth_s == pytest.approx(
    (8 * c * 130 / 256 + 6 * c) / V5E.link_bandwidth, rel=1e-12
  )
  sched = schedule_lib.build("all_reduce", (2, 4), "torus")
  loads = cm.link_bytes(sched, nbytes, transport=(INT8, None), itemsize=2)
  assert loads.sum() == pytest.approx(8 * (8 * c * 130 / 256 + 6 * c), rel=1e-12)


def test_no_transport_leaves_predictions_unchanged():
  for kw in (
    {},
    {"transport": None},
    {"transport": (None, None)},
    {"transport": (None, None), "itemsize": 2},
  ):
    pred = cm.predict("all_reduce", (4, 4), "torus_split", 1e7, V5E, reduce_pieces=4, **kw)
    assert pred == cm.predict("all_reduce", (4, 4), "torus_split", 1e7, V5E, reduce_pieces=4)
    assert pred.transport is None


def test_transport_errors():
  with pytest.raises(ValueError, match="itemsize"):
    cm.predict("all_reduce", (4, 4), "torus", 1e6, V5E, transport=INT8)
  with pytest.raises(ValueError, match="per axis"):
    cm.predict("all_reduce", (8,), "ring", 1e6, V5E, transport=(INT8, INT8), itemsize=2)
  with pytest.raises(ValueError, match="reduce_pieces"):
    cm.predict("all_reduce", (4, 4), "torus", 1e6, V5E, transport=INT8, itemsize=2, reduce_pieces=2)


@pytest.mark.parametrize("num_slices,dcn_us", [(2, 320.0), (4, 480.0), (8, 560.0)])
def test_multislice_dcn_term_by_hand(num_slices, dcn_us):
  # v5e 4x4 slices (2 hosts of 8 chips), 16 MB: each chip's shard is 1 MB. The DCN ring
  # over n slices sends 2 (n - 1) / n MB per chip, 8 chips share a host's 2 x 100 Gbps
  # (25 GB/s): 16 (n - 1) / n MB / 25 GB/s = 320, 480, 560 us for n = 2, 4, 8; and
  # 2 (n - 1) hops of 10 us.
  pred = cm.multislice_all_reduce(V5E, (4, 4), num_slices, 16e6)
  assert pred.dcn_bytes_per_host == pytest.approx(16e6 * (num_slices - 1) / num_slices)
  assert pred.dcn_bandwidth_s == pytest.approx(dcn_us * 1e-6, rel=1e-12)
  assert pred.dcn_latency_s == pytest.approx(2 * (num_slices - 1) * 10e-6, rel=1e-12)
  rs, ag = (
    cm.predict(c, (4, 4), "torus_split", 16e6, V5E) for c in ("reduce_scatter", "all_gather")
  )
  assert pred.ici_s == pytest.approx(rs.time_s + ag.time_s, rel=1e-12)
  assert pred.time_s == pytest.approx(pred.ici_s + dcn_us * 1e-6 + pred.dcn_latency_s, rel=1e-12)


def test_multislice_int8_on_dcn_cuts_only_the_dcn_bandwidth_term():
  nbytes = cm.RESNET50_PARAMS * 2
  plain = cm.multislice_all_reduce(V6E, (16, 16), 4, nbytes, itemsize=2)
  int8 = cm.multislice_all_reduce(V6E, (16, 16), 4, nbytes, INT8, itemsize=2)
  assert int8.dcn_bandwidth_s == pytest.approx(plain.dcn_bandwidth_s * 130 / 256, rel=1e-12)
  assert int8.dcn_latency_s == plain.dcn_latency_s
  assert (int8.reduce_scatter, int8.all_gather) == (plain.reduce_scatter, plain.all_gather)
  # v6e: 8 chips share 4 x 200 Gbps; 2 (3/4) of a 1/256 shard each.
  assert plain.dcn_bandwidth_s == pytest.approx(1.5 * 8 * nbytes / 256 / 100e9, rel=1e-12)


def test_one_slice_is_the_ici_all_reduce_and_small_slices_share_a_host():
  one = cm.multislice_all_reduce(V5E, (4, 4), 1, 1e7)
  assert one.dcn_s == 0
  ici = cm.predict("all_reduce", (4, 4), "torus_split", 1e7, V5E)
  assert one.time_s == pytest.approx(ici.time_s, rel=1e-12)
  # A 2x2 slice holds half a host: its 4 chips share the NICs (not 8).
  small = cm.multislice_all_reduce(V5E, (2, 2), 2, 4e6, dcn_hop_latency=0.0)
  assert small.dcn_s == pytest.approx(4e6 / 25e9, rel=1e-12)
  with pytest.raises(ValueError, match="num_slices"):
    cm.multislice_all_reduce(V5E, (4, 4), 0, 1e7)
  with pytest.raises(ValueError, match="no DCN constants"):
    cm.multislice_all_reduce(cm.GENERATIONS["v3"], (4, 4), 2, 1e7)


def test_report_prints_int8_and_multislice_sections():
  rows = cost_model_report.resnet50_table(
    pods=(("v5e", (16, 16)),), transport=cost_model_report.INT8
  )
  text = cost_model_report.format_predictions(rows)
  assert len([line for line in text.splitlines() if line.startswith("int8/128")]) == 2 * 4
  split = [r for r in rows if r["prediction"].variant == "torus_split"]
  for row in split:  # bandwidth-bound, so int8 halves (bf16) or quarters (f32) it
    ratio = row["prediction"].bandwidth_s / row["unquantized"].bandwidth_s
    assert ratio == pytest.approx(130 / 128 / cost_model_report.DTYPE_BYTES[row["dtype"]])
  multi = cost_model_report.format_multislice(cost_model_report.multislice_table())
  assert "4 x v5e 16x16" in multi and "int8/128" in multi
