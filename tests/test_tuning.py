"""The tuner and the "auto" rule that reads its tables.

Decisions are checked with fake timers (no compilation), among them a noisy one centred on
XLA's time; one short real tuning run on the 2x4 mesh checks that a written table is what
"auto" then traces.
"""

import dataclasses
import json
import logging
import warnings

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import small_integers
from jax import lax

import torus_collectives as tc
from torus_collectives import registry
from torus_collectives.tuning import tables, timing, tuner

MiB = 2**20
AXES = ("x", "y")
SHIPPED_CPU = tables.SHIPPED_DIR / "cpu.json"  # before the fixture below hides it


pytestmark = pytest.mark.usefixtures("isolated_tables")  # tests/conftest.py


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
  return tuner.Case(op, "float32", nbytes, (2, 4), f"fake {op}", lambda name: lambda: None)


def _table(choice, op="all_reduce", bucket=24, device_kind="cpu", **changes):
  """A table of one entry for ``op`` on 2x4 from ``bucket`` up whose runs give ``choice`` by
  the rule (as "auto" requires): two runs, from two processes, with ``choice`` at half of
  XLA's time in every round and the other candidates at 1.2x."""
  names = sorted({"shard_map", "lax_torus", choice} - {tables.BASELINE})
  runs = _runs(*[{n: 0.5 if n == choice else 1.2 for n in names}] * tables.MIN_RUNS)
  entry = tables.Entry.from_runs("2x4", op, "float32", bucket, runs)
  assert entry.choice == choice
  table = tables.Table(device_kind, "test machine", tables.now(), [entry])
  return dataclasses.replace(table, **changes)


def _auto(op="all_reduce", nbytes=16 * MiB, dtype=jnp.float32):
  """What "auto" picks when traced inside shard_map on the 2x4 mesh."""
  seen = []
  mesh = harness.mesh((2, 4))

  def body(v):
    seen.append(registry.auto_implementation(op, dtype, nbytes=nbytes, torus=(2, 4)))
    return v

  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P(AXES)))(jnp.zeros(8))
  return seen[0]


# The decision rule.


def _runs(*per_run, rounds=tables.MIN_ROUNDS, processes=None):
  """One run per mapping of candidate -> ratio (every round the same), each from its own
  process unless ``processes`` names them."""
  processes = processes or [f"process-{i}" for i in range(len(per_run))]
  return [
    tables.Run.of({n: [r] * rounds for n, r in ratios.items()}, process=proc)
    for ratios, proc in zip(per_run, processes)
  ]


@pytest.mark.parametrize(
  "runs,expected",
  [
    (_runs({"shard_map": 0.90}, {"shard_map": 0.90}), "shard_map"),  # beats XLA by 10 %
    (_runs({"shard_map": 0.95}, {"shard_map": 0.95}), "shard_map"),  # exactly the threshold
    (_runs({"shard_map": 0.96}, {"shard_map": 0.90}), "xla"),  # one run within noise
    (_runs({"shard_map": 1.00}, {"shard_map": 1.00}), "xla"),  # a tie
    (_runs({"shard_map": 0.50}), "xla"),  # one run: one process's word
    (_runs({"shard_map": 0.5}, {"shard_map": 0.5}, processes=["a", "a"]), "xla"),  # same one
    (_runs({"shard_map": 0.5}, {"shard_map": 0.5}, rounds=tables.MIN_ROUNDS - 1), "xla"),
    (_runs({"shard_map": 1.70, "lax_torus": 1.20}, {"shard_map": 1.7, "lax_torus": 1.2}), "xla"),
    (  # the lowest worst-case bound of those that pass both
      _runs({"shard_map": 0.80, "lax_torus": 0.60}, {"shard_map": 0.80, "lax_torus": 0.90}),
      "shard_map",
    ),
    (_runs({"shard_map": float("nan")}, {"shard_map": 0.5}), "xla"),
    (_runs({}, {}), "xla"),
    ([], "xla"),
  ],
  ids=lambda v: "" if isinstance(v, list) else v,
)
def test_decide(runs, expected):
  assert tables.decide(runs) == expected


