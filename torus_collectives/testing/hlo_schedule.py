"""The scheduled program of a compiled step, and how much of its communication is exposed.

XLA prints the ENTRY computation of ``compiled.as_text()`` in schedule order, and the TPU
backend writes its own cost estimate of each fusion and convolution into the op's backend
config as ``"estimated_cycles"``. From those two facts this module builds a timeline of
one step on one chip:

* compute runs one op at a time on the TensorCore, each for its estimated cycles at a
  clock the caller calibrates (``implied_clock``: ``bench.overlap_report`` takes the clock
  at which the compiler's estimate of a large bf16 matmul runs at the published peak);
* each collective is priced by a caller-supplied function of its bytes (the alpha-beta
  ``cost_model`` in ``bench.overlap_report``), since the compiler gives no cycle estimate
  for communication;
* a synchronous collective (``all-reduce``, ``all-gather``, ``reduce-scatter``, a Pallas
  ``tpu_custom_call``, which holds the TensorCore from its first DMA to its last) blocks
  for its whole time;
* an asynchronous pair (``X-start`` ... ``X-done``, including XLA's
  ``async-collective-start``/``-done`` fusions) starts its transfer at the start and, at
  the done, waits only for what the compute scheduled between them did not cover;
* a split collective (``torus_collectives.kernels.split_leaf_kernels``: Pallas calls named
  ``async_leaf_<kind>[_ccw]_<start|step|done>_<axis>``, each handing the leaves to the
  next) is a chain of such windows: each call but the done starts one hop's transfer,
  priced by the bytes the call declares (``remote_bytes_transferred`` in its cost
  estimate), the next call of its chain waits for what the compute between them did not
  cover, and each call itself holds the TensorCore for its estimated cycles. The chain,
  over all its phases, is one row. Hops in flight at once
  on the same directed link (a ring axis and direction: ``split_link``) share it: each
  progresses at ``1 / k`` of its own speed while ``k`` are unfinished there (processor
  sharing of the whole hop, its latency too, so contention is if anything overcharged;
  XLA's own collectives in flight are not counted against the links).

Everything here is a compiler estimate combined with a model: no figure is measured.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from torus_collectives.gradients import WEIGHT_GATHER_SCOPE

# Peak bf16 FLOP/s of one jax device, from the Cloud TPU documentation's per-chip peaks:
# v5e 197 T, v5p 459 T, v6e 918 T, one device per chip; v4 275 T per chip, which shows
# two devices (TensorCores) when compiled ahead of time for a topology, so half each.
PEAK_FLOPS = {"v4": 275e12 / 2, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}

DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
  "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
SYNC_COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all"})
COLLECTIVE_OPCODES = (*sorted(SYNC_COLLECTIVES), "collective-permute")
ASYNC_STARTS = frozenset(
  {"all-reduce-start", "all-gather-start", "reduce-scatter-start", "collective-permute-start"}
)
ASYNC_FUSION_START, ASYNC_FUSION_DONE = "async-collective-start", "async-collective-done"
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CYCLES = re.compile(r'"estimated_cycles":"([0-9]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_GROUPS = re.compile(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}")
_COLLECTIVE = re.compile(r" (" + "|".join(COLLECTIVE_OPCODES) + r")(?:-start)?\(")
# A split collective's call (a leaf chain's hop, ``split_leaf_kernels``): its kind,
# direction, place in the chain and axis.
_SPLIT_CALL = re.compile(
  r"async_leaf_(all_gather|reduce_scatter)(_ccw)?_(start|step|done)_(\w+?)(?:/|$)"
)
_REMOTE_BYTES = re.compile(r'"remote_bytes_transferred":"?([0-9]+)')


def is_convolution(op: Op) -> bool:
  """A convolution: XLA's opcode, or a fusion of jax's ``conv_general_dilated``."""
  return op.opcode == "convolution" or "conv_general_dilated" in op.op_name


def split_call(op: Op) -> tuple[str, str, str] | None:
  """``(kind, call, axis)`` of a split collective's Pallas call (``"reduce_scatter",
  "step", "x"``), from its jax ``op_name``; None for any other op."""
  if op.kind != "pallas":
    return None
  found = _SPLIT_CALL.search(op.op_name)
  return (found.group(1), found.group(3), found.group(4)) if found else None


def split_link(op: Op) -> tuple[str, int]:
  """``(axis, direction)`` of a split collective's call: the directed ring link its hop
  sends on (``_ccw`` calls send to the previous device, -1)."""
  found = _SPLIT_CALL.search(op.op_name)
  if op.kind != "pallas" or found is None:
    raise ValueError(f"{op.name} is not a split collective's call")
  return found.group(4), -1 if found.group(2) else 1


def implied_clock(cycles: float, flops: float, peak_flops: float) -> float:
  """The clock (Hz) at which ``cycles`` of estimated time do ``flops`` at ``peak_flops``:
  given the estimate of a program that runs at the peak (a large matmul), the fastest
  clock at which the compiler's estimates are physically possible. Timing compute with it
  gives the shortest compute, and so the least overlap: the conservative choice."""
  return cycles * peak_flops / flops


@dataclasses.dataclass(frozen=True)
class Op:
  """One instruction of the ENTRY computation."""

  name: str
  opcode: str
  result: str  # the result's shape text
  operands: tuple[str, ...]
  cycles: int | None
  op_name: str
  target: str  # custom_call_target, or ""
  calls: str  # the fused computation, or ""
  axes: tuple[str, ...] | None  # mesh axes of its replica groups (of its body, if fused)
  collective: str = ""  # "all-reduce", "all-gather", ... (of its body, if fused), or ""
  remote_bytes: int = 0  # a Pallas call's declared remote traffic (its cost estimate)

  @property
  def result_bytes(self) -> int:
    return shape_bytes(self.result)

  @property
  def kind(self) -> str:
    """ "sync", "start", "done", "pallas", "compute" or "other"."""
    if self.opcode in SYNC_COLLECTIVES:
      return "sync"
    if self.opcode in ASYNC_STARTS or self.name.startswith(ASYNC_FUSION_START):
      return "start"
    if self.opcode.endswith("-done") and self.opcode != "copy-done":
      return "done"
    if self.name.startswith(ASYNC_FUSION_DONE):
      return "done"
    if self.opcode == "custom-call" and self.target == "tpu_custom_call":
      return "pallas"
    if self.cycles is not None:
      return "compute"
    return "other"


def shape_bytes(shape: str) -> int:
  """Bytes of every array in a shape text such as ``(f32[8]{0}, bf16[2,3]{1,0})``."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in DTYPE_BYTES:
      total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]``."""
  depth = 0
  pairs = {"(": ")", "[": "]", "{": "}"}
  closing = set(pairs.values())
  for i in range(start, len(text)):
    if text[i] in pairs:
      depth += 1
    elif text[i] in closing:
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced brackets in {text[start : start + 80]!r}")


def parse_instruction(line: str) -> Op | None:
  """An ENTRY instruction line, parsed; None for anything else."""
  line = line.strip()
  if line.startswith("ROOT "):
    line = line[5:]
  if not line.startswith("%") or " = " not in line:
    return None
  name, rest = line[1:].split(" = ", 1)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
  result, rest = rest[:end], rest[end:].lstrip()
  paren = rest.index("(")
  opcode = rest[:paren]
  close = _balanced(rest, paren)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren:close]))
  attributes = rest[close:]
  cycles = _CYCLES.search(attributes)
  op_name = _OP_NAME.search(attributes)
  target = _TARGET.search(attributes)
  calls = _CALLS.search(attributes)
  groups = _GROUPS.search(attributes)
  return Op(
    name=name,
    opcode=opcode,
    result=result,
    operands=operands,
    cycles=int(cycles.group(1)) if cycles else None,
    op_name=op_name.group(1) if op_name else "",
    target=target.group(1) if target else "",
    calls=calls.group(1) if calls else "",
    axes=_axes(groups.group(1)) if groups else None,
    collective=_collective_of(opcode),
    remote_bytes=int(remote.group(1)) if (remote := _REMOTE_BYTES.search(attributes)) else 0,
  )


def _collective_of(opcode: str) -> str:
  stem = opcode.removesuffix("-start")
  return stem if stem in COLLECTIVE_OPCODES else ""


def _axes(text: str) -> tuple[str, ...]:
  return tuple(a.strip().strip("'") for a in text.split(",") if a.strip())


def computations(hlo_text: str) -> dict[str, str]:
  """Every computation of the module by name, with its body's text."""
  out, name, body = {}, None, []
  for line in hlo_text.splitlines():
    if name is None:
      if line.startswith(("%", "ENTRY ")) and line.rstrip().endswith("{"):
        name = line.split()[1 if line.startswith("ENTRY ") else 0].lstrip("%")
        body = []
    elif line.startswith("}"):
      out[name] = "\n".join(body)
      name = None
    else:
      body.append(line)
  return out


