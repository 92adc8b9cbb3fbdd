"""The tuning tables' plumbing: what "auto" accepts from a table, where it looks, and how a
table is rendered.

* The check every table passes before "auto" reads it (``tables.checked``): an entry whose
  recorded runs do not give its choice by the rule is read as XLA, with one
  ``TuningTableWarning`` naming it and the command that measures it, whichever way the
  table came (the user cache, ``use_table`` of a table or a file, the shipped tables), for
  op entries and whole-step entries alike; tables built by the rule keep working.
* ``cache_path``, unreadable and corrupt cache files, ``latency_floor_bytes`` against
  figures derived by hand, and ``format_table``'s exact text.

No test compiles anything: "auto" is asked outside any trace (``registry.auto_implementation``,
``registry.tuned_step``), and the one tuning call times a fake case with a fake timer.
"""

import dataclasses
import json
import re
import shlex
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from torus_collectives import registry
from torus_collectives.tuning import tables, tuner

MiB = 2**20
SIZE = 16 * MiB  # above the latency floor of 2x4 (0.55 MiB)
BUCKET = tables.size_bucket(SIZE)  # 24
SHIPPED = sorted(tables.SHIPPED_DIR.glob("*.json"))  # before isolated_tables hides them
DOCS = tables.SHIPPED_DIR.parents[2] / "docs" / "tuning.md"

pytestmark = pytest.mark.usefixtures("isolated_tables")  # tests/conftest.py


@pytest.fixture(autouse=True)
def fresh_reads():
  """Tables read from files are cached per (path, mtime): none leaks between tests."""
  caches = (tables._read, tables._checked_file, tables._foreign)
  for cache in caches:
    cache.cache_clear()
  yield
  for cache in caches:
    cache.cache_clear()


def _ratios(centre: float, rounds: int, seed: int) -> list[float]:
  """Per-round time ratios spread evenly over ``centre`` +-5 %, in a random order: their
  median is ``centre``."""
  offsets = np.random.default_rng(seed).permutation(np.linspace(-0.05, 0.05, rounds))
  return list(centre * (1 + offsets))


def _runs(per_name, processes=("first", "second"), rounds=tables.MIN_ROUNDS):
  """One run per process: per candidate, ``rounds`` ratios around ``per_name[candidate]``."""
  return [
    tables.Run.of(
      {n: _ratios(r, rounds, seed=i * 10 + j) for j, (n, r) in enumerate(per_name.items())},
      process=process,
    )
    for i, process in enumerate(processes)
  ]


def _entry(choice=None, per_name=None, op="all_reduce", bucket=BUCKET, **kwargs):
  """The rule's entry of runs around ``per_name`` (default: lax_torus at 0.8x, shard_map
  at 1.6x), its choice then replaced by ``choice`` where given."""
  runs = _runs(per_name or {"lax_torus": 0.8, "shard_map": 1.6}, **kwargs)
  entry = tables.Entry.from_runs("2x4", op, "float32", bucket, runs)
  return entry if choice is None else dataclasses.replace(entry, choice=choice)


def _table(*entries, device_kind="cpu"):
  return tables.Table(device_kind, "test machine", tables.now(), list(entries))


UNMEASURED = tables.Entry("2x4", "all_reduce", "float32", BUCKET, "lax_torus", {}, 0)
SLOWER = _entry("lax_torus", {"lax_torus": 1.3, "shard_map": 1.6})  # choice edited


def _auto(op="all_reduce", nbytes=SIZE):
  return registry.auto_implementation(op, jnp.float32, nbytes=nbytes, torus=(2, 4))


def _install(table, how, tmp_path):
  """Puts ``table`` where "auto" reads it; returns the file it came from (None: none)."""
  if how == "cache":
    table.save(tables.cache_path())
    return str(tables.cache_path())
  if how == "shipped":
    return str(table.save(tables.SHIPPED_DIR / "cpu.json"))
  if how == "use_table":
    tables.use_table(table)
    return None
  path = table.save(tmp_path / "mine.json")
  tables.use_table(path)
  return str(path)