def test_only_the_newest_run_of_each_process_counts():
  old_fluke, a, b = _runs({"shard_map": 0.5}, {"shard_map": 1.2}, {"shard_map": 0.5})
  assert tables.decide([old_fluke, a, b]) == "xla"  # newest two: a fails
  again = dataclasses.replace(a, ci_high={"shard_map": 0.5})
  assert tables.decide([old_fluke, a, b, again]) == "shard_map"  # a's process re-measured


def test_bootstrap_bound_is_deterministic_and_above_the_median():
  ratios = np.random.default_rng(3).lognormal(0.0, 0.2, 25)
  bound = tables.ci_high(ratios)
  assert bound == tables.ci_high(list(ratios))
  assert bound > np.median(ratios)
  assert tables.ci_high([0.8] * 12) == pytest.approx(0.8)
  assert tables.ci_high([]) == tables.ci_high([0.5, float("inf")]) == float("inf")


def test_median_of_per_round_ratios_survives_a_noisy_round():
  # Round 2 is slowed for everyone; round 3 slows only shard_map. Per-round ratios
  # 0.8, 0.8, 3.0, 0.8, 0.8 have median 0.8, though shard_map's median time is not lower.
  runs = timing.Interleaved(
    {"xla": lambda: None, "shard_map": lambda: None},
    _fake_timer({"xla": [1.0, 5.0, 1.0, 1.0, 1.0], "shard_map": [0.8, 4.0, 3.0, 0.8, 0.8]}),
  ).run(5)
  assert runs.ratio("shard_map", "xla") == pytest.approx(0.8)
  assert runs.round_ratios("shard_map", "xla") == pytest.approx([0.8, 0.8, 3.0, 0.8, 0.8])


# A fake noisy machine: per round a machine-wide slowdown (it hits every call of the round
# and cancels in the ratio), per call its own jitter, and now and then a call slowed 1.5-3x
# (a neighbour's burst). Per-round ratios then spread about +-11 % (one sigma) around the
# true one, with a tail: the spread this 2-core machine shows in the shipped table's runs.
MACHINE_SIGMA, CALL_SIGMA, BURST_RATE = 0.3, 0.08, 0.1


def _noisy_timer(true_ratios: dict[str, float], seed: int):
  rng = np.random.default_rng(seed)
  state = {"round": None, "machine": 1.0}

  def timer(name, call):
    del call
    # A new round starts with the first call of it (every candidate is called once a round).
    if state["round"] is None or name in state["round"]:
      state["round"], state["machine"] = set(), rng.lognormal(0.0, MACHINE_SIGMA)
    state["round"].add(name)
    t = 1e-2 * true_ratios.get(name, 1.0) * state["machine"] * rng.lognormal(0.0, CALL_SIGMA)
    return t * (rng.uniform(1.5, 3.0) if rng.random() < BURST_RATE else 1.0)

  return timer


def _noisy_decision(true_ratios: dict[str, float], seed: int) -> str:
  """The rule's choice from MIN_RUNS runs of the noisy timer, each its own "process"."""
  runs = []
  for i in range(tables.MIN_RUNS):
    names = ("xla", "shard_map", "lax_torus")
    timed = timing.Interleaved(
      {n: lambda: None for n in names}, _noisy_timer(true_ratios, seed * 100 + i)
    ).run(tuner.DEFAULT_ROUNDS)
    ratios = {n: timed.round_ratios(n, "xla") for n in names[1:]}
    runs.append(tables.Run.of(ratios, process=f"fake-{i}"))
  return tables.decide(runs)


def test_noise_around_xla_never_picks_a_torus_implementation():
  """Both candidates take XLA's time; only noise says otherwise, 500 times."""
  choices = [_noisy_decision({}, seed) for seed in range(500)]
  assert choices == ["xla"] * 500


def test_a_candidate_at_0_8x_is_picked():
  """shard_map truly takes 0.8x XLA's time, lax_torus 1.0x: the rule picks shard_map in
  at least 45 of 50 noisy tunings (and never lax_torus)."""
  choices = [_noisy_decision({"shard_map": 0.8}, seed) for seed in range(50)]
  assert set(choices) <= {"shard_map", "xla"}
  assert choices.count("shard_map") >= 45


def test_a_fluke_of_one_process_is_not_enough():
  """The shipped table's failure: one process measured 0.77x, others 1.3-1.6x."""
  fluke, honest = _runs({"shard_map": 0.77}), _runs({"shard_map": 1.56}, processes=["p2"])
  assert tables.decide(fluke + honest) == "xla"