def entry_ops(hlo_text: str) -> list[Op]:
  """The ENTRY computation's instructions, in schedule order; a fusion without replica
  groups, a collective opcode or an ``op_name`` of its own (an async collective fusion)
  takes those of the collective inside."""
  bodies = computations(hlo_text)
  ops, inside = [], False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      inside = True
      continue
    if inside and line.startswith("}"):
      break
    if inside:
      op = parse_instruction(line)
      if op is not None and op.calls in bodies:
        groups = _GROUPS.search(bodies[op.calls])
        if groups and op.axes is None:
          op = dataclasses.replace(op, axes=_axes(groups.group(1)))
        inner = _COLLECTIVE.search(bodies[op.calls])
        if inner and not op.collective:
          body = bodies[op.calls]
          line_end = body.find("\n", inner.end())
          inner_name = _OP_NAME.search(body, inner.end(), len(body) if line_end < 0 else line_end)
          op = dataclasses.replace(
            op,
            collective=inner.group(1),
            op_name=op.op_name or (inner_name.group(1) if inner_name else ""),
          )
      if op is not None:
        ops.append(op)
  if not inside:
    raise ValueError("no ENTRY computation in the program text")
  return ops


# What a fused computation's body holds, heaviest first: its category is the first found.
_CATEGORIES = (
  ("convolution", re.compile(r" convolution\(")),
  ("reduction", re.compile(r" reduce(-window)?\(")),
  ("concatenate", re.compile(r" concatenate\(")),
  ("dynamic-update-slice", re.compile(r" dynamic-update-slice\(")),
  ("slice", re.compile(r" (dynamic-)?slice\(")),
  ("pad", re.compile(r" pad\(")),
)
_MOVES = re.compile(r" (copy|transpose)\(")


