"""The tuning tables that "auto" reads, and the rule that turns timings into a choice.

A table records what ``python -m torus_collectives.tune`` measured on one kind of device:
for each (device kind, topology, op, dtype, size bucket), the implementation "auto" runs
and the timings behind that choice. "auto" reads, most specific first:

1. a table passed explicitly: ``use_table(path_or_table)`` (``tune`` installs its own);
2. the user cache, ``$TORUS_COLLECTIVES_TUNING`` or else
   ``$XDG_CACHE_HOME/torus_collectives/tuning.json`` (``~/.cache/...``), where the tuner
   writes by default;
3. the tables shipped in the package (``torus_collectives/tuned/*.json``), with the date and
   the machine they were measured on.

The first of them with a measurement for (device kind, topology, op, dtype) at or below the
size decides, from the largest measured size bucket that is not above the size. With no
measurement "auto" is XLA, and says once how to tune. Below ``latency_floor_bytes`` (where
the cost model's per-hop latency outweighs its bandwidth term) "auto" is XLA without
looking: no schedule can win there against XLA's single fused collective.

Several processes must read the same table, or they would compile different programs:
``tune`` decides on process 0's timings and installs the result on every process; a file
passed to ``use_table`` must be the same file everywhere.

The decision rule (``decide``): a candidate replaces XLA only if the median over rounds of
its per-round time ratio to XLA is at most ``1 - margin`` (default 5 %); ties and noise
stay with XLA. A table that cannot be read, was written by another table format or package
version, or was measured on another device kind is ignored with a warning.
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
import tempfile
import warnings
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from torus_collectives import cost_model
from torus_collectives import schedule as schedule_lib

FORMAT = 1
MARGIN = 0.05
ENV_VAR = "TORUS_COLLECTIVES_TUNING"
SHIPPED_DIR = pathlib.Path(__file__).with_name("tuned")
BASELINE = "xla"
TUNE_COMMAND = "python -m torus_collectives.tune"

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


def decide(ratios: Mapping[str, float], margin: float = MARGIN) -> str:
  """The implementation to run given each candidate's median time ratio to XLA.

  The fastest candidate wins only if it beats XLA by at least ``margin``; otherwise (ties,
  noise, no candidate, or a ratio that is not a number) XLA.
  """
  if not 0 <= margin < 1:
    raise ValueError(f"{margin=} must be in [0, 1)")
  finite = {k: v for k, v in ratios.items() if k != BASELINE and math.isfinite(v)}
  if not finite:
    return BASELINE
  best = min(finite, key=finite.get)
  return best if finite[best] <= 1 - margin else BASELINE


_GENERATIONS = (  # device_kind prefix -> cost-model generation
  ("TPU v3", "v3"),
  ("TPU v4", "v4"),
  ("TPU v5 lite", "v5e"),
  ("TPU v5e", "v5e"),
  ("TPU v5", "v5p"),
  ("TPU v6", "v6e"),
)
# Off TPU no interconnect is modelled; the floor then uses v5e's constants, an assumption,
# and v5p's (six links) for a torus of three axes.
_DEFAULT_GENERATION = "v5e"
_DEFAULT_3D_GENERATION = "v5p"


@functools.cache
def latency_floor_bytes(torus: tuple[int, ...], device_kind: str) -> int:
  """Bytes below which the modelled torus all-reduce spends more time in per-hop latency
  than in moving data: "auto" is XLA there without a measurement."""
  kept = tuple(n for n in torus if n > 1)
  if not kept:
    return 0
  name = next((g for k, g in _GENERATIONS if device_kind.startswith(k)), _DEFAULT_GENERATION)
  generation = cost_model.GENERATIONS[name]
  if len(kept) > generation.links_per_chip // 2:
    generation = cost_model.GENERATIONS[_DEFAULT_3D_GENERATION]
  physical = kept if len(kept) >= 2 else (1,) + kept
  variant = schedule_lib.default_variant(physical)
  pred = cost_model.predict("all_reduce", physical, variant, 1.0, generation)
  return int(pred.latency_s / pred.bandwidth_s)


# ----------------------------------------------------------------------------------------
# Tables.


@dataclasses.dataclass(frozen=True)
class Entry:
  """One measurement: the choice for an (op, dtype, size bucket) and the ratios behind it."""

  topology: str
  op: str
  dtype: str
  bucket: int
  choice: str
  ratios: dict[str, float]  # median per-round time ratio to XLA, per candidate
  rounds: int


@dataclasses.dataclass
class Table:
  """What the tuner measured on one kind of device."""

  device_kind: str
  machine: str
  created: str
  entries: list[Entry]
  margin: float = MARGIN
  version: str = dataclasses.field(default_factory=package_version)
  format: int = FORMAT

  def lookup(self, torus: Sequence[int], op: str, dtype: str, nbytes: int) -> Entry | None:
    """The entry of the largest measured bucket not above ``nbytes``'s, or None."""
    bucket, topo = size_bucket(nbytes), topology(torus)
    found = [
      e
      for e in self.entries
      if (e.topology, e.op, e.dtype) == (topo, op, dtype) and e.bucket <= bucket
    ]
    return max(found, key=lambda e: e.bucket) if found else None

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> Table:
    """Parses a table; raises ValueError on anything malformed."""
    try:
      data = json.loads(text)
      entries = [Entry(**e) for e in data.pop("entries")]
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
    """This table plus the entries of ``older`` (same device kind) it does not remeasure."""
    if older is None or older.device_kind != self.device_kind:
      return self
    mine = {(e.topology, e.op, e.dtype, e.bucket) for e in self.entries}
    kept = [e for e in older.entries if (e.topology, e.op, e.dtype, e.bucket) not in mine]
    return dataclasses.replace(self, entries=kept + self.entries)