def _table_warnings(caught):
  return [str(w.message) for w in caught if issubclass(w.category, tables.TuningTableWarning)]


SOURCES = ["cache", "use_table", "use_table_file", "shipped"]


def test_the_user_cache_is_the_file_the_variable_names(tmp_path, monkeypatch):
  path = tmp_path / "elsewhere" / "mine.json"
  monkeypatch.setenv("TORUS_COLLECTIVES_TUNING", str(path))
  assert tables.cache_path() == path
  _table(UNMEASURED).save(path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert _auto() == "xla"
  (message,) = _table_warnings(caught)
  assert str(path) in message


@pytest.mark.parametrize("how", SOURCES)
@pytest.mark.parametrize(
  "entry,why",
  [
    (UNMEASURED, "it records no runs"),
    (
      SLOWER,
      "in run 1 of 2 (process first) its median time ratio to xla is 1.30 and the upper end "
      "of its bootstrap 95% interval",
    ),
  ],
  ids=["no-runs", "slower-edited"],
)
def test_an_entry_its_runs_do_not_support_leaves_xla_with_one_warning(entry, why, how, tmp_path):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    source = _install(_table(entry), how, tmp_path)
    choices = [_auto() for _ in range(3)]  # one warning per load, not per call
    choices.append(_auto(nbytes=1024 * MiB))  # a larger size, the same entry
  assert choices == ["xla"] * 4
  (message,) = _table_warnings(caught)
  assert "entry 2x4 all_reduce float32 16 MiB (size bucket 24)" in message
  assert f"of {source}:" in message if source else "the table passed to use_table" in message
  assert "it picks lax_torus, but " + why in message
  command = re.search(r"Measure it: `([^`]*)`", message).group(1)
  assert command.startswith("python -m torus_collectives.tuning ")
  assert (f" --output {source}" in command) == (how == "use_table_file")
  # The command is the tuner's own, and measures this entry's case and no other.
  args = tuner._parser().parse_args(shlex.split(command)[3:])
  assert (args.mesh, args.ops, args.dtypes, args.sizes) == ("2x4", "all_reduce", "float32", "16MiB")
  assert args.gradient_sizes == args.batch_norm_shapes == ""


@pytest.mark.parametrize(
  "op,bucket,expected",
  [
    ("reduce_scatter", 22, {"ops": "reduce_scatter", "sizes": "4MiB", "gradient_sizes": ""}),
    ("all_reduce_gradients", 24, {"ops": "", "gradient_sizes": "16MiB"}),
  ],
)
def test_the_suggested_command_measures_the_entry_and_nothing_else(op, bucket, expected):
  entry = tables.Entry("4x4", op, "bfloat16", bucket, "shard_map", {}, 0)
  command = tables.retune_command(entry, "/a dir/t.json")
  argv = shlex.split(command)
  assert argv[:3] == ["python", "-m", "torus_collectives.tuning"]
  args = tuner._parser().parse_args(argv[3:])
  assert (args.mesh, args.dtypes, args.output) == ("4x4", "bfloat16", "/a dir/t.json")
  assert args.batch_norm_shapes == ""
  assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize("how", SOURCES)
def test_an_entry_its_runs_support_is_read_without_a_warning(how, tmp_path):
  entry = _entry()
  assert entry.choice == "lax_torus"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _install(_table(entry), how, tmp_path)
    assert _auto() == "lax_torus"
    assert _auto(nbytes=1024 * MiB) == "lax_torus"
  assert _table_warnings(caught) == []


def test_a_table_the_tuner_wrote_keeps_working(monkeypatch):
  """Two tuning calls (as two processes) into the user cache, lax_torus at 0.8x of XLA's
  time: the table they write is read back from the file, without a warning."""

  def timer(name, call):
    return {"xla": 1.0, "lax_torus": 0.8}.get(name, 1.6)

  case = tuner.Case("all_reduce", "float32", SIZE, (2, 4), "fake", lambda name: lambda: None)
  for process in ("first", "second"):
    monkeypatch.setattr(tables, "PROCESS", process)
    tuner.tune_cases([case], rounds=tables.MIN_ROUNDS, timer=timer, progress=None, install=False)
  (entry,) = tables.Table.from_json(tables.cache_path().read_text()).entries
  assert entry.choice == "lax_torus" and len(entry.runs) == 2
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert _auto() == "lax_torus"
  assert _table_warnings(caught) == []


@pytest.mark.parametrize(
  "entry,why",
  [
    (
      _entry("lax_torus", processes=("only",)),
      "its runs come from 1 process(es), the rule needs 2",
    ),
    (
      _entry("lax_torus", processes=("same", "same")),
      "its runs come from 1 process(es), the rule needs 2",
    ),
    (
      _entry("lax_torus", rounds=tables.MIN_ROUNDS - 1),
      f"in run 1 of 2 (process first) {tables.MIN_ROUNDS - 1} rounds were timed, the rule "
      f"needs {tables.MIN_ROUNDS}",
    ),
    (_entry("pallas"), "in run 1 of 2 (process first) pallas was not timed"),
    (  # both pass; the rule picks the lower worst-case bound, not the edited choice
      _entry("shard_map", {"lax_torus": 0.6, "shard_map": 0.8}),
      "lax_torus has the lower worst-case bound in its runs, so the rule picks lax_torus",
    ),
    (  # one of the two runs within noise of XLA
      dataclasses.replace(
        _entry(),
        choice="lax_torus",
        runs=[_runs({"lax_torus": 0.8})[0], _runs({"lax_torus": 1.0})[1]],
      ),
      "in run 2 of 2 (process second) its median time ratio to xla is 1.00 and the upper end",
    ),
  ],
  ids=["one-run", "one-process", "few-rounds", "not-timed", "not-the-best", "one-run-fails"],
)
def test_what_the_rule_does_not_support(entry, why):
  assert tables.unsupported(entry) is not None and why in tables.unsupported(entry)
  with pytest.warns(tables.TuningTableWarning) as caught:
    tables.use_table(_table(entry))
  assert len(caught) == 1 and why in str(caught[0].message)
  assert _auto() == "xla"


def test_summary_figures_typed_into_a_table_are_not_trusted():
  """Runs at 1.3x of XLA's time whose recorded bounds, medians, round counts and choice
  were edited to pass: the rule reads the per-round ratios alone."""
  slow = SLOWER.runs
  forged = [
    dataclasses.replace(
      run,
      rounds=25,
      median={n: 0.5 for n in run.median},
      ci_high={n: 0.5 for n in run.ci_high},
    )
    for run in slow
  ]
  assert tables.decide(forged) == "lax_torus"  # what the recorded figures alone would say
  entry = dataclasses.replace(SLOWER, ratios={"lax_torus": 0.5}, rounds=25, runs=forged)
  path = _table(entry).save(tables.cache_path())
  # Through the file, as a user's edit would arrive.
  with pytest.warns(tables.TuningTableWarning, match="median time ratio to xla is 1.30"):
    assert _auto() == "xla"
  assert tables.Table.from_json(path.read_text()).entries == [entry]


@pytest.mark.parametrize(
  "runs",
  [
    [{"process": "a", "created": "", "rounds": 10, "ratios": {"lax_torus": "fast"}}],
    [{"process": "a", "created": "", "rounds": 10, "ratios": {"lax_torus": 0.5}}],
  ],
  ids=["text", "number"],
)
def test_runs_that_cannot_be_read_are_a_warning_not_a_crash(runs):
  data = json.loads(_table(_entry()).to_json())
  for run in runs:
    run.update(median={"lax_torus": 0.5}, ci_high={"lax_torus": 0.5})
  data["entries"][0]["runs"] = runs
  tables.cache_path().write_text(json.dumps(data))
  with pytest.warns(tables.TuningTableWarning, match="its runs cannot be read"):
    assert _auto() == "xla"


def test_an_xla_entry_needs_no_runs_and_stops_smaller_sizes_choice():
  """A bad entry is read as XLA for its key: the measured smaller size's choice does not
  cover it, and an XLA choice needs no support."""
  small = _entry(bucket=20)  # lax_torus from 1 MiB, measured
  xla = tables.Entry("2x4", "all_reduce", "float32", 22, "xla", {}, 0)
  with pytest.warns(tables.TuningTableWarning) as caught:
    tables.use_table(_table(small, xla, UNMEASURED))
  assert len(caught) == 1 and "size bucket 24" in str(caught[0].message)
  assert [_auto(nbytes=n) for n in (MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)] == [
    "lax_torus",
    "lax_torus",
    "xla",
    "xla",
    "xla",
  ]


def test_an_xla_choice_is_kept_silently_whatever_its_runs_say():
  """XLA is what "auto" promises not to lose to: an entry that keeps it, though its runs
  pass lax_torus (a choice set back by hand), is no promise broken."""
  entry = _entry("xla")
  assert tables.decide(entry.runs) == "lax_torus"
  assert tables.unsupported(entry) is None
  with warnings.catch_warnings():
    warnings.simplefilter("error", tables.TuningTableWarning)
    tables.use_table(_table(entry))
    assert _auto() == "xla"


def test_each_load_of_a_file_is_checked_once(tmp_path):
  path = _table(UNMEASURED).save(tables.cache_path())
  with pytest.warns(tables.TuningTableWarning) as caught:
    assert _auto() == _auto() == "xla"
  assert len(caught) == 1
  _table(UNMEASURED, _entry(bucket=26)).save(path)  # edited: read and checked again
  tables._read.cache_clear()  # in case the clock did not move the mtime
  tables._checked_file.cache_clear()
  with pytest.warns(tables.TuningTableWarning) as caught:
    assert _auto() == "xla" and _auto(nbytes=64 * MiB) == "lax_torus"
  assert len(caught) == 1


# Whole-step entries.

STEP_BYTES = 2560  # the gradient tree's bytes: size bucket 12
STEP_REQUEST = registry.Request(
  "all_reduce_gradients",
  dtypes=(jnp.dtype("float32"),),
  nbytes=STEP_BYTES,
  torus=(2, 4),
  names=("x", "y"),
  sizes=(2, 4),
  mesh_names=("x", "y"),
)
FAST_SMALL = "shard_map@1024"


def _step_entry(choice=None, per_name=None, **kwargs):
  per_name = per_name or {FAST_SMALL: 0.7, "xla@1024": 1.0, "shard_map@4194304": 1.1}
  runs = _runs(per_name, **kwargs)
  entry = tables.Entry.from_runs(
    "2x4", tables.STEP_OP, "float32", tables.size_bucket(STEP_BYTES), runs
  )
  return entry if choice is None else dataclasses.replace(entry, choice=choice)


@pytest.mark.parametrize("how", SOURCES)
@pytest.mark.parametrize(
  "entry,why",
  [
    (
      tables.Entry("2x4", tables.STEP_OP, "float32", 12, FAST_SMALL, {FAST_SMALL: 0.5}, 10),
      "it records no runs",
    ),
    (
      _step_entry(FAST_SMALL, {FAST_SMALL: 1.3, "xla@1024": 1.0}),
      "in run 1 of 2 (process first) its median time ratio to xla is 1.30",
    ),
  ],
  ids=["no-runs", "slower-edited"],
)
def test_a_step_entry_its_runs_do_not_support_leaves_xla(entry, why, how, tmp_path):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    source = _install(_table(entry), how, tmp_path)
    found = [registry.tuned_step(STEP_REQUEST) for _ in range(3)]
  assert found == [("xla", None)] * 3  # XLA, at the caller's bucket size
  (message,) = _table_warnings(caught)
  assert "entry 2x4 train_step float32 4 KiB (size bucket 12)" in message
  assert f"it picks {FAST_SMALL}, but {why}" in message
  into = source if how == "use_table_file" else None  # else the user cache, read first
  assert f"tune_step(make_step, args, output={into!r}), once in each of 2 processes" in message


@pytest.mark.parametrize("how", SOURCES)
def test_a_measured_step_entry_is_read(how, tmp_path):
  entry = _step_entry()
  assert entry.choice == FAST_SMALL
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _install(_table(entry), how, tmp_path)
    assert registry.tuned_step(STEP_REQUEST) == ("shard_map", 1024)
  assert _table_warnings(caught) == []


# The shipped tables.


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_tables_pass_the_check_unchanged(path):
  """Every shipped entry's choice is what the rule makes of its recorded per-round ratios
  (re-derived, not read), and the check reads the table as it is, silently."""
  table = tables.Table.from_json(path.read_text())
  assert table.entries
  for entry in table.entries:
    assert tables.unsupported(entry) is None, entry.key
    assert tables.decide(tables.rederived(entry.runs)) == entry.choice, entry.key
  with warnings.catch_warnings():
    warnings.simplefilter("error", tables.TuningTableWarning)
    assert tables.checked(table, str(path)) == table


def test_the_shipped_cpu_table_is_read_silently_and_leaves_xla(monkeypatch):
  (cpu,) = [p for p in SHIPPED if p.name == "cpu.json"]
  monkeypatch.setattr(tables, "SHIPPED_DIR", cpu.parent)
  with warnings.catch_warnings():
    warnings.simplefilter("error", tables.TuningTableWarning)
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_gradients"):
      assert _auto(op) == "xla"
    assert (
      registry.auto_implementation("all_reduce", jnp.bfloat16, nbytes=SIZE, torus=(2, 4)) == "xla"
    )


def test_the_docs_give_the_shipped_tables_closest_call():
  """What docs/tuning.md says of the shipped CPU table is the table's: the closest call (the
  candidate with the lowest worst-case bound) is the only one faster than XLA in the median
  of every run, yet passes no run."""
  (cpu,) = [p for p in SHIPPED if p.name == "cpu.json"]
  table = tables.Table.from_json(cpu.read_text())
  assert all(e.choice == "xla" for e in table.entries)  # "no candidate passed the rule"
  worst = {(e.key, n): max(r.ci_high[n] for r in e.runs) for e in table.entries for n in e.ratios}
  (key, name) = min(worst, key=worst.get)
  assert (key, name) == (("2x4", "all_reduce", "bfloat16", 24), "lax_torus")
  faster = [
    (e.key, n) for e in table.entries for n in e.ratios if all(r.median[n] < 1 for r in e.runs)
  ]
  assert faster == [(key, name)]
  (entry,) = [e for e in table.entries if e.key == key]
  assert all(r.ci_high[name] > tables.THRESHOLD and not r.passes(name) for r in entry.runs)

  text = " ".join(DOCS.read_text().split())
  assert "XLA wins everywhere" not in text
  assert (
    'No candidate passed the rule on CPUs, so the shipped `"auto"` is XLA there. XLA was '
    "not faster everywhere, though. The closest call is lax_torus for a bfloat16 all-reduce "
    "of 16 MiB: its median time ratio to XLA's is below 1 in both runs (its row above), "
    "faster in both, but the upper end of its interval is above the threshold in each, so "
    "it passes neither run."
  ) in text


# Where "auto" reads.


def test_cache_path_from_the_variable_then_xdg_then_home(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  monkeypatch.setenv("TORUS_COLLECTIVES_TUNING", str(tmp_path / "set.json"))
  assert tables.cache_path() == tmp_path / "set.json"
  monkeypatch.setenv("TORUS_COLLECTIVES_TUNING", "~/mine.json")
  assert tables.cache_path() == tmp_path / "home" / "mine.json"
  monkeypatch.setenv("TORUS_COLLECTIVES_TUNING", "")  # empty: unset
  assert tables.cache_path() == tmp_path / "xdg" / "torus_collectives" / "tuning.json"
  monkeypatch.delenv("TORUS_COLLECTIVES_TUNING")
  assert tables.cache_path() == tmp_path / "xdg" / "torus_collectives" / "tuning.json"
  monkeypatch.setenv("XDG_CACHE_HOME", "")
  assert tables.cache_path() == tmp_path / "home" / ".cache" / "torus_collectives" / "tuning.json"
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert tables.cache_path() == tmp_path / "home" / ".cache" / "torus_collectives" / "tuning.json"


def test_auto_reads_the_cache_where_cache_path_points(tmp_path, monkeypatch):
  monkeypatch.delenv("TORUS_COLLECTIVES_TUNING")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert _auto() == "xla"
  _table(_entry()).save(tmp_path / "xdg" / "torus_collectives" / "tuning.json")
  assert _auto() == "lax_torus"


def test_a_missing_cache_file_is_no_table_and_no_warning(tmp_path, monkeypatch):
  monkeypatch.setenv("TORUS_COLLECTIVES_TUNING", str(tmp_path / "no" / "such.json"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", tables.TuningTableWarning)
    assert tables.tables("cpu") == []
    assert _auto() == "xla"


@pytest.mark.parametrize(
  "write,match",
  [
    (lambda p: p.mkdir(), "Is a directory"),  # cannot be read as a file
    (lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "codec can't decode"),
    (lambda p: p.write_text(""), "not a tuning table"),
    (lambda p: p.write_text('{"format": 2, "entries": [{"topology": "2x4"'), "not a tuning"),
    (lambda p: p.write_text("[]"), "not a tuning table"),
    (lambda p: p.write_text('{"format": 2}'), "not a tuning table"),
    (lambda p: p.write_text('{"format": 2, "entries": null}'), "not a tuning table"),
  ],
  ids=["directory", "binary", "empty", "truncated", "list", "no-entries", "null-entries"],
)
def test_an_unreadable_or_corrupt_cache_warns_once_and_leaves_xla(write, match):
  write(tables.cache_path())
  with pytest.warns(tables.TuningTableWarning, match=match) as caught:
    assert _auto() == _auto() == "xla"
  assert len(caught) == 1 and str(tables.cache_path()) in str(caught[0].message)


def test_a_corrupt_cache_does_not_hide_the_shipped_table():
  _table(_entry()).save(tables.SHIPPED_DIR / "cpu.json")
  tables.cache_path().write_text("{not json")
  with pytest.warns(tables.TuningTableWarning, match="not a tuning table"):
    assert _auto() == "lax_torus"


# The latency floor, derived by hand.
#
# The floor is the size S at which the modelled all-reduce's latency term equals its
# bandwidth term: alpha (1 us) per step and hop, against the bytes of each step's busiest
# link at B bytes/s one way. Off TPU a 2-D torus takes v5e's link (B = 50 GB/s), a 3-D one
# v5p's (100 GB/s); v4 has 50 GB/s links and 3 axes, v5p and v6e 100 GB/s, v3 82 GB/s.
# The schedule (TORUS_SPLIT) runs one stream per axis order and direction, chunks of
# S / p / streams:
#
# * n x n (4 streams, one per directed link at every step): 4(n-1) steps of one hop, and
#   the bytes of one stream, 2(p-1)/p S / 4, at B: S = 4(n-1) alpha / ((p-1) / (2 p B))
#   = 8 (n-1) p alpha B / (p-1). 4x4: 8 * 3 * 16/15 * alpha B = 25.6 alpha B.
# * 2 x 4 (p = 8, chunk c = S/32): 8 steps. The x-first streams move 4c, c, c, c, c, c, c,
#   4c; the y-first ones 2c, 2c, 2c, c, c, 2c, 2c, 2c; on a step where both cross the same
#   directed links (y) they add: the busiest links carry 4, 3, 3, 1, 1, 3, 3, 4 = 22 c.
#   S = 8 alpha B * 32 / 22 = 11.636 alpha B.
# * 8 (a ring; the schedule of 1 x 8): 14 steps, each with 2 streams of c = S/32 on every
#   directed link: S = 14 alpha B * 32 / 28 = 16 alpha B.
# * n x n x n (6 streams, one per directed link): 6(n-1) steps, 2(p-1)/p S / 6 at B:
#   S = 18 (n-1) p alpha B / (p-1). 2x2x2: 144/7 alpha B; 4x4x4: 3456/63 alpha B.
FLOORS = [
  ((4, 4), "cpu", 1_280_000),  # 25.6 * 1 us * 50 GB/s
  ((4, 4), "TPU v5 lite", 1_280_000),
  ((4, 4), "TPU v4", 1_280_000),  # 3-D generation, 2-D torus: its own 50 GB/s links
  ((4, 4), "TPU v5", 2_560_000),  # v5p: 100 GB/s
  ((4, 4), "TPU v6 lite", 2_560_000),
  ((4, 4), "TPU v3", 2_099_200),  # 25.6 * 82,000
  ((2, 4), "cpu", 581_818),  # 11.636 * 50,000
  ((2, 1, 4), "cpu", 581_818),  # unit axes do not count
  ((8,), "cpu", 800_000),  # 16 * 50,000
  ((8, 1), "TPU v5", 1_600_000),
  ((2, 2, 2), "TPU v4", 1_028_571),  # 144/7 * 50,000
  ((2, 2, 2), "TPU v5", 2_057_142),  # 144/7 * 100,000
  ((2, 2, 2), "cpu", 2_057_142),  # 3 axes off TPU: v5p's links
  ((2, 2, 2), "TPU v5 lite", 2_057_142),  # 3 axes on a 2-D generation: v5p's links
  ((4, 4, 4), "TPU v5", 5_485_714),  # 3456/63 * 100,000
  ((), "cpu", 0),
  ((1, 1), "TPU v4", 0),
]


@pytest.mark.parametrize("torus,device_kind,expected", FLOORS, ids=str)
def test_latency_floor_bytes(torus, device_kind, expected):
  assert tables.latency_floor_bytes(torus, device_kind) == expected


def test_auto_is_xla_below_the_floor_whatever_a_table_says():
  tables.use_table(_table(_entry(bucket=0)))  # measured "faster" from 1 byte up
  assert _auto(nbytes=581_818) == "lax_torus"
  assert _auto(nbytes=581_817) == "xla"


# Rendering.


def test_format_table_renders_every_run_and_the_choice():
  def run(process, median, bound):
    return tables.Run(process, "2026-01-02T00:00:00+00:00", 25, {}, median, bound)

  measured = tables.Entry(
    "2x4",
    "all_reduce",
    "bfloat16",
    24,
    "xla",
    {"lax_torus": 0.9304, "shard_map": 1.7349},
    25,
    [
      run("a", {"lax_torus": 0.9304, "shard_map": 1.7349}, {"lax_torus": 1.0073, "shard_map": 1.8}),
      run("b", {"lax_torus": 0.8734}, {"lax_torus": 0.955}),
    ],
  )
  typed = tables.Entry("2x4", "all_gather", "float32", 20, "lax_torus", {"lax_torus": 0.5}, 10)
  table = tables.Table("cpu", "a test machine", "2026-01-02T03:04:05+00:00", [measured, typed])
  assert tables.format_table(table) == "\n".join(
    [
      "Tuned 2026-01-02T03:04:05+00:00 on a test machine (device kind 'cpu'). Each cell: the "
      "median per-round time ratio to xla, and the upper end of its bootstrap 95% interval, "
      "per run. auto = a candidate whose upper end is <= 0.95 in each of 2 runs in different "
      "processes, else xla. A row holds from its size up to the next measured one.",
      "",
      "| topology | op | dtype | size | lax_torus t/t_xla [CI high] | shard_map t/t_xla "
      "[CI high] | rounds | auto |",
      "|---|---|---|---|---|---|---|---|",
      "| 2x4 | all_gather | float32 | 1 MiB | 0.50 | - | 10 | lax_torus |",
      "| 2x4 | all_reduce | bfloat16 | 16 MiB | 0.93 [1.007], 0.87 [0.955] | 1.73 [1.800] | 25 "
      "| xla |",
    ]
  )