def category(op: Op, bodies: dict[str, str]) -> str:
  """What kind of compute ``op`` is: a fusion by the heaviest op in its body (a
  convolution, a reduction, a concatenate, an update or a slice, a pad, a copy or
  transpose), ``elementwise`` otherwise; any other op by its opcode."""
  if op.opcode != "fusion":
    return op.opcode
  body = bodies.get(op.calls, "")
  for name, pattern in _CATEGORIES:
    if pattern.search(body):
      return name
  return "copy" if _MOVES.search(body) else "elementwise"


def compute_by_category(hlo_text: str) -> dict[str, int]:
  """The ENTRY computation's estimated compute cycles, summed by ``category``, largest
  first: the ops the timeline counts as compute (collectives and Pallas calls excluded)."""
  bodies = computations(hlo_text)
  totals: dict[str, int] = {}
  for op in entry_ops(hlo_text):
    if op.kind == "compute" and op.cycles:
      key = category(op, bodies)
      totals[key] = totals.get(key, 0) + op.cycles
  return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
  """One collective on the timeline."""

  name: str
  kind: str  # "sync", "async" or "pallas"
  nbytes: int
  modelled_s: float
  covered_s: float  # compute scheduled between its start and its done
  exposed_s: float
  after_last_convolution: bool
  hops: int = 0  # a split collective's hops (its calls but the done)
  waits: int = 0  # of its calls after the first, those that waited for their hop


