"""The tuning tables that "auto" reads, and the rule that turns timings into a choice.

A table records what ``python -m torus_collectives.tuning`` measured on one kind of device:
for each (device kind, topology, op, dtype, size bucket), the implementation "auto" runs
and the timings behind that choice. A whole-train-step entry (op ``STEP_OP``, written by
``tuning.step_tuning``) chooses among ``step_variant`` names, (implementation, bucket size)
pairs, by the same rule, and is read for its own size bucket only (``lookup(...,
exact=True)``). "auto" reads, most specific first:

1. a table passed explicitly: ``use_table(path_or_table)`` (``tuning.tuner`` installs its own);
2. the user cache, ``$TORUS_COLLECTIVES_TUNING`` or else
   ``$XDG_CACHE_HOME/torus_collectives/tuning.json`` (``~/.cache/...``), where the tuner
   writes by default;
3. the tables shipped in the package (``torus_collectives/tuning/tuned/*.json``), with the date and
   the machine they were measured on.

The first of them with a measurement for (device kind, topology, op, dtype) at or below the
size decides, from the largest measured size bucket that is not above the size. With no
measurement "auto" is XLA, and says once how to tune. Below ``latency_floor_bytes`` (where
the cost model's per-hop latency outweighs its bandwidth term) "auto" is XLA without
looking: no schedule can win there against XLA's single fused collective.

Several processes must read the same table, or they would compile different programs:
``tuning.tuner`` decides on process 0's timings and installs the result on every process; a file
passed to ``use_table`` must be the same file everywhere.

The decision rule (``decide``), and what it assumes. XLA is the default; a torus
implementation replaces it only if it beats XLA with confidence, in more than one process:

* One *run* is one tuning of one case in one process: ``tuning.timing.Interleaved`` gives
  ``rounds`` per-round time ratios ``t_candidate / t_xla``. A candidate *passes* a run if
  the upper end of the two-sided bootstrap ``CONFIDENCE`` (95 %) interval of the median of
  those ratios is at most ``THRESHOLD`` (0.95): ``BOOTSTRAP_RESAMPLES`` resamples drawn by
  numpy with the fixed seed ``BOOTSTRAP_SEED``, so one set of ratios always gives one
  bound. A run of fewer than ``MIN_ROUNDS`` rounds, or with a ratio that is not a finite
  number, passes nothing.
* An entry keeps its newest ``MIN_RUNS`` (2) runs, each from a different process (the
  tuner records its process's random id, ``PROCESS``; a newer run from the same process
  replaces the older). The choice is the candidate that passes *every* kept run, with the
  lowest worst-case bound; with fewer than ``MIN_RUNS`` runs, or no candidate passing all,
  XLA. ``python -m torus_collectives.tuning`` therefore times in ``MIN_RUNS`` fresh
  subprocesses; a tuning call inside a program (``tuning.tuner.tune_cases``) adds one run to what
  its output file already holds, so it takes a second process to confirm a choice.
* Why two processes: the bootstrap interval accounts for noise between rounds of one run,
  not for what stays fixed within a process (memory layout, thread placement, what else
  the machine runs for minutes). docs/tuning.md ("Why two processes") records the runs,
  each in its own process, that showed one process's fluke.
* Assumptions: rounds of a run are exchangeable (the random order of ``tuning.timing`` serves
  this), and what a candidate gains over XLA holds for the sizes of its bucket and up to
  the next measured one (``lookup``). ``python -m torus_collectives.tuning --validate TABLE``
  re-measures a table and reports whether each entry still holds (``holds``).

What is skipped, and how loudly: a table that cannot be read, or was written by another
table format or package version, is ignored with a ``TuningTableWarning``; so is a table
passed to ``use_table`` or in the user cache that was measured on another device kind.
The shipped tables for other device kinds are skipped silently, by design: the package
ships tables for several kinds, and all but one never apply.

Every table "auto" reads is checked entry by entry (``checked``), whichever way it came:
``use_table``, the user cache, the shipped tables. An entry's ``choice`` is not trusted: the
rule is applied again to its recorded per-round ratios (``unsupported``: each run's rounds,
median and bound re-derived from them, ``rederived``, then ``decide``), and an entry whose
runs do not give its choice (none recorded, one process's only, too few rounds, a bound
above the threshold, an edited choice) is read as XLA for its key, with one
``TuningTableWarning`` per such entry and load of the table that names the entry, where it
came from, and the command that measures it (``retune_command``). An XLA choice needs no
runs: XLA is what "auto" runs unmeasured.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import shlex
import tempfile
import uuid
import warnings
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from torus_collectives import cost_model
from torus_collectives import schedule as schedule_lib
from torus_collectives.axes import drop_unit_axes
from torus_collectives.sizes import size_label

FORMAT = 2
# The rule (see the module docstring): a torus implementation replaces XLA only if, in each
# of MIN_RUNS runs from different processes, the upper end of the bootstrap CONFIDENCE
# interval of its median per-round time ratio to XLA is at most THRESHOLD.
THRESHOLD = 0.95
MIN_RUNS = 2
CONFIDENCE = 0.95
MIN_ROUNDS = 10
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
PROCESS = uuid.uuid4().hex[:16]  # this process's id in the runs it records
ENV_VAR = "TORUS_COLLECTIVES_TUNING"
SHIPPED_DIR = pathlib.Path(__file__).with_name("tuned")
BASELINE = "xla"
TUNE_COMMAND = "python -m torus_collectives.tuning"
# The op of a whole-train-step entry (``tuning.step_tuning``): its candidates are
# ``step_variant`` names, (gradient-summation implementation, bucket size) pairs.
STEP_OP = "train_step"

_log = logging.getLogger("torus_collectives")


class TuningTableWarning(UserWarning):
  """A tuning table was ignored (unreadable, foreign, or from another version)."""


def package_version() -> str:
  try:
    return importlib.metadata.version("torus-collectives")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def cache_path() -> pathlib.Path:
  """Where the tuner writes and "auto" reads the user's own measurements."""
  if os.environ.get(ENV_VAR):
    return pathlib.Path(os.environ[ENV_VAR]).expanduser()
  root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(root) / "torus_collectives" / "tuning.json"


