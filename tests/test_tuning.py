"""The tuner and the "auto" rule that reads its tables.

Decisions are checked with fake timers (no compilation); one short real tuning run on the
2x4 mesh checks that a written table is what "auto" then traces.
"""

import dataclasses
import json
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_cases import mesh_of, small_integers
from jax import lax

import torus_collectives as tc
from torus_collectives import registry, timing, tune, tuning

MiB = 2**20
AXES = ("x", "y")


@pytest.fixture(autouse=True)
def isolated_tables(tmp_path, monkeypatch):
  """No shipped table, an empty user cache, no installed table: only what a test writes."""
  monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "cache.json"))
  shipped = tmp_path / "shipped"
  shipped.mkdir()
  monkeypatch.setattr(tuning, "SHIPPED_DIR", shipped)
  tuning.use_table(None)
  tuning.log_unmeasured.cache_clear()
  yield tmp_path
  tuning.use_table(None)


def _fake_timer(seconds: dict[str, list[float]]):
  """Replays ``seconds[name]`` round after round (the calls still run)."""
  calls = {name: 0 for name in seconds}

  def timer(name, call):
    jax.block_until_ready(call())
    t = seconds[name][calls[name] % len(seconds[name])]
    calls[name] += 1
    return t

  return timer


def _fake_case(op="all_reduce", nbytes=16 * MiB):
  return tune.Case(op, "float32", nbytes, (2, 4), f"fake {op}", lambda name: lambda: None)


def _table(choice, op="all_reduce", bucket=24, device_kind="cpu", **changes):
  entry = tuning.Entry("2x4", op, "float32", bucket, choice, {choice: 0.5}, 5)
  table = tuning.Table(device_kind, "test machine", tuning.now(), [entry])
  return dataclasses.replace(table, **changes)


def _auto(op="all_reduce", nbytes=16 * MiB, dtype=jnp.float32):
  """What "auto" picks when traced inside shard_map on the 2x4 mesh."""
  seen = []
  mesh = mesh_of("2x4")

  def body(v):
    seen.append(registry.auto_implementation(op, dtype, nbytes=nbytes, torus=(2, 4)))
    return v

  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P(AXES)))(jnp.zeros(8))
  return seen[0]


# The decision rule.


@pytest.mark.parametrize(
  "ratios,expected",
  [
    ({"shard_map": 0.90}, "shard_map"),  # beats XLA by 10 %
    ({"shard_map": 0.95}, "shard_map"),  # exactly the margin
    ({"shard_map": 0.96}, "xla"),  # within the margin: noise
    ({"shard_map": 1.00}, "xla"),  # a tie
    ({"shard_map": 1.70, "lax_torus": 1.20}, "xla"),
    ({"shard_map": 0.80, "lax_torus": 0.60}, "lax_torus"),  # the fastest of several
    ({"shard_map": float("nan")}, "xla"),
    ({}, "xla"),
  ],
)
def test_decide(ratios, expected):
  assert tuning.decide(ratios) == expected


def test_median_of_per_round_ratios_survives_a_noisy_round():
  # Round 2 is slowed for everyone; round 3 slows only shard_map. Per-round ratios
  # 0.8, 0.8, 3.0, 0.8, 0.8 have median 0.8, though shard_map's median time is not lower.
  runs = timing.Interleaved(
    {"xla": lambda: None, "shard_map": lambda: None},
    _fake_timer({"xla": [1.0, 5.0, 1.0, 1.0, 1.0], "shard_map": [0.8, 4.0, 3.0, 0.8, 0.8]}),
  ).run(5)
  assert runs.ratio("shard_map", "xla") == pytest.approx(0.8)
  assert tuning.decide(runs.ratios("xla")) == "shard_map"


@pytest.mark.parametrize(
  "shard_map_seconds,expected",
  [
    ([0.5], "shard_map"),  # twice as fast: chosen
    ([0.97, 1.02, 0.99], "xla"),  # within noise of XLA
    ([1.0], "xla"),  # a tie
  ],
)
def test_tuner_decides_from_fake_timings(shard_map_seconds, expected):
  timer = _fake_timer({"xla": [1.0], "shard_map": shard_map_seconds, "lax_torus": [2.0]})
  table = tune.tune_cases(
    [_fake_case()], rounds=6, timer=timer, output="", install=False, progress=None
  )
  (entry,) = table.entries
  assert entry.choice == expected
  assert entry.topology == "2x4" and entry.op == "all_reduce" and entry.rounds == 6