@dataclasses.dataclass(frozen=True)
class Timeline:
  rows: tuple[CollectiveRow, ...]  # the collectives ``counts`` selected
  compute_s: float  # the TensorCore's estimated busy time
  others: tuple[CollectiveRow, ...] = ()  # the other collectives, timed too
  step_s: float = 0.0  # the whole timeline: compute, and what no compute covered

  @property
  def communication_s(self) -> float:
    return sum(r.modelled_s for r in self.rows)

  @property
  def exposed_s(self) -> float:
    return sum(r.exposed_s for r in self.rows)

  def summary(self) -> str:
    """The report's last line."""
    share = 100 * self.exposed_s / self.communication_s if self.communication_s else 0.0
    return (
      f"exposed gradient communication: {1e3 * self.exposed_s:.3f} ms of "
      f"{1e3 * self.communication_s:.3f} ms ({share:.1f} %); step compute "
      f"{1e3 * self.compute_s:.3f} ms"
    )


def _collective_bytes(op: Op, by_name: dict[str, Op]) -> int:
  """Bytes a collective reduces or gathers per device: its operands'."""
  operands = [by_name[o] for o in op.operands if o in by_name]
  return sum(o.result_bytes for o in operands) or op.result_bytes


def _source(name: str, by_name: dict[str, Op]) -> str:
  """The op a value comes from, through get-tuple-element and bitcast."""
  while name in by_name and by_name[name].opcode in ("get-tuple-element", "bitcast"):
    name = by_name[name].operands[0]
  return name


def _start_of(done: Op, by_name: dict[str, Op], in_flight) -> str | None:
  """The in-flight start a done completes. XLA's async collective fusions pass their state
  through the compute fusions in between, so they pair by name (``async-collective-done.N``
  with ``async-collective-start.N``, checked by the done's shape being in the start's
  tuple); other pairs by their operand."""
  if done.name.startswith(ASYNC_FUSION_DONE):
    start = ASYNC_FUSION_START + done.name[len(ASYNC_FUSION_DONE) :]
    if start not in in_flight:
      return None
    result = done.result.split("{", 1)[0]  # e.g. f32[1,8192]: the start's tuple holds it
    if result not in by_name[start].result:
      raise ValueError(f"{done.name} does not match {start}: the start holds no {result}")
    return start
  starts = {_source(o, by_name) for o in done.operands} & set(in_flight)
  return starts.pop() if len(starts) == 1 else None