def topology(torus: Sequence[int]) -> str:
  """The key of a torus: its axis sizes, e.g. ``"2x4"``."""
  return "x".join(str(int(n)) for n in torus)


def size_bucket(nbytes: int) -> int:
  """Size class of a buffer: ``ceil(log2(nbytes))`` (a bucket holds (2^(b-1), 2^b])."""
  return max(0, int(nbytes) - 1).bit_length()


# ----------------------------------------------------------------------------------------
# The decision rule.


def ci_high(ratios: Sequence[float]) -> float:
  """Upper end of the two-sided bootstrap ``CONFIDENCE`` interval of the median of
  ``ratios`` (percentile bootstrap, ``BOOTSTRAP_RESAMPLES`` resamples, seed
  ``BOOTSTRAP_SEED``: deterministic). Infinite for no ratios or any non-finite one."""
  r = np.asarray(ratios, np.float64)
  if r.size == 0 or not np.all(np.isfinite(r)):
    return math.inf
  rng = np.random.default_rng(BOOTSTRAP_SEED)
  medians = np.median(r[rng.integers(0, r.size, (BOOTSTRAP_RESAMPLES, r.size))], axis=1)
  return float(np.quantile(medians, 1 - (1 - CONFIDENCE) / 2))


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of one case in one process: what a decision rests on.

  Attributes:
    process: the id of the process that measured it (``PROCESS`` there).
    created: when.
    rounds: timed rounds.
    ratios: per candidate, the per-round time ratios to XLA, in round order.
    median: per candidate, the median of ``ratios``.
    ci_high: per candidate, ``ci_high(ratios)``: what the rule compares to ``THRESHOLD``.
  """

  process: str
  created: str
  rounds: int
  ratios: dict[str, list[float]]
  median: dict[str, float]
  ci_high: dict[str, float]

  @classmethod
  def of(cls, ratios: Mapping[str, Sequence[float]], process: str | None = None) -> Run:
    """The run of these per-round ratios, measured in ``process`` (default: this one)."""
    # The ratios as recorded (4 decimals) are what the median and bound are computed
    # from, so that a reader re-derives the same figures from the table (``rederived``).
    ratios = {n: [round(float(v), 4) for v in r] for n, r in ratios.items() if n != BASELINE}
    rounds = min((len(r) for r in ratios.values()), default=0)
    return cls(
      process=PROCESS if process is None else process,
      created=now(),
      rounds=rounds,
      ratios=ratios,
      median={n: round(float(np.median(r)), 4) if r else math.inf for n, r in ratios.items()},
      ci_high={n: round(ci_high(r), 4) for n, r in ratios.items()},
    )

  def passes(self, name: str, threshold: float = THRESHOLD) -> bool:
    """Whether ``name`` beats XLA with confidence in this run."""
    bound = self.ci_high.get(name, math.inf)
    return self.rounds >= MIN_ROUNDS and math.isfinite(bound) and bound <= threshold


def kept_runs(runs: Sequence[Run]) -> list[Run]:
  """The newest ``MIN_RUNS`` of ``runs`` (oldest first), one per process: a later run of a
  process replaces its earlier one."""
  latest: dict[str, Run] = {}
  for run in runs:
    latest.pop(run.process, None)
    latest[run.process] = run
  return list(latest.values())[-MIN_RUNS:]


def passing(runs: Sequence[Run], threshold: float = THRESHOLD) -> dict[str, float]:
  """The candidates that pass every one of at least ``MIN_RUNS`` runs from distinct
  processes, each with its worst (largest) bound over them; empty if too few runs."""
  runs = kept_runs(runs)
  if len(runs) < MIN_RUNS:
    return {}
  names = set.intersection(*(set(r.ci_high) for r in runs)) - {BASELINE}
  return {
    n: max(r.ci_high[n] for r in runs)
    for n in sorted(names)
    if all(r.passes(n, threshold) for r in runs)
  }


def decide(runs: Sequence[Run], threshold: float = THRESHOLD) -> str:
  """The implementation to run, by the rule of the module docstring: of the candidates
  that pass every kept run, the one with the lowest worst-case bound; otherwise XLA."""
  if not 0 < threshold < 1:
    raise ValueError(f"{threshold=} must be in (0, 1)")
  ok = passing(runs, threshold)
  return min(ok, key=ok.get) if ok else BASELINE


# Off TPU no interconnect is modelled; the floor then uses v5e's constants, an assumption,
# and v5p's (six links) for a torus of three axes.
_DEFAULT_GENERATION = "v5e"
_DEFAULT_3D_GENERATION = "v5p"


@functools.cache
def latency_floor_bytes(torus: tuple[int, ...], device_kind: str) -> int:
  """Bytes below which the modelled torus all-reduce spends more time in per-hop latency
  than in moving data: "auto" is XLA there without a measurement."""
  (kept,) = drop_unit_axes(torus)
  if not kept:
    return 0
  name = cost_model.generation_of(device_kind) or _DEFAULT_GENERATION
  generation = cost_model.GENERATIONS[name]
  if len(kept) > generation.links_per_chip // 2:
    generation = cost_model.GENERATIONS[_DEFAULT_3D_GENERATION]
  physical = kept if len(kept) >= 2 else (1,) + kept
  variant = schedule_lib.default_variant(physical)
  pred = cost_model.predict("all_reduce", physical, variant, 1.0, generation)
  return int(pred.latency_s / pred.bandwidth_s)


def step_variant(implementation: str, bucket_bytes: int | None = None) -> str:
  """The candidate name of one variant of a train step: ``"shard_map@4194304"`` (the
  gradient summation's implementation, ``@`` its bucket size in bytes); with no bucket size
  (the caller's, the baseline's) the implementation's name alone, so that the baseline
  variant is ``BASELINE``."""
  return implementation if bucket_bytes is None else f"{implementation}@{int(bucket_bytes)}"


def parse_step_variant(name: str) -> tuple[str, int | None]:
  """``(implementation, bucket bytes or None)`` of a ``step_variant`` name."""
  implementation, _, bucket = name.partition("@")
  return implementation, int(bucket) if bucket else None


# ----------------------------------------------------------------------------------------
# Tables.


@dataclasses.dataclass(frozen=True)
class Entry:
  """One measured case: the choice for an (op, dtype, size bucket) and the runs behind it.

  ``ratios`` and ``rounds`` summarise ``runs`` for reading: per candidate the largest
  per-run median ratio, and the fewest rounds of a run. The choice is ``decide(runs)``
  when the tuner writes it (``from_runs``); "auto" reads any other entry's choice, one
  made by hand without runs or edited, as XLA (``checked``).
  """

  topology: str
  op: str
  dtype: str
  bucket: int
  choice: str
  ratios: dict[str, float]  # per candidate, the largest per-run median time ratio to XLA
  rounds: int
  runs: list[Run] = dataclasses.field(default_factory=list)

  @property
  def key(self) -> tuple[str, str, str, int]:
    return (self.topology, self.op, self.dtype, self.bucket)

  @classmethod
  def from_runs(cls, topology: str, op: str, dtype: str, bucket: int, runs: Sequence[Run]) -> Entry:
    """The entry the rule makes of ``runs`` (only the kept ones are recorded)."""
    runs = kept_runs(runs)
    names = sorted({n for r in runs for n in r.median})
    return cls(
      topology=topology,
      op=op,
      dtype=dtype,
      bucket=bucket,
      choice=decide(runs),
      ratios={n: max(r.median.get(n, math.inf) for r in runs) for n in names},
      rounds=min((r.rounds for r in runs), default=0),
      runs=runs,
    )


def holds(entry: Entry, fresh: Sequence[Run]) -> bool:
  """Whether ``entry``'s choice still holds on the ``fresh`` runs of its case: an XLA entry
  always does (XLA is the reference "auto" promises not to lose to); a torus choice does
  if it passes every one of at least ``MIN_RUNS`` fresh runs (``passing``)."""
  return entry.choice == BASELINE or entry.choice in passing(fresh)


# ----------------------------------------------------------------------------------------
# The check every table passes before "auto" reads it.


def rederived(runs: Sequence[Run]) -> list[Run]:
  """``runs`` as the rule reads a table: each run's rounds, medians and bounds computed
  again from its recorded per-round ratios (``Run.of``), so that no summary figure typed
  into a table counts. Raises TypeError or ValueError on ratios that are not numbers."""
  return [Run.of(run.ratios, process=run.process) for run in runs]


def unsupported(entry: Entry) -> str | None:
  """Why ``entry``'s recorded runs do not give its choice by the rule (``decide`` of
  ``rederived`` runs), or None where they do. An XLA choice needs no runs."""
  choice = entry.choice
  if choice == BASELINE:
    return None
  try:
    runs = kept_runs(rederived(entry.runs))
  except (TypeError, ValueError, AttributeError) as e:
    return f"its runs cannot be read ({e})"
  picked = decide(runs)
  if picked == choice:
    return None
  if not runs:
    return "it records no runs"
  if len(runs) < MIN_RUNS:
    return f"its runs come from {len(runs)} process(es), the rule needs {MIN_RUNS}"
  for i, run in enumerate(runs, 1):
    where = f"in run {i} of {len(runs)} (process {run.process})"
    if choice not in run.ratios:
      return f"{where} {choice} was not timed"
    if run.rounds < MIN_ROUNDS:
      return f"{where} {run.rounds} rounds were timed, the rule needs {MIN_ROUNDS}"
    if not run.passes(choice):
      return (
        f"{where} its median time ratio to {BASELINE} is {run.median[choice]:.2f} and the "
        f"upper end of its bootstrap {CONFIDENCE:.0%} interval {run.ci_high[choice]:.3f}, "
        f"above {THRESHOLD:.2f}"
      )
  return f"{picked} has the lower worst-case bound in its runs, so the rule picks {picked}"


def retune_command(entry: Entry, output: str | None = None) -> str:
  """The command that measures ``entry``'s case again (into ``output``; None: the user
  cache, which "auto" reads before the shipped tables)."""
  size = size_label(2**entry.bucket, sep="")
  to = f" --output {shlex.quote(output)}" if output else ""
  mesh = f"{TUNE_COMMAND} --mesh {entry.topology} --dtypes {entry.dtype}"
  if entry.op in ("all_reduce", "reduce_scatter", "all_gather"):
    return f"{mesh} --ops {entry.op} --sizes {size} --gradient-sizes= --batch-norm-shapes={to}"
  if entry.op == "all_reduce_gradients":
    return f"{mesh} --ops= --gradient-sizes {size} --batch-norm-shapes={to}"
  if entry.op == STEP_OP:
    into = f"output={output!r}" if output else "output=None"
    return (
      f"torus_collectives.tuning.step_tuning.tune_step(make_step, args, {into}), once in "
      f"each of {MIN_RUNS} processes"
    )
  return f"{mesh} --ops= --gradient-sizes= --batch-norm-shapes=NxHxWxC{to}"


def checked(table: Table, source: str | None = None, output: str | None = None) -> Table:
  """``table`` as "auto" reads it: each entry whose runs do not support its choice
  (``unsupported``) is read as XLA for its key, with one ``TuningTableWarning`` naming the
  entry, ``source`` (the file it came from; None: a table passed to ``use_table``) and the
  command that measures it again (``retune_command``, into ``output``)."""
  entries = []
  for entry in table.entries:
    why = unsupported(entry)
    if why is not None:
      warnings.warn(
        f"ignoring the tuning table entry {entry.topology} {entry.op} {entry.dtype} "
        f"{size_label(2**entry.bucket)} (size bucket {entry.bucket}) of "
        f"{source or 'the table passed to use_table'}: it picks {entry.choice}, but {why}; "
        f'"auto" runs {BASELINE} there. A candidate replaces {BASELINE} only if the upper '
        f"end of the bootstrap {CONFIDENCE:.0%} interval of its median per-round time ratio "
        f"to {BASELINE} is at most {THRESHOLD:.2f} in each of {MIN_RUNS} runs of at least "
        f"{MIN_ROUNDS} rounds in different processes. Measure it: "
        f"`{retune_command(entry, output)}`",
        TuningTableWarning,
        stacklevel=3,
      )
      entry = dataclasses.replace(entry, choice=BASELINE)
    entries.append(entry)
  return dataclasses.replace(table, entries=entries)


@dataclasses.dataclass
class Table:
  """What the tuner measured on one kind of device."""

  device_kind: str
  machine: str
  created: str
  entries: list[Entry]
  threshold: float = THRESHOLD
  min_runs: int = MIN_RUNS
  version: str = dataclasses.field(default_factory=package_version)
  format: int = FORMAT

  def lookup(
    self, torus: Sequence[int], op: str, dtype: str, nbytes: int, exact: bool = False
  ) -> Entry | None:
    """The entry of the largest measured bucket not above ``nbytes``'s (``exact``: of
    ``nbytes``'s bucket itself), or None."""
    bucket, topo = size_bucket(nbytes), topology(torus)
    found = [
      e
      for e in self.entries
      if (e.topology, e.op, e.dtype) == (topo, op, dtype)
      and (e.bucket == bucket if exact else e.bucket <= bucket)
    ]
    return max(found, key=lambda e: e.bucket) if found else None

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> Table:
    """Parses a table; raises ValueError on anything malformed."""
    try:
      data = json.loads(text)
      if data.get("format") != FORMAT:
        raise ValueError(
          f"not a tuning table of format {FORMAT} (its format: {data.get('format')}); "
          f"run `{TUNE_COMMAND}` again"
        )
      entries = []
      for e in data.pop("entries"):
        runs = [Run(**r) for r in e.pop("runs", [])]
        entries.append(Entry(**e, runs=runs))
      for e in entries:
        if not (isinstance(e.choice, str) and isinstance(e.bucket, int)):
          raise ValueError(f"malformed entry {e}")
      return cls(entries=entries, **data)
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
      raise ValueError(f"not a tuning table: {e}") from e

  def save(self, path: str | os.PathLike) -> pathlib.Path:
    """Writes the table atomically (a reader never sees half a file)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
      f.write(self.to_json())
    os.replace(f.name, path)
    return path

  def merged_into(self, older: Table | None) -> Table:
    """This table plus ``older``'s entries (same device kind, format and rule): an entry
    of both keeps the newest runs of the two (``kept_runs``) and is decided again; an
    entry of ``older`` alone is kept as it is."""
    if older is None or (older.device_kind, older.format, older.threshold, older.min_runs) != (
      self.device_kind,
      self.format,
      self.threshold,
      self.min_runs,
    ):
      return self
    old = {e.key: e for e in older.entries}
    mine = {e.key for e in self.entries}
    entries = [e for e in older.entries if e.key not in mine]
    for e in self.entries:
      runs = (old[e.key].runs if e.key in old else []) + e.runs
      entries.append(Entry.from_runs(*e.key, runs))
    return dataclasses.replace(self, entries=entries)


def now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def format_table(table: Table) -> str:
  """The table as markdown: one row per entry, with what each choice rests on."""
  names = sorted({n for e in table.entries for n in e.ratios})
  lines = [
    f"Tuned {table.created} on {table.machine} (device kind {table.device_kind!r}). "
    f"Each cell: the median per-round time ratio to xla, and the upper end of its bootstrap "
    f"{CONFIDENCE:.0%} interval, per run. auto = a candidate whose upper end is <= "
    f"{table.threshold:.2f} in each of {table.min_runs} runs in different processes, else "
    "xla. A row holds from its size up to the next measured one.",
    "",
    "| topology | op | dtype | size | "
    + " | ".join(f"{n} t/t_xla [CI high]" for n in names)
    + " | rounds | auto |",
    "|---" * (6 + len(names)) + "|",
  ]
  for e in sorted(table.entries, key=lambda e: e.key):
    cells = [_cell(e, n) for n in names]
    lines.append(
      f"| {e.topology} | {e.op} | {e.dtype} | {size_label(2**e.bucket)} | "
      + " | ".join(cells)
      + f" | {e.rounds} | {e.choice} |"
    )
  return "\n".join(lines)


def _cell(entry: Entry, name: str) -> str:
  if not entry.runs:
    return f"{entry.ratios[name]:.2f}" if name in entry.ratios else "-"
  parts = [f"{r.median[name]:.2f} [{r.ci_high[name]:.3f}]" for r in entry.runs if name in r.median]
  return ", ".join(parts) or "-"


# ----------------------------------------------------------------------------------------
# Where "auto" reads.

_explicit: Table | None = None


def use_table(table: Table | str | os.PathLike | None) -> None:
  """Makes ``table`` (or the table in the file at that path) the first one "auto" reads;
  None removes it. Call it with the same table on every process. Its entries are
  ``checked`` now: one whose runs do not support its choice is read as XLA, with a
  ``TuningTableWarning``."""
  global _explicit
  if table is None:
    _explicit = None
  elif isinstance(table, Table):
    _explicit = checked(table)
  else:
    _explicit = checked(Table.from_json(pathlib.Path(table).read_text()), str(table), str(table))


@functools.cache
def _read(path: str, mtime: float) -> Table | None:
  """The table at ``path``, or None (with a warning) if it cannot be used at all."""
  del mtime  # part of the cache key: an edited file is read again
  try:
    table = Table.from_json(pathlib.Path(path).read_text())
  except (OSError, ValueError) as e:
    warnings.warn(f"ignoring tuning table {path}: {e}", TuningTableWarning, stacklevel=2)
    return None
  if table.format != FORMAT or table.version != package_version():
    warnings.warn(
      f"ignoring tuning table {path}: written by format {table.format} of "
      f"torus-collectives {table.version}, this is format {FORMAT} of {package_version()}; "
      f"run `{TUNE_COMMAND}` again",
      TuningTableWarning,
      stacklevel=2,
    )
    return None
  return table


@functools.cache
def _checked_file(path: str, mtime: float) -> Table:
  """The readable table at ``path``, ``checked`` once per version of the file (one warning
  per entry the rule does not support). The command it suggests writes to the user cache,
  which "auto" reads before the shipped tables."""
  return checked(_read(path, mtime), path)


@functools.cache
def _foreign(path: str, mtime: float, table_kind: str, device_kind: str) -> None:
  del mtime
  warnings.warn(
    f"ignoring tuning table {path}: measured on {table_kind!r}, not on {device_kind!r}; "
    f"run `{TUNE_COMMAND}` on this device kind",
    TuningTableWarning,
    stacklevel=3,
  )


def _from_file(path: pathlib.Path, device_kind: str, shipped: bool) -> Table | None:
  try:
    mtime = path.stat().st_mtime
  except OSError:
    return None
  table = _read(str(path), mtime)
  if table is None:
    return None
  if table.device_kind == device_kind:
    return _checked_file(str(path), mtime)
  if not shipped:  # shipped tables for other device kinds are expected, not an error
    _foreign(str(path), mtime, table.device_kind, device_kind)
  return None


def tables(device_kind: str) -> list[Table]:
  """The tables "auto" consults for ``device_kind``, most specific first."""
  out = []
  if _explicit is not None:
    if _explicit.device_kind == device_kind:
      out.append(_explicit)
    else:
      _foreign("(use_table)", 0.0, _explicit.device_kind, device_kind)
  for path, shipped in [(cache_path(), False)] + [
    (p, True) for p in sorted(SHIPPED_DIR.glob("*.json"))
  ]:
    table = _from_file(path, device_kind, shipped)
    if table is not None:
      out.append(table)
  return out


def lookup(
  device_kind: str, torus: Sequence[int], op: str, dtype, nbytes: int, exact: bool = False
) -> str | None:
  """The measured choice for this call, or None when nothing was measured (``exact``: in
  the size bucket of ``nbytes`` itself, as whole-step entries are read)."""
  name = jnp.dtype(dtype).name
  for table in tables(device_kind):
    entry = table.lookup(torus, op, name, nbytes, exact)
    if entry is not None:
      return entry.choice
  return None


@functools.cache
def log_unmeasured(device_kind: str, torus: tuple[int, ...]) -> None:
  """Says once per (device kind, topology) that "auto" is XLA for want of a measurement."""
  _log.warning(
    'torus_collectives: nothing measured on %r for topology %s, so implementation="auto" '
    "runs XLA. Run `%s` on this machine and mesh to measure the torus implementations.",
    device_kind,
    topology(torus),
    TUNE_COMMAND,
  )