def now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def format_table(table: Table) -> str:
  """The table as markdown: one row per entry, with the ratios behind each choice."""
  names = sorted({n for e in table.entries for n in e.ratios})
  lines = [
    f"Tuned {table.created} on {table.machine} (device kind {table.device_kind!r}); "
    f"choice = fastest candidate if its median per-round time ratio to xla <= "
    f"{1 - table.margin:.2f}, else xla. A row holds from its size up to the next measured one.",
    "",
    "| topology | op | dtype | size | "
    + " | ".join(f"{n} t/t_xla" for n in names)
    + " | rounds | auto |",
    "|---" * (6 + len(names)) + "|",
  ]
  for e in sorted(table.entries, key=lambda e: (e.topology, e.op, e.dtype, e.bucket)):
    cells = [f"{e.ratios[n]:.2f}" if n in e.ratios else "-" for n in names]
    lines.append(
      f"| {e.topology} | {e.op} | {e.dtype} | {size_label(2**e.bucket)} | "
      + " | ".join(cells)
      + f" | {e.rounds} | {e.choice} |"
    )
  return "\n".join(lines)


def size_label(nbytes: int) -> str:
  """``nbytes`` in binary units, e.g. ``"1 MiB"``."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= scale:
      return f"{nbytes / scale:.3g} {unit}"
  return f"{nbytes} B"


# ----------------------------------------------------------------------------------------
# Where "auto" reads.

_explicit: Table | None = None


def use_table(table: Table | str | os.PathLike | None) -> None:
  """Makes ``table`` (or the table in the file at that path) the first one "auto" reads;
  None removes it. Call it with the same table on every process."""
  global _explicit
  if table is None or isinstance(table, Table):
    _explicit = table
    return
  text = pathlib.Path(table).read_text()
  _explicit = Table.from_json(text)


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
  if table is None or table.device_kind == device_kind:
    return table
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


def lookup(device_kind: str, torus: Sequence[int], op: str, dtype, nbytes: int) -> str | None:
  """The measured choice for this call, or None when nothing was measured."""
  name = jnp.dtype(dtype).name
  for table in tables(device_kind):
    entry = table.lookup(torus, op, name, nbytes)
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