def timeline(
  ops: list[Op],
  clock_hz: float,
  price: Callable[[Op, int], float],
  *,
  counts: Callable[[Op], bool] = lambda op: True,
  is_convolution: Callable[[Op], bool] = is_convolution,
) -> Timeline:
  """The step's timeline (module doc). ``price(op, nbytes)`` is a collective's modelled
  seconds, ``nbytes`` what it reduces or gathers per device; ``counts(op)`` selects the
  collectives reported (the gradient's); the others are timed but not reported."""
  by_name = {op.name: op for op in ops}
  last_conv = max((i for i, op in enumerate(ops) if is_convolution(op)), default=-1)
  now = busy = 0.0
  in_flight: dict[str, tuple[float, float, float, int, int]] = {}  # start, busy, T, bytes, i
  rows, others = [], []
  hops = _SplitHops(ops, by_name)
  for i, op in enumerate(ops):
    kind = op.kind
    if split_call(op) is not None:
      now = hops.call(op, i, now, busy, price, clock_hz)
    elif kind in ("sync", "pallas"):
      nbytes = _collective_bytes(op, by_name)
      seconds = price(op, nbytes)
      row = CollectiveRow(op.name, kind, nbytes, seconds, 0.0, seconds, i > last_conv)
      (rows if counts(op) else others).append(row)
      now += seconds
    elif kind == "start":
      nbytes = _collective_bytes(op, by_name)
      in_flight[op.name] = (now, busy, price(op, nbytes), nbytes, i)
    elif kind == "done":
      start = _start_of(op, by_name, in_flight)
      if start is None:
        continue
      began, busy_then, seconds, nbytes, index = in_flight.pop(start)
      finish = max(now, began + seconds)
      covered, exposed = busy - busy_then, finish - now
      row = CollectiveRow(start, "async", nbytes, seconds, covered, exposed, index > last_conv)
      (rows if counts(by_name[start]) else others).append(row)
      now = finish
    elif op.cycles:  # compute: a fusion, a convolution, a copy the compiler priced
      seconds = op.cycles / clock_hz
      now += seconds
      busy += seconds
  for chain in hops.chains:
    row = CollectiveRow(
      chain.name, "split", chain.nbytes, chain.modelled_s, chain.covered_s, chain.exposed_s,
      chain.first_index > last_conv, chain.hops, chain.waits,
    )  # fmt: skip
    (rows if counts(by_name[chain.name]) else others).append(row)
  return Timeline(tuple(rows), busy, tuple(others), now)


@dataclasses.dataclass
class _Chain:
  """One split collective's calls, summed: its hops' modelled, covered and exposed time,
  how many hops it has and how many of its calls waited for the hop before them."""

  name: str  # its first call
  first_index: int
  nbytes: int = 0  # its first call's operands: the bucket (and the small coordinates)
  modelled_s: float = 0.0
  covered_s: float = 0.0
  exposed_s: float = 0.0
  hops: int = 0
  waits: int = 0


_PASSING = frozenset({"get-tuple-element", "bitcast"})
# A threaded bucket's scope, with the scope it lies in (the gradient summation's or the
# weight gather's: both number their buckets from 0).
_BUCKET = re.compile(r"/([^/]+/bucket_[0-9]+(?:/stream_[0-9]+)?)/")


def split_chains(ops: list[Op]) -> list[list[int]]:
  """Each split collective's calls, as indices into ``ops`` in schedule order. Within a
  named ``bucket_<k>`` scope (the threaded gradient summation's or weight gather's, told
  apart by the scope around it; ``bucket_<k>/stream_<s>`` for each stream of a split
  torus all-reduce), the calls of that scope:
  the calls of one chain depend on each other, so the schedule keeps their order, and a
  chain spans all its phases. Otherwise each call joins the chain of the call that
  produced its first leaf, and a start begins a chain."""
  by_name = {op.name: op for op in ops}
  chains: list[list[int]] = []
  chain_of: dict[str, list[int]] = {}  # a call's name, or a bucket scope -> its chain
  for i, op in enumerate(ops):
    split = split_call(op)
    if split is None:
      continue
    _, call, _ = split
    bucket = _BUCKET.search(op.op_name)
    if bucket is not None:
      key = bucket.group(1)
    elif call == "start":
      key = None
    else:  # the first leaf: after the coordinates and the hop index
      key = op.operands[2]
      while key in by_name and by_name[key].opcode in _PASSING:
        key = by_name[key].operands[0]
    chain = chain_of.get(key)
    if chain is None:
      chain = []
      chains.append(chain)
      if bucket is not None:
        chain_of[key] = chain
    chain.append(i)
    chain_of[op.name] = chain
  return chains


