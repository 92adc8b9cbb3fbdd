"""The cases the hardware check runs, as data: what to run, never how.

A correctness case is one (op, implementation, dtype, torus, size) and has a stable id,
``op:implementation:dtype:torus:elements`` (``psum:shard_map:float32:2x4:1024``), which
``--case ID`` runs again on its own: ``Case.from_id`` rebuilds the case from the id alone,
whatever options listed it. ``elements`` is the per-device input's length (for an
all-gather, the gathered length; for batch norm and the pytrees, the total).

A measurement case is one (op, dtype, torus, full buffer bytes) with the implementations
to time against XLA (``Measure``).

Which implementations a case runs is read from the registry (``registry.BACKENDS``): every
backend that implements the op's registry op on the dtype and runs on this device kind,
the Pallas kernels off TPU only with ``--interpret``. "xla" is lax itself, the reference,
so it is checked only where the package does more than call lax (gradient buckets, batch
norm's passes, the sharded optimizer update). Nothing here needs a device: the parent
process of the check enumerates cases without initialising a jax backend, which on a TPU
would hold the chips its workers need.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Sequence

from torus_collectives import registry, target
from torus_collectives.sizes import KiB, MiB
from torus_collectives.topology import most_square_shape

# Correctness ops: the drop-in collectives, then what is built on them.
SUMS = ("psum", "pmean", "psum_scatter")
OPS = (
  "psum",
  "pmean",
  "psum_scatter",
  "all_gather",
  "all_reduce_gradients",
  "batch_norm",
  "psum_int8",
  "sharded_update",
  "split_all_reduce_leaves",
)
# The registry op each check runs on (sharded_update needs reduce_scatter and all_gather).
REGISTRY_OP = {
  "psum": "all_reduce",
  "pmean": "all_reduce",
  "psum_scatter": "reduce_scatter",
  "all_gather": "all_gather",
  "all_reduce_gradients": "all_reduce",
  "batch_norm": "batch_norm",
  "psum_int8": "all_reduce",
  "sharded_update": "reduce_scatter",
  "split_all_reduce_leaves": "all_reduce",
}
# Ops where "xla" is more than lax called with the caller's arguments.
XLA_CHECKED = ("all_reduce_gradients", "batch_norm", "sharded_update")
DTYPES = ("float32", "bfloat16", "int32")
FLOAT_ONLY = (
  "pmean",
  "all_reduce_gradients",
  "batch_norm",
  "psum_int8",
  "sharded_update",
)
SPLIT = {
  "split_all_reduce_leaves": "split_all_reduce_leaves",
}
# Per-device input sizes in bytes: a few elements (``FEW``, per device in the scatter's
# chunks), then powers of 64 up to 64 MiB, cut at ``--max-bytes``.
FEW = 3
CORRECTNESS_BYTES = (4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB)
QUICK_CORRECTNESS_BYTES = (4 * KiB,)
MEASURE_OPS = ("all_reduce", "reduce_scatter", "all_gather")
MEASURE_BYTES = tuple(4**k * KiB for k in range(1, 10))  # 4 KiB ... 64 MiB (the top: 256 MiB)
QUICK_MEASURE_BYTES = (16 * KiB, 1 * MiB)
MEASURE_DTYPES = ("float32", "bfloat16")
QUICK_MEASURE_DTYPES = ("float32",)
AXIS_NAMES = ("x", "y", "z")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "int32": 4}


def topology(torus: Sequence[int]) -> str:
  return "x".join(str(int(n)) for n in torus)


def parse_topology(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.split("x"))


@dataclasses.dataclass(frozen=True)
class Case:
  """One correctness case (see the module docstring for its id)."""

  op: str
  impl: str
  dtype: str
  torus: tuple[int, ...]
  elements: int

  @property
  def id(self) -> str:
    return f"{self.op}:{self.impl}:{self.dtype}:{topology(self.torus)}:{self.elements}"

  @property
  def devices(self) -> int:
    return math.prod(self.torus)

  @property
  def nbytes(self) -> int:
    return self.elements * ITEMSIZE[self.dtype]

  @classmethod
  def from_id(cls, case_id: str) -> Case:
    """The case of an id; ValueError on anything else."""
    try:
      op, impl, dtype, torus, elements = case_id.split(":")
      case = cls(op, impl, dtype, parse_topology(torus), int(elements))
    except ValueError as e:
      raise ValueError(
        f"not a case id: {case_id!r} (op:implementation:dtype:torus:elements, "
        "e.g. psum:shard_map:float32:2x4:1024)"
      ) from e
    if op not in OPS or dtype not in DTYPES:
      raise ValueError(f"not a case id: {case_id!r}: op one of {OPS}, dtype one of {DTYPES}")
    return case

  def command(self, extra: Sequence[str] = ()) -> str:
    """The smallest reproducer: this case alone (``extra``: the options it needs here,
    such as ``--plugin`` or ``--interpret``)."""
    tail = "".join(f" {a}" for a in extra)
    return f"python -m torus_collectives.check --only correctness --case {self.id}{tail}"


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A case that does not run here, and why (listed in the report, never a failure)."""

  id: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Measure:
  """One measurement: ``impls`` (XLA first) timed on ``op`` of a full buffer of
  ``nbytes`` (the all-gather's output) of ``dtype`` over every axis of ``torus``."""

  op: str
  dtype: str
  torus: tuple[int, ...]
  nbytes: int
  impls: tuple[str, ...]

  @property
  def id(self) -> str:
    return f"{self.op}:{self.dtype}:{topology(self.torus)}:{self.nbytes}"

  @classmethod
  def from_dict(cls, d: dict) -> Measure:
    return cls(d["op"], d["dtype"], tuple(d["torus"]), d["nbytes"], tuple(d["impls"]))


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the probe worker found: the devices jax sees."""

  platform: str
  device_kind: str
  device_count: int
  physical: tuple[int, ...] | None  # the chips' torus shape, where devices have coords


def tori(machine: Machine, quick: bool) -> list[tuple[int, ...]]:
  """Every torus the devices form: a ring of all, the most square 2-D torus, a 3-D torus
  where one exists, and the physical shape (``make_torus_mesh`` places devices on their
  chips for it); ``quick``: the ring and the first 2-D torus."""
  p = machine.device_count
  out = [(p,)]
  if machine.physical and 1 < len(machine.physical) <= 3:
    out.append(tuple(machine.physical))
  x, y = most_square_shape(p)
  if x > 1:
    out.append((x, y))
  cubes = [
    (a, b, p // (a * b))
    for a in range(2, p)
    for b in range(a, p)
    if p % (a * b) == 0 and p // (a * b) >= b
  ]
  if cubes:
    out.append(min(cubes, key=lambda s: s[2] - s[0]))
  out = list(dict.fromkeys(out))
  if quick:
    two = [t for t in out if len(t) == 2][:1]
    out = [out[0], *two]
  return out


def _runs_here(name: str, device_kind: str, interpret: bool) -> bool:
  backend = registry.BACKENDS[name]
  if backend.runs_on(device_kind):
    return True
  return backend.pallas_kernels and interpret


def _needs_interpret(name: str, machine: Machine) -> bool:
  backend = registry.BACKENDS[name]
  return backend.pallas_kernels and not target.pallas_compiles_for(machine.device_kind)


def _elements(nbytes: int, dtype: str, p: int) -> int:
  per = max(1, nbytes // ITEMSIZE[dtype] // p)
  return per * p


def sizes(machine: Machine, dtype: str, p: int, quick: bool, max_bytes: int) -> list[int]:
  """Per-device element counts: a few, then the byte sizes up to ``max_bytes``."""
  chosen = QUICK_CORRECTNESS_BYTES if quick else CORRECTNESS_BYTES
  out = [FEW * p] + [_elements(b, dtype, p) for b in chosen if b <= max_bytes]
  return list(dict.fromkeys(out))


def _split_reason(name: str, op: str) -> str | None:
  backend = registry.BACKENDS[name]
  if not backend.pallas_kernels and name != "pallas":
    try:
      functions = backend.load_collectives() if backend.load_collectives else None
    except Exception as e:  # noqa: BLE001 (a backend that cannot load is reported, not fatal)
      return f"its collective functions do not load: {e!r}"
    if functions is None or getattr(functions, SPLIT[op]) is None:
      return f"no {SPLIT[op]}"
  return None


def _checked(op: str, dtype: str, name: str, torus: tuple[int, ...]) -> bool:
  """Whether ``name`` has a correctness case for ``op`` on ``dtype`` and ``torus`` at all."""
  backend = registry.BACKENDS.get(name)
  if backend is None:
    raise ValueError(f"unknown implementation {name!r}: one of {list(registry.BACKENDS)}")
  if dtype == "int32" and op in FLOAT_ONLY:
    return False
  if backend.lax_reference and op not in XLA_CHECKED:
    return False
  if not backend.supports(REGISTRY_OP[op], dtype):
    return False
  if op == "sharded_update" and not backend.supports("all_gather", dtype):
    return False
  if op == "psum_int8" and not backend.block_scaled_transport:
    return False
  return backend.max_torus_axes is None or len(torus) <= backend.max_torus_axes


def _skip_reason(op: str, name: str, machine: Machine, interpret: bool) -> str | None:
  backend = registry.BACKENDS[name]
  if not _runs_here(name, machine.device_kind, interpret):
    hint = " (pass --interpret to run its kernels in TPU interpret mode)"
    return f"{name} does not run on {machine.device_kind!r}" + (
      hint if backend.pallas_kernels else ""
    )
  if op in SPLIT:
    return _split_reason(name, op)
  if op == "sharded_update" and importlib.util.find_spec("optax") is None:
    return "optax is not installed (pip install 'torus-collectives[optax]')"
  return None


def correctness_cases(
  machine: Machine,
  *,
  quick: bool,
  interpret: bool,
  max_bytes: int,
  ops: Sequence[str] = OPS,
  impls: Sequence[str] | None = None,
  dtypes: Sequence[str] = DTYPES,
  toruses: Sequence[tuple[int, ...]] | None = None,
) -> tuple[list[Case], list[Skipped]]:
  """Every correctness case that runs here, and those that do not with the reason.

  ``quick``: the ring and one 2-D torus, a few elements and 4 KiB per device; kernels
  interpreted off TPU (seconds per case) only at the few elements, floats only."""
  names = list(registry.BACKENDS) if impls is None else list(impls)
  cases, skipped = [], []
  for torus in tori(machine, quick) if toruses is None else toruses:
    p = math.prod(torus)
    for op in ops:
      for dtype in dtypes:
        for name in names:
          if not _checked(op, dtype, name, tuple(torus)):
            continue
          interpreted = _needs_interpret(name, machine)
          if quick and interpreted and dtype == "int32":
            continue
          chosen = sizes(machine, dtype, p, quick, max_bytes)
          for elements in chosen[:1] if quick and interpreted else chosen:
            case = Case(op, name, dtype, tuple(torus), elements)
            reason = _skip_reason(op, name, machine, interpret)
            if reason:
              skipped.append(Skipped(case.id, reason))
            else:
              cases.append(case)
  return cases, _merge_skips(skipped)


def _merge_skips(skipped: list[Skipped]) -> list[Skipped]:
  """One line per (op, implementation, reason): the sizes and tori a skip covers add
  nothing to the reader."""
  seen: dict[tuple[str, str], Skipped] = {}
  for s in skipped:
    op, impl = s.id.split(":")[:2]
    key = (f"{op}:{impl}", s.reason)
    if key not in seen:
      seen[key] = Skipped(f"{op}:{impl}:*", s.reason)
  return list(seen.values())


def measure_cases(
  machine: Machine,
  *,
  quick: bool,
  max_bytes: int,
  impls: Sequence[str] | None = None,
  dtypes: Sequence[str] | None = None,
  toruses: Sequence[tuple[int, ...]] | None = None,
  exclude: Sequence[str] = (),
) -> tuple[list[Measure], list[Skipped]]:
  """The nccl-tests-style sweep: each collective, dtype, size and torus, with every
  implementation that runs natively here timed against XLA. Interpreted kernels are not
  timed (interpret mode times Python, not the kernels); ``exclude`` drops implementations
  that failed stage 1."""
  dtypes = dtypes or (QUICK_MEASURE_DTYPES if quick else MEASURE_DTYPES)
  chosen = [b for b in (QUICK_MEASURE_BYTES if quick else MEASURE_BYTES) if b <= max_bytes]
  names = list(registry.BACKENDS) if impls is None else ["xla", *[n for n in impls if n != "xla"]]
  out, skipped = [], []
  for torus in tori(machine, quick) if toruses is None else toruses:
    p = math.prod(torus)
    for op in MEASURE_OPS:
      for dtype in dtypes:
        run = []
        for name in names:
          backend = registry.BACKENDS[name]
          if not backend.supports(op, dtype):
            continue
          if name in exclude:
            skipped.append(Skipped(f"{op}:{name}:*", "failed a correctness case: not timed"))
          elif not backend.runs_on(machine.device_kind):
            why = "interpreted kernels are not timed" if backend.pallas_kernels else "not here"
            skipped.append(Skipped(f"{op}:{name}:*", why))
          else:
            run.append(name)
        if len(run) < 2:
          continue
        for nbytes in chosen:
          nbytes = _elements(nbytes, dtype, p) * ITEMSIZE[dtype]
          out.append(Measure(op, dtype, tuple(torus), nbytes, tuple(run)))
  return out, _merge_skips(skipped)