def _tune_twice(timer, path, monkeypatch, rounds=tables.MIN_ROUNDS):
  """Two tuning calls into the file at ``path``, as two processes would make them."""
  for process in ("first", "second"):
    monkeypatch.setattr(tables, "PROCESS", process)
    table = tuner.tune_cases(
      [_fake_case()], rounds=rounds, timer=timer, output=str(path), install=False, progress=None
    )
  return table


@pytest.mark.parametrize(
  "shard_map_seconds,expected",
  [
    ([0.5], "shard_map"),  # twice as fast: chosen
    ([0.97, 1.02, 0.99], "xla"),  # within noise of XLA
    ([1.0], "xla"),  # a tie
  ],
)
def test_tuner_decides_from_fake_timings(shard_map_seconds, expected, tmp_path, monkeypatch):
  timer = _fake_timer({"xla": [1.0], "shard_map": shard_map_seconds, "lax_torus": [2.0]})
  table = _tune_twice(timer, tmp_path / "t.json", monkeypatch)
  (entry,) = table.entries
  assert entry.choice == expected
  assert entry.topology == "2x4" and entry.op == "all_reduce"
  assert [r.process for r in entry.runs] == ["first", "second"]
  assert entry.rounds == tables.MIN_ROUNDS
  assert all(len(r.ratios["shard_map"]) == tables.MIN_ROUNDS for r in entry.runs)
  # The file holds the same: the decision and what it rests on.
  (saved,) = tables.Table.from_json((tmp_path / "t.json").read_text()).entries
  assert saved == entry


def test_one_tuning_call_alone_keeps_xla(tmp_path):
  timer = _fake_timer({"xla": [1.0], "shard_map": [0.5], "lax_torus": [2.0]})
  for output in ("", str(tmp_path / "t.json")):
    table = tuner.tune_cases(
      [_fake_case()], rounds=tables.MIN_ROUNDS, timer=timer, output=output, progress=None
    )
    (entry,) = table.entries
    assert entry.choice == "xla" and entry.ratios["shard_map"] == pytest.approx(0.5)
  assert _auto() == "xla"  # what was installed


# Validation: does a table hold when re-measured?


def _measured_table(choice, tmp_path, monkeypatch, seconds):
  table = _tune_twice(_fake_timer(seconds), tmp_path / "t.json", monkeypatch)
  (entry,) = table.entries
  return dataclasses.replace(table, entries=[dataclasses.replace(entry, choice=choice)])


def _fresh(seconds, monkeypatch, processes=("fresh-1", "fresh-2")):
  out = []
  for process in processes:
    monkeypatch.setattr(tables, "PROCESS", process)
    timer = _fake_timer(seconds)
    out.append(
      tuner.tune_cases(
        [_fake_case()], rounds=tables.MIN_ROUNDS, timer=timer, output="", progress=None
      )
    )
  return out


def test_validation_keeps_what_holds_and_replaces_what_does_not(tmp_path, monkeypatch):
  fast = {"xla": [1.0], "shard_map": [0.5], "lax_torus": [2.0]}
  slow = {"xla": [1.0], "shard_map": [1.4], "lax_torus": [2.0]}
  table = _measured_table("shard_map", tmp_path, monkeypatch, fast)

  (still,) = tuner.validate(table, _fresh(fast, monkeypatch))
  assert still.holds is True and "holds" in still.line()
  assert tuner.without_failures(table, [still]) == table

  (failed,) = tuner.validate(table, _fresh(slow, monkeypatch))
  assert failed.holds is False and "NO LONGER HOLDS" in failed.line()
  (entry,) = tuner.without_failures(table, [failed]).entries
  assert entry.choice == "xla" and entry.runs == failed.fresh
  assert entry.ratios["shard_map"] == pytest.approx(1.4)

  (one,) = tuner.validate(table, _fresh(fast, monkeypatch, processes=("only",)))
  assert one.holds is False and "the rule needs 2" in one.line()