@dataclasses.dataclass(frozen=True)
class LinkLoad:
  """What the directed links must carry from one split collective's first call on
  (``link_loads``)."""

  first: str  # the collective's first call
  need_s: float  # its hops and every later-started split collective's, on the busiest link
  compute_s: float  # the compute scheduled after its first call

  @property
  def share(self) -> float:
    """The busiest link's modelled time over the compute left: at most 1 means the links
    could carry the hops behind that compute; what is exposed then comes from where the
    calls are placed (too few windows, or hops sharing a link), not from the links."""
    return self.need_s / self.compute_s if self.compute_s else math.inf


def link_loads(ops: list[Op], clock_hz: float, price: Callable[[Op, int], float]) -> list[LinkLoad]:
  """For each split collective, in the order of their first calls: the modelled seconds
  (``price`` of each call's declared bytes, as ``timeline`` prices its hops) that its
  hops and those of every split collective started after it put on the busiest directed
  link (``split_link``), against the compute (``timeline``'s: ops with estimated cycles,
  at ``clock_hz``) scheduled after its first call. The hops of a collective cannot move
  before its first call and a link carries them at most at their modelled speed, so with
  a share over 1 no placement of the later calls hides them all behind that compute (the
  calls' own work and other collectives, not counted, stretch the step a little further);
  under 1, the links have the time."""
  compute_after = [0.0] * (len(ops) + 1)
  for i in range(len(ops) - 1, -1, -1):
    op = ops[i]
    own = op.cycles / clock_hz if op.kind == "compute" and op.cycles else 0.0
    compute_after[i] = compute_after[i + 1] + own
  rows: list[LinkLoad] = []
  later: dict[tuple[str, int], float] = {}  # link -> seconds of this and later collectives
  for calls in sorted(split_chains(ops), reverse=True):  # the last started first
    for i in calls:
      if split_call(ops[i])[1] != "done":
        link = split_link(ops[i])
        later[link] = later.get(link, 0.0) + price(ops[i], ops[i].remote_bytes)
    need = max(later.values(), default=0.0)
    rows.append(LinkLoad(ops[calls[0]].name, need, compute_after[calls[0] + 1]))
  return rows[::-1]


def is_backward_convolution(op: Op) -> bool:
  """A convolution of the backward pass: jax names those ``transpose(jvp(...))``."""
  return is_convolution(op) and "transpose(" in op.op_name


def split_schedule_problems(ops: list[Op]) -> list[str]:
  """What breaks a threaded summation's compiled schedule (empty when nothing does):

  * a chain started before the last backward convolution that has none between its
    first call and its last (the one started after it has nothing left to overlap);
  * a weight gather's chain (threaded through the forward pass) that ends after the first
    convolution but has no convolution between its first call and its last (the first
    bucket, read by the first layer, has nothing before it to overlap);
  * a step or done with an operand after the coordinates and the hop index (its leaves,
    slots and semaphores) that is not a split call's output in place (through
    get-tuple-element and bitcast only: anything else would copy a buffer that DMAs
    are writing). They come from the last call of the bucket, whichever stream's;
  * calls out of order: a start before the previous chain's done, a step or done after a
    done."""
  by_name = {op.name: op for op in ops}
  backward = [i for i, op in enumerate(ops) if is_backward_convolution(op)]
  convolutions = [i for i, op in enumerate(ops) if is_convolution(op)]
  problems = []
  for calls in split_chains(ops):
    uncovered = _uncovered(ops, calls, convolutions, backward)
    if uncovered:
      problems.append(f"{ops[calls[0]].name}: no {uncovered} between its first and last call")
    for before, index in zip(calls, calls[1:]):
      _, call, _ = split_call(ops[index])
      _, call_before, _ = split_call(ops[before])
      if call == "start":
        if call_before != "done":
          problems.append(f"{ops[index].name} starts before {ops[before].name} is done")
        continue
      if call_before == "done":
        problems.append(f"{ops[index].name} follows {ops[before].name}")
        continue
      sources = {_source(o, by_name) for o in ops[index].operands[2:]}
      copied = sorted(o for o in sources if o not in by_name or not split_call(by_name[o]))
      problems += [f"{ops[index].name} takes {o}, not a split call's output" for o in copied]
  return problems