def test_tiny_sizes_are_not_timed_and_stay_xla():
  floor = tuning.latency_floor_bytes((2, 4), "cpu")
  assert 0 < floor < 16 * MiB
  timer = _fake_timer({"xla": [1.0], "shard_map": [0.1], "lax_torus": [0.1]})
  table = tune.tune_cases(
    [_fake_case(nbytes=floor // 2)],
    rounds=3,
    timer=timer,
    output="",
    install=False,
    progress=None,
  )
  assert table.entries == []
  tuning.use_table(_table("shard_map", bucket=0))  # measured "faster" even at 1 byte
  assert _auto(nbytes=floor // 2) == "xla"
  assert _auto(nbytes=16 * MiB) == "shard_map"


# What "auto" reads.


def test_missing_entries_choose_xla_and_say_how_to_tune_once(caplog):
  with caplog.at_level(logging.WARNING, logger="torus_collectives"):
    assert _auto() == "xla"
    assert _auto(op="reduce_scatter") == "xla"
  hints = [r for r in caplog.records if tuning.TUNE_COMMAND in r.getMessage()]
  assert len(hints) == 1


def test_lookup_uses_the_largest_measured_size_not_above():
  entries = [
    tuning.Entry("2x4", "all_reduce", "float32", 20, "xla", {}, 5),
    tuning.Entry("2x4", "all_reduce", "float32", 24, "lax_torus", {}, 5),
  ]
  tuning.use_table(tuning.Table("cpu", "m", tuning.now(), entries))
  assert _auto(nbytes=MiB) == "xla"
  assert _auto(nbytes=8 * MiB) == "xla"
  assert _auto(nbytes=16 * MiB) == "lax_torus"
  assert _auto(nbytes=1024 * MiB) == "lax_torus"
  assert _auto(dtype=jnp.bfloat16) == "xla"  # not measured for bfloat16


def test_precedence_explicit_then_cache_then_shipped(isolated_tables):
  _table("lax_torus").save(tuning.SHIPPED_DIR / "cpu.json")
  assert _auto() == "lax_torus"
  _table("shard_map").save(tuning.cache_path())
  assert _auto() == "shard_map"
  tuning.use_table(_table("xla"))
  assert _auto() == "xla"


@pytest.mark.parametrize(
  "contents,match",
  [
    ("{not json", "not a tuning table"),
    (json.dumps({"entries": [{"op": 1}]}), "not a tuning table"),
    (_table("shard_map", format=tuning.FORMAT + 1).to_json(), "format"),
    (_table("shard_map", version="0.0.0-other").to_json(), "torus-collectives 0.0.0-other"),
    (_table("shard_map", device_kind="TPU v5 lite").to_json(), "measured on 'TPU v5 lite'"),
  ],
  ids=["corrupt", "malformed", "other-format", "other-version", "other-device"],
)
def test_bad_or_foreign_tables_are_ignored_with_a_warning(contents, match):
  tuning.cache_path().write_text(contents)
  with pytest.warns(tuning.TuningTableWarning, match=match):
    assert _auto() == "xla"


def test_shipped_tables_of_other_devices_are_skipped_silently():
  _table("shard_map", device_kind="TPU v5 lite").save(tuning.SHIPPED_DIR / "v5e.json")
  with warnings.catch_warnings():
    warnings.simplefilter("error", tuning.TuningTableWarning)
    assert _auto() == "xla"


# A real tuning run, and the traced program it leads to.


def _program_of_auto(collective):
  """The lowered StableHLO, where each implementation leaves its own collectives."""
  mesh = mesh_of("2x4")
  f = jax.shard_map(collective, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P(AXES))
  return jax.jit(f).lower(jnp.zeros(8 * (MiB // 4), jnp.float32)).as_text()


def test_short_real_tuning_run_writes_the_table_auto_then_traces(isolated_tables):
  path = isolated_tables / "tuned.json"
  mesh = mesh_of("2x4")
  table = tune.tune(
    mesh,
    sizes=[MiB],
    dtypes=["float32"],
    ops=["all_reduce"],
    rounds=3,
    output=str(path),
    progress=None,
  )
  (entry,) = tuning.Table.from_json(path.read_text()).entries
  assert (entry.topology, entry.op, entry.dtype) == ("2x4", "all_reduce", "float32")
  assert set(entry.ratios) == {"shard_map", "lax_torus"}
  assert entry.choice == tuning.decide(entry.ratios, table.margin)

  all_reduce = lambda v: tc.all_reduce(v, AXES)
  marks = {
    "xla": "stablehlo.all_reduce",
    "shard_map": "stablehlo.collective_permute",
    "lax_torus": "stablehlo.reduce_scatter",
  }
  for choice in ("shard_map", "lax_torus", "xla"):  # the measured choice, then edited ones
    chosen = entry.choice if choice == "xla" else choice
    tuning.use_table(
      dataclasses.replace(table, entries=[dataclasses.replace(entry, choice=chosen)])
    )
    program = _program_of_auto(all_reduce)
    assert marks[chosen] in program
    assert all(marks[o] not in program for o in marks if o != chosen)


def test_gradient_summation_on_xla_is_pmean_of_the_tree():
  """No packing copies: with "xla" the traced program is lax.pmean's."""
  mesh = mesh_of("2x4")
  tree = {"w": jnp.asarray(small_integers((8, 5, 3), np.float32)), "b": jnp.ones((8, 7))}

  def jaxpr(fn):
    f = jax.shard_map(fn, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P(AXES))
    return str(jax.make_jaxpr(f)(tree))

  ours = jaxpr(lambda t: tc.all_reduce_gradients(t, AXES, implementation="xla"))
  assert ours == jaxpr(lambda t: lax.pmean(t, AXES))
  assert "concatenate" not in ours