def test_validation_of_xla_entries_and_of_what_it_cannot_remeasure(tmp_path, monkeypatch):
  fast = {"xla": [1.0], "shard_map": [0.5], "lax_torus": [2.0]}
  table = _measured_table("xla", tmp_path, monkeypatch, fast)
  (verdict,) = tuner.validate(table, _fresh(fast, monkeypatch))
  assert verdict.holds is True and "shard_map now passes" in verdict.line()
  norm = tables.Entry("2x4", "batch_norm", "float32", 20, "pallas", {}, 10)
  (skipped,) = tuner.validate(dataclasses.replace(table, entries=[norm]), [])
  assert skipped.holds is None and "not re-measured" in skipped.line()
  assert tuner.without_failures(table, [skipped]) == table


def test_validation_rebuilds_the_cases_of_a_table():
  entries = [
    tables.Entry("2x4", "all_gather", "bfloat16", 24, "xla", {}, 10),
    tables.Entry("2x4", "all_reduce_gradients", "float32", 24, "xla", {}, 10),
    tables.Entry("4x4", "all_reduce", "float32", 24, "xla", {}, 10),  # 16 devices: not here
    tables.Entry("2x4", "batch_norm", "float32", 20, "xla", {}, 10),  # no shape recorded
  ]
  cases = tuner.validation_cases(tables.Table("cpu", "m", tables.now(), entries))
  assert set(cases) == {entries[0].key, entries[1].key}
  gather, gradients = cases[entries[0].key], cases[entries[1].key]
  assert (gather.op, gather.dtype, gather.nbytes, gather.torus) == (
    "all_gather",
    "bfloat16",
    16 * MiB,
    (2, 4),
  )
  assert (gradients.op, gradients.nbytes) == ("all_reduce_gradients", 16 * MiB)
  assert tables.size_bucket(gradients.nbytes) == 24


def test_the_shipped_table_obeys_the_rule():
  """Every choice of the shipped CPU table is what the rule makes of its recorded runs,
  each from a different process, with the rounds the rule needs."""
  table = tables.Table.from_json(SHIPPED_CPU.read_text())
  assert (table.format, table.threshold, table.min_runs) == (
    tables.FORMAT,
    tables.THRESHOLD,
    tables.MIN_RUNS,
  )
  assert table.entries
  for entry in table.entries:
    assert len({r.process for r in entry.runs}) == tables.MIN_RUNS == len(entry.runs)
    assert all(r.rounds >= tables.MIN_ROUNDS for r in entry.runs)
    assert entry.choice == tables.decide(entry.runs), entry.key
    for run in entry.runs:  # the recorded bounds are those of the recorded ratios
      for name, ratios in run.ratios.items():
        assert run.ci_high[name] == pytest.approx(tables.ci_high(ratios), abs=2e-3)
        assert run.median[name] == pytest.approx(np.median(ratios), abs=2e-3)