def _uncovered(ops, calls, convolutions, backward) -> str | None:
  """What a chain should overlap and does not (``split_schedule_problems``' first two
  rules): "convolution" for a weight gather's, "backward convolution" for another's."""
  first, last = calls[0], calls[-1]
  if f"/{WEIGHT_GATHER_SCOPE}/" in ops[first].op_name:
    wanted, needed = convolutions, bool(convolutions) and convolutions[0] < last
    name = "convolution"
  else:
    wanted, needed = backward, bool(backward) and first < backward[-1]
    name = "backward convolution"
  return name if needed and not any(first < i < last for i in wanted) else None


@dataclasses.dataclass
class _Hop:
  """One open window: its hop's link, when it opened (time, busy) and its price alone."""

  link: tuple[str, int]
  busy: float
  seconds: float
  remaining: float  # seconds of the hop's own speed still to go


class _SplitHops:
  """The windows of split collectives on the timeline (module doc)."""

  def __init__(self, ops: list[Op], by_name: dict[str, Op]):
    self.by_name = by_name
    self.chains: list[_Chain] = []
    self.previous: dict[int, int | None] = {}  # call index -> its chain's call before it
    self.chain_at: dict[int, _Chain] = {}
    for calls in split_chains(ops):
      first = ops[calls[0]]
      chain = _Chain(first.name, calls[0], nbytes=_collective_bytes(first, by_name))
      self.chains.append(chain)
      for before, index in zip([None, *calls], calls):
        self.previous[index], self.chain_at[index] = before, chain
    self.window: dict[int, _Hop] = {}  # call -> the hop it started
    self.clock = 0.0  # the time up to which the hops have progressed

  def call(self, op: Op, index: int, now: float, busy: float, price, clock_hz) -> float:
    """Closes the window ``op`` waits on, opens its own; returns the new time."""
    _, call, _ = split_call(op)
    chain, previous = self.chain_at[index], self.previous[index]
    self.progress(now)
    if previous in self.window:
      hop = self.window[previous]
      while hop.remaining > 0:  # wait for it, the others on its link progressing too
        self.progress(self.clock + self._next_event())
      del self.window[previous]
      chain.modelled_s += hop.seconds
      chain.covered_s += busy - hop.busy
      chain.exposed_s += self.clock - now
      if self.clock > now:
        chain.waits += 1
      now = self.clock
    now += (op.cycles or 0) / clock_hz  # the call's own work on the TensorCore
    self.progress(now)
    if call != "done":
      chain.hops += 1
      seconds = price(op, op.remote_bytes)
      self.window[index] = _Hop(split_link(op), busy, seconds, seconds)
    return now

  def _sharing(self) -> dict[tuple[str, int], list[_Hop]]:
    links: dict[tuple[str, int], list[_Hop]] = {}
    for hop in self.window.values():
      if hop.remaining > 0:
        links.setdefault(hop.link, []).append(hop)
    return links

  def _next_event(self) -> float:
    """Time until the next unfinished hop finishes at the current sharing."""
    return min(min(h.remaining for h in hops) * len(hops) for hops in self._sharing().values())

  def progress(self, until: float) -> None:
    """Advances every unfinished hop to time ``until``, ``k`` hops on a link each at
    ``1 / k`` of its speed, the shares re-dealt as hops finish."""
    while until > self.clock:
      links = self._sharing()
      if not links:
        self.clock = until
        return
      step = min(until - self.clock, self._next_event())
      for hops in links.values():
        for hop in hops:
          hop.remaining -= step / len(hops)
          if hop.remaining < 1e-15:
            hop.remaining = 0.0
      self.clock += step