def test_tiny_sizes_are_not_timed_and_stay_xla():
  floor = tables.latency_floor_bytes((2, 4), "cpu")
  assert 0 < floor < 16 * MiB
  timer = _fake_timer({"xla": [1.0], "shard_map": [0.1], "lax_torus": [0.1]})
  table = tuner.tune_cases(
    [_fake_case(nbytes=floor // 2)],
    rounds=3,
    timer=timer,
    output="",
    install=False,
    progress=None,
  )
  assert table.entries == []
  tables.use_table(_table("shard_map", bucket=0))  # measured "faster" even at 1 byte
  assert _auto(nbytes=floor // 2) == "xla"
  assert _auto(nbytes=16 * MiB) == "shard_map"


# What "auto" reads.


def test_missing_entries_choose_xla_and_say_how_to_tune_once(caplog):
  with caplog.at_level(logging.WARNING, logger="torus_collectives"):
    assert _auto() == "xla"
    assert _auto(op="reduce_scatter") == "xla"
  hints = [r for r in caplog.records if tables.TUNE_COMMAND in r.getMessage()]
  assert len(hints) == 1


def test_lookup_uses_the_largest_measured_size_not_above():
  entries = [
    tables.Entry("2x4", "all_reduce", "float32", 20, "xla", {}, 5),
    *_table("lax_torus", bucket=24).entries,
  ]
  tables.use_table(tables.Table("cpu", "m", tables.now(), entries))
  assert _auto(nbytes=MiB) == "xla"
  assert _auto(nbytes=8 * MiB) == "xla"
  assert _auto(nbytes=16 * MiB) == "lax_torus"
  assert _auto(nbytes=1024 * MiB) == "lax_torus"
  assert _auto(dtype=jnp.bfloat16) == "xla"  # not measured for bfloat16


def test_precedence_explicit_then_cache_then_shipped(isolated_tables):
  _table("lax_torus").save(tables.SHIPPED_DIR / "cpu.json")
  assert _auto() == "lax_torus"
  _table("shard_map").save(tables.cache_path())
  assert _auto() == "shard_map"
  tables.use_table(_table("xla"))
  assert _auto() == "xla"


@pytest.mark.parametrize(
  "contents,match",
  [
    ("{not json", "not a tuning table"),
    (json.dumps({"entries": [{"op": 1}]}), "not a tuning table"),
    (_table("shard_map", format=tables.FORMAT + 1).to_json(), "format"),
    (_table("shard_map", version="0.0.0-other").to_json(), "torus-collectives 0.0.0-other"),
    (_table("shard_map", device_kind="TPU v5 lite").to_json(), "measured on 'TPU v5 lite'"),
  ],
  ids=["corrupt", "malformed", "other-format", "other-version", "other-device"],
)
def test_bad_or_foreign_tables_are_ignored_with_a_warning(contents, match):
  tables.cache_path().write_text(contents)
  with pytest.warns(tables.TuningTableWarning, match=match):
    assert _auto() == "xla"


def test_a_table_of_another_device_passed_to_use_table_warns():
  tables.use_table(_table("shard_map", device_kind="TPU v5 lite"))
  with pytest.warns(tables.TuningTableWarning, match="measured on 'TPU v5 lite'"):
    assert _auto() == "xla"


def test_shipped_tables_of_other_devices_are_skipped_silently():
  _table("shard_map", device_kind="TPU v5 lite").save(tables.SHIPPED_DIR / "v5e.json")
  with warnings.catch_warnings():
    warnings.simplefilter("error", tables.TuningTableWarning)
    assert _auto() == "xla"


# A real tuning run, and the traced program it leads to.


def _program_of_auto(collective):
  """The lowered StableHLO, where each implementation leaves its own collectives."""
  mesh = harness.mesh((2, 4))
  f = jax.shard_map(collective, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P(AXES))
  return jax.jit(f).lower(jnp.zeros(8 * (MiB // 4), jnp.float32)).as_text()


def test_short_real_tuning_run_writes_the_table_auto_then_traces(isolated_tables):
  path = isolated_tables / "tuned.json"
  mesh = harness.mesh((2, 4))
  table = tuner.tune(
    mesh,
    sizes=[MiB],
    dtypes=["float32"],
    ops=["all_reduce"],
    rounds=3,
    output=str(path),
    progress=None,
  )
  (entry,) = tables.Table.from_json(path.read_text()).entries
  assert (entry.topology, entry.op, entry.dtype) == ("2x4", "all_reduce", "float32")
  assert set(entry.ratios) == {"shard_map", "lax_torus"}
  assert entry.choice == tables.decide(entry.runs) == "xla"  # one run: never enough

  all_reduce = lambda v: tc.all_reduce(v, AXES)
  marks = {
    "xla": "stablehlo.all_reduce",
    "shard_map": "stablehlo.collective_permute",
    "lax_torus": "stablehlo.reduce_scatter",
  }
  # Tables whose runs pick shard_map, then lax_torus, then the one the tuner wrote.
  for chosen in ("shard_map", "lax_torus", "xla"):
    tables.use_table(table if chosen == "xla" else _table(chosen, bucket=entry.bucket))
    program = _program_of_auto(all_reduce)
    assert marks[chosen] in program
    assert all(marks[o] not in program for o in marks if o != chosen)


def test_gradient_summation_on_xla_is_pmean_of_the_tree():
  """No packing copies: with "xla" the traced program is lax.pmean's."""
  mesh = harness.mesh((2, 4))
  tree = {"w": jnp.asarray(small_integers((8, 5, 3), np.float32)), "b": jnp.ones((8, 7))}

  def jaxpr(fn):
    f = jax.shard_map(fn, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P(AXES))
    return str(jax.make_jaxpr(f)(tree))

  ours = jaxpr(lambda t: tc.all_reduce_gradients(t, AXES, implementation="xla"))
  assert ours == jaxpr(lambda t: lax.pmean(t, AXES))
  assert "concatenate" not in ours
