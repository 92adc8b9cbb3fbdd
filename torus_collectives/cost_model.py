"""An alpha-beta cost model of the torus collectives at pod scale.

It prices the very ``schedule.Schedule`` objects that the kernels and the ``shard_map``
fallback execute, so the model cannot drift from the algorithm:

* The schedule's streams advance in lockstep, one global step at a time. In a step every
  device sends, per transfer, one slab of ``Transfer.slab_elements`` elements to its ring
  neighbour.
* Each logical hop is mapped onto the chips' physical links (``placement``). The torus
  variants run on a physical torus of the same shape (2-D or 3-D), one link per hop. A 1-D
  ring is laid onto the torus along a closed path (a boustrophedon "snake" by default, so
  neighbours on the ring are neighbours on the torus; "row_major" shows what a careless
  embedding costs), and a 2-D schedule ``X x YZ`` on a 3-D torus ``X x Y x Z`` snakes its
  second axis through the Y-Z plane; hops between chips that are not neighbours follow
  dimension-order routing.
* Every directed link carries ``B`` bytes/s one way. When several transfers of one step
  cross the same directed link (two streams of the split schedule on a non-square torus,
  or two routed ring hops), they share its bandwidth. A step costs
  ``alpha * hops + max over links of (bytes on the link) / B``, with ``hops`` the longest
  routed path in the step; a collective costs the sum over its steps.

* Optionally (``reduce_pieces``), the reduce-scatter's adds: a device adds every slab it
  receives to its own partial sums, reading both from HBM and writing the sum (3 HBM
  accesses per received byte, at the chip's HBM bandwidth; the streams' adds share one
  core, so they take turns). With the slab received whole and then added
  (``reduce_pieces=1``), a step costs transfer + add. The kernels split each slab into
  ``k`` pieces with their own DMAs and semaphores and add piece ``i`` while piece ``i+1``
  is still arriving, so a step costs ``max(transfer, add) + min(transfer, add) / k``
  (the pipeline's fill or drain). Within a ring phase the slab sent at step ``t + 1`` is
  the one summed at step ``t``, and the kernels send each of its pieces as soon as its
  sum is stored: the next step's transfer follows the adds piece by piece, so each
  further step of the phase costs ``max(transfer, add, (transfer + add) / k)`` (the link,
  the adds, or one piece's transfer-then-add chain, whichever is slowest), and the fill
  or drain is paid once per phase. A step that starts a phase in any stream waits for
  the step before it to finish.

* Optionally (``transport``), block-scaled transport (``torus_collectives.quantization``):
  a hop along a quantized axis moves ``fmt.wire_bytes_per_element`` bytes per element (the
  int8 or fp8 values and one bfloat16 scale per block) instead of the unquantized dtype's
  ``itemsize``, so its bytes are scaled by ``wire_bytes_per_element / itemsize`` (0.508 for
  int8 blocks of 128 against bfloat16, 0.254 against float32); hops along other axes are
  priced as before. This holds for both phases: the ``shard_map`` schedule sends the
  reduce-scatter's partial sums quantized and forwards the all-gather's quantized bytes as
  they are. The padding of each stream's slice to whole blocks is not priced (under one
  block per stream and chunk), nor is the quantization's arithmetic. The lower bound stays
  that of the unquantized dtype, so a quantized schedule can beat it.

* Multislice (``multislice_all_reduce``): slices joined by the data-centre network (DCN)
  run a hierarchical all-reduce, the ICI reduce-scatter within each slice, a ring
  all-reduce over DCN among the chips at the same position in every slice, each of its own
  ``1/p`` shard, then the ICI all-gather. DCN is priced per host (``DcnHost``): a host's
  NICs carry the DCN traffic of all its chips.

Not modelled: DMA issue overhead beyond ``alpha``, overlap of a step's latency with the
previous step's transfer, the HBM traffic of the DMAs themselves, and contention with other
traffic; for multislice, overlap of the DCN phase with the ICI phases and any congestion in
the data-centre fabric beyond the hosts' NICs. The figures are modelled, never measured.

The physical lower bound for an all-reduce of ``S`` bytes over ``p`` chips with ``L``
links each is ``2 (p - 1) / p * S / (L B)``: every chip must send (and receive) that many
bytes and can push at most ``L B`` bytes/s. Reduce-scatter and all-gather need half. On v4
and v5p (6 links, 3-D torus) a 2-D schedule can use at most 4 of them; the split 3-D
schedule (``schedule.Variant.TORUS_SPLIT`` on three axes) drives all six and, on a cubic
torus, meets the 6-link bound exactly in its bandwidth term.

Caveats for v4 and v5p: the model assumes a full torus, wrap-around links on every axis.
Those exist only where a slice spans whole 4x4x4 cubes along an axis (the optical
switches close the ring); slices smaller than 4 along an axis are meshes, and the ring's
closing hop then crosses the whole axis back (not modelled). Non-cubic slices (k x k x 2k,
k x 2k x 2k) can be wired as twisted tori, whose wrap-around links land on a shifted
chip; the model prices regular tori only, which is exact for the cubic slices tabled here.

``python -m bench.cost_model_report`` prints the ResNet-50 table from these prices, and
``--plot PATH`` a PNG of time against the number of chips.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from torus_collectives import quantization
from torus_collectives import schedule as schedule_lib

# torchvision / Keras ResNet-50: 25,557,032 trainable parameters (the paper's "25.6M").
RESNET50_PARAMS = 25_557_032

# Per-hop latency (alpha). No TPU generation publishes it; about 1 us per ICI hop is the
# rough figure used in public TPU performance guides (e.g. the JAX "How to Scale Your
# Model" book). It is an assumption, the same for all generations; override with --alpha.
DEFAULT_HOP_LATENCY_S = 1e-6


@dataclasses.dataclass(frozen=True)
class Generation:
  """Interconnect of one TPU generation: links per chip and one-way bandwidth per link."""

  name: str
  links_per_chip: int
  link_bandwidth: float  # bytes/s, one direction of one link
  hop_latency: float = DEFAULT_HOP_LATENCY_S  # seconds per step, per hop
  hbm_bandwidth: float = float("inf")  # bytes/s per chip, prices the reduction's adds

  def __post_init__(self):
    if (
      self.links_per_chip < 1
      or self.link_bandwidth <= 0
      or self.hop_latency < 0
      or self.hbm_bandwidth <= 0
    ):
      raise ValueError(f"invalid generation constants: {self}")


GENERATIONS = {
  g.name: g
  for g in (
    # Jouppi et al., "A Domain-Specific Supercomputer for Training Deep Neural
    # Networks", CACM 63(7), 2020: TPUv3 has 4 ICI links of 656 Gbit/s in a 2-D
    # torus. Whether that figure is per direction is not stated there; it is taken as
    # one-way (82 GB/s). Uncertain: third-party guides quote up to 100 GB/s one-way.
    # HBM bandwidth per chip, from the Cloud TPU system-architecture pages: v3 900 GB/s,
    # v4 1,200 GB/s, v5e 819 GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s.
    Generation("v3", links_per_chip=4, link_bandwidth=656e9 / 8, hbm_bandwidth=900e9),
    # Cloud TPU v4 docs: 2,400 Gbit/s of ICI per chip over 6 links (3-D torus), i.e.
    # 50 GB/s per link. Taken as one-way by analogy with v5e and v5p, whose pages
    # give both the Gbit/s figure and a bidirectional GB/s figure twice as large.
    # Six links in a 3-D torus of 4x4x4 cubes joined by optical circuit switches,
    # twisted-torus options: Jouppi et al., "TPU v4: An Optically Reconfigurable
    # Supercomputer ...", ISCA 2023.
    Generation("v4", links_per_chip=6, link_bandwidth=2400e9 / 8 / 6, hbm_bandwidth=1200e9),
    # Cloud TPU v5e docs: 400 GB/s bidirectional ICI per chip, 4 ICI ports, 2-D torus
    # -> 50 GB/s one way per link.
    Generation("v5e", links_per_chip=4, link_bandwidth=400e9 / 2 / 4, hbm_bandwidth=819e9),
    # Cloud TPU v5p docs: 1,200 GB/s bidirectional ICI per chip (4,800 Gbit/s), 3-D
    # torus (6 links, 4x4x4 cubes as on v4) -> 100 GB/s one way per link.
    Generation("v5p", links_per_chip=6, link_bandwidth=1200e9 / 2 / 6, hbm_bandwidth=2765e9),
    # Cloud TPU v6e (Trillium) docs: 800 GB/s bidirectional ICI per chip, 4 ICI
    # ports, 2-D torus -> 100 GB/s one way per link.
    Generation("v6e", links_per_chip=4, link_bandwidth=800e9 / 2 / 4, hbm_bandwidth=1640e9),
  )
}

# A device's ``device_kind`` prefix -> its generation in ``GENERATIONS`` (the first that
# matches: "TPU v5 lite" and "TPU v5e" before "TPU v5").
DEVICE_KIND_PREFIXES = (
  ("TPU v3", "v3"),
  ("TPU v4", "v4"),
  ("TPU v5 lite", "v5e"),
  ("TPU v5e", "v5e"),
  ("TPU v5", "v5p"),
  ("TPU v6", "v6e"),
)


def generation_of(device_kind: str) -> str | None:
  """The name in ``GENERATIONS`` of a device's ``device_kind``, or None (off TPU, or a
  generation not modelled)."""
  return next((g for k, g in DEVICE_KIND_PREFIXES if device_kind.startswith(k)), None)


# Per-hop latency of the data-centre network between slices: the time a transfer between
# two hosts takes beyond its bytes (NICs, switches, host software). No Cloud TPU page
# publishes it; 10 us per hop is an assumption, the same for all generations; override it
# (``dcn_hop_latency=``, ``--dcn-alpha`` in the report).
DEFAULT_DCN_HOP_LATENCY_S = 10e-6


@dataclasses.dataclass(frozen=True)
class DcnHost:
  """The data-centre network of one TPU host: the chips that share it and its NICs'
  bandwidth, one direction (bytes/s, all NICs together; full duplex, so a host sends and
  receives that much at once)."""

  chips_per_host: int
  bandwidth: float
  hop_latency: float = DEFAULT_DCN_HOP_LATENCY_S

  def __post_init__(self):
    if self.chips_per_host < 1 or self.bandwidth <= 0 or self.hop_latency < 0:
      raise ValueError(f"invalid DCN host constants: {self}")


DCN_HOSTS = {
  # Cloud TPU documentation, "TPU v5e" system architecture table: 8 chips per host,
  # per-host NIC configuration 2 x 100 Gbps, data-centre network bandwidth per 256-chip Pod
  # 6.4 Tbps (= 32 hosts x 200 Gbps, consistent: its slice table gives a 16x16 slice 32
  # hosts). A v5e VM holds 1, 4 or 8 chips; the host's NICs, not the VM, are the shared
  # resource priced here. A NIC's Gbit/s is taken as its line rate in each direction
  # (Ethernet is full duplex).
  "v5e": DcnHost(chips_per_host=8, bandwidth=2 * 100e9 / 8),
  # Cloud TPU documentation, "TPU v6e": 8 chips per host, per-host NIC configuration
  # 4 x 200 Gbps, data-centre network bandwidth per Pod 25.6 Tbps (= 32 hosts x 800 Gbps;
  # a 16x16 slice: 32 hosts, 64 VMs of 4 chips).
  "v6e": DcnHost(chips_per_host=8, bandwidth=4 * 200e9 / 8),
  # Cloud TPU documentation, "TPU v5p": data-centre network bandwidth 50 Gbps per chip,
  # 4-chip VMs (one host each) -> 200 Gbps per host.
  "v5p": DcnHost(chips_per_host=4, bandwidth=4 * 50e9 / 8),
}

RING_ORDERS = ("snake", "row_major")


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Modelled time of one collective; ``bandwidth_s + latency_s + reduce_s == time_s``.

  ``reduce_s`` is the time the reduction's adds add to the link time (0 unless priced).
  ``transport``: the block-scaled format of each logical axis (None: unquantized); the
  bound ``bound_s`` is always that of the unquantized ``nbytes``."""

  collective: str
  variant: str
  torus: tuple[int, ...]  # physical
  logical: tuple[int, ...]  # the torus the schedule runs on, folded onto ``torus``
  nbytes: float
  steps: int
  bandwidth_s: float
  latency_s: float
  bound_s: float
  reduce_s: float = 0.0
  transport: quantization.Transport | None = None

  @property
  def time_s(self) -> float:
    return self.bandwidth_s + self.latency_s + self.reduce_s

  @property
  def ratio_to_bound(self) -> float:
    return self.time_s / self.bound_s


# ----------------------------------------------------------------------------------------
# Physical links and the embedding of logical hops.


def _num_links(physical: Sequence[int]) -> int:
  return int(np.prod(physical)) * 2 * len(physical)


def _link_index(coords: Sequence[int], axis: int, direction: int, physical: Sequence[int]) -> int:
  """Index of the directed link leaving chip ``coords`` along ``axis`` in ``direction``."""
  device = int(np.ravel_multi_index(tuple(coords), tuple(physical)))
  return (device * len(physical) + axis) * 2 + (direction == -1)


def link_key(index: int, physical: Sequence[int]) -> tuple[tuple[int, ...], int, int]:
  """``(coords, axis, direction)`` of a link index, the key ``schedule.simulate`` uses."""
  device, rest = divmod(index, 2 * len(physical))
  axis, backward = divmod(rest, 2)
  coords = tuple(int(c) for c in np.unravel_index(device, tuple(physical)))
  return coords, axis, -1 if backward else 1


def _route(src: tuple[int, ...], dst: tuple[int, ...], physical: Sequence[int]) -> list[int]:
  """Links of the dimension-order route from ``src`` to ``dst``, shorter way round."""
  links, here = [], list(src)
  for axis, n in enumerate(physical):
    forward = (dst[axis] - here[axis]) % n
    direction, hops = (1, forward) if forward <= n - forward else (-1, n - forward)
    for _ in range(hops):
      links.append(_link_index(here, axis, direction, physical))
      here[axis] = (here[axis] + direction) % n
  return links


def _snake(dims: tuple[int, ...]) -> list[tuple[int, ...]]:
  """Boustrophedon order of a box: consecutive entries differ by one along one axis."""
  if not dims:
    return [()]
  inner = _snake(dims[1:])
  return [(i,) + c for i in range(dims[0]) for c in (inner[::-1] if i % 2 else inner)]


def ring_order(physical: Sequence[int], order: str = "snake") -> list[tuple[int, ...]]:
  """The chips of a torus (any number of dimensions) in the order a 1-D ring visits them."""
  if order not in RING_ORDERS:
    raise ValueError(f"ring order must be one of {RING_ORDERS}, got {order=}")
  if order == "row_major":
    return list(np.ndindex(*physical))
  return _snake(tuple(physical))


def placement(
  logical: Sequence[int], physical: Sequence[int], order: str = "snake"
) -> dict[tuple[int, ...], tuple[int, ...]] | None:
  """Physical chip of every logical device, or None if ``logical`` does not fold onto it.

  The leading logical axes are physical axes; the last logical axis runs through the
  remaining physical dimensions in ring ``order``. This covers a schedule on its own torus,
  a 1-D ring over all chips, and a 2-D schedule ``(X, Y * Z)`` on an ``X x Y x Z`` torus.
  """
  logical, physical = tuple(logical), tuple(physical)
  k = len(logical) - 1
  if k < 0 or logical[:k] != physical[:k] or logical[k] != int(np.prod(physical[k:])):
    return None
  ring = ring_order(physical[k:], order)
  return {c: c[:k] + ring[c[k]] for c in np.ndindex(*logical)}


@functools.lru_cache(maxsize=64)
def _shift_loads(
  logical: tuple[int, ...], physical: tuple[int, ...], order: str
) -> dict[tuple[int, int], tuple[np.ndarray, int]]:
  """For each logical hop ``(axis, direction)``: uses of every physical link, max hops.

  When all devices send one slab of ``b`` bytes along a logical ``(axis, direction)``,
  physical link ``l`` carries ``b * uses[l]`` bytes.
  """
  place = placement(logical, physical, order)
  out = {}
  for axis, n in enumerate(logical):
    for direction in (1, -1):
      uses = np.zeros(_num_links(physical))
      if logical == physical:  # a schedule on its own torus: one link per hop
        for coords in np.ndindex(*physical):
          uses[_link_index(coords, axis, direction, physical)] += 1
        out[axis, direction] = (uses, 1)
        continue
      hops = 0
      for src, chip in place.items():
        dst = list(src)
        dst[axis] = (dst[axis] + direction) % n
        path = _route(chip, place[tuple(dst)], physical)
        np.add.at(uses, path, 1)
        hops = max(hops, len(path))
      out[axis, direction] = (uses, hops)
  return out


def _embedding(
  sched: schedule_lib.Schedule, physical: Sequence[int] | None, order: str
) -> tuple[tuple[int, ...], dict]:
  physical = tuple(sched.torus if physical is None else physical)
  if placement(sched.torus, physical, order) is None:
    raise ValueError(
      f"schedule torus {sched.torus} cannot be laid onto {physical=}: use a schedule of "
      "the same shape, a 1-D ring over the same chips, or one whose last axis folds the "
      "trailing physical dimensions (X x YZ on X x Y x Z)"
    )
  return physical, _shift_loads(sched.torus, physical, order)


def wire_scale(transport, num_axes: int, itemsize: float | None) -> tuple[float, ...]:
  """The factor block-scaled ``transport`` applies to the bytes of a hop along each of
  ``num_axes`` logical axes: ``fmt.wire_bytes_per_element / itemsize`` on a quantized axis,
  1 on the others. ``transport``: None, one ``quantization.BlockScaled`` for every axis, or
  a sequence of one (or None) per axis; ``itemsize``: bytes per element of the unquantized
  dtype (needed only where an axis is quantized)."""
  per_axis = _per_axis(transport, num_axes)
  if any(per_axis) and not (itemsize and itemsize > 0):
    raise ValueError(
      f"a quantized transport needs the unquantized dtype's itemsize, got {itemsize=}"
    )
  return tuple(1.0 if f is None else f.wire_bytes_per_element / itemsize for f in per_axis)


def _per_axis(transport, num_axes: int) -> quantization.Transport:
  """``transport`` (see ``wire_scale``) as one format or None per axis."""
  if transport is None or isinstance(transport, quantization.BlockScaled):
    return (transport,) * num_axes
  per_axis = tuple(transport)
  if len(per_axis) != num_axes or not all(
    f is None or isinstance(f, quantization.BlockScaled) for f in per_axis
  ):
    raise ValueError(
      f"transport must be None, a quantization.BlockScaled or one of those (or None) per "
      f"axis of the {num_axes}-axis schedule, got {transport!r}"
    )
  return per_axis


def _step_loads(
  sched: schedule_lib.Schedule, nbytes: float, loads: dict, scale: Sequence[float] | None = None
):
  """(bytes on every physical link, max hops, bytes each device adds, whether every stream
  continues the ring phase of the step before, how many steps) for each distinct step.

  ``scale`` (one factor per logical axis, ``wire_scale``) multiplies the bytes of the hops
  along that axis; the adds are of unquantized values. Steps that move the same slabs along
  the same logical hops load the links alike, so each kind of step is priced once.
  """
  scale = scale or (1.0,) * len(sched.torus)
  chunk = nbytes / sched.num_devices / sched.num_streams
  counts = collections.Counter(
    (
      tuple(
        (t.phase.axis, t.phase.direction, t.slab_elements(sched.torus, 1), t.phase.kind)
        for t in step
      ),
      all(t.step > 0 for t in step),
    )
    for step in sched.steps()
  )
  for (signature, continues), count in counts.items():
    link = sum(
      loads[axis, direction][0] * slab * chunk * scale[axis]
      for axis, direction, slab, _ in signature
    )
    hops = max(loads[axis, direction][1] for axis, direction, _, _ in signature)
    added = sum(slab * chunk for *_, slab, kind in signature if kind == "reduce_scatter")
    yield link, hops, added, continues, count


def link_bytes(
  sched: schedule_lib.Schedule,
  nbytes: float,
  physical: Sequence[int] | None = None,
  order: str = "snake",
  *,
  transport=None,
  itemsize: float | None = None,
) -> np.ndarray:
  """Total bytes each directed physical link carries (index: ``link_key``), with hops
  along axes of a block-scaled ``transport`` scaled as ``wire_scale`` says."""
  physical, loads = _embedding(sched, physical, order)
  scale = wire_scale(transport, len(sched.torus), itemsize)
  total = np.zeros(_num_links(physical))
  for link, _, _, _, count in _step_loads(sched, nbytes, loads, scale):
    total += count * link
  return total


# ----------------------------------------------------------------------------------------
# Predictions.


def lower_bound(
  collective: schedule_lib.Collective, num_devices: int, nbytes: float, generation: Generation
) -> float:
  """Seconds no algorithm can beat: each chip sends (p-1)/p S (x2 for all-reduce)."""
  factor = 2 if collective == "all_reduce" else 1
  per_chip = factor * (num_devices - 1) / num_devices * nbytes
  return per_chip / (generation.links_per_chip * generation.link_bandwidth)


def predict(
  collective: schedule_lib.Collective,
  physical: Sequence[int],
  variant: schedule_lib.Variant | str,
  nbytes: float,
  generation: Generation,
  *,
  order: str = "snake",
  logical: Sequence[int] | None = None,
  reduce_pieces: int | None = None,
  transport=None,
  itemsize: float | None = None,
) -> Prediction:
  """Modelled time of ``collective`` over ``nbytes`` (full size) on a ``physical`` torus.

  The schedule runs on the ``logical`` torus (default: all chips in one ring for the ring
  variants, the physical torus itself for the others), folded onto the chips as
  ``placement`` says, with rings laid out in ``order``. ``reduce_pieces`` prices the
  reduce-scatter's adds with each slab cut into that many pipelined pieces (1: added only
  once whole; see the module docstring); None leaves them out.

  ``transport``: block-scaled transport, one ``quantization.BlockScaled`` for every logical
  axis or one (or None) per logical axis (a ring has one); ``nbytes`` is then the size in
  the unquantized dtype of ``itemsize`` bytes, and a hop along a quantized axis moves
  ``wire_bytes_per_element / itemsize`` of its bytes (``wire_scale``). The pipelined adds
  are those of the blocking Pallas kernels; the int8 kernels' adds (dequantize, add,
  requantize) are not modelled, so ``reduce_pieces`` with a quantized axis is an error.
  """
  if reduce_pieces is not None and reduce_pieces < 1:
    raise ValueError(f"reduce_pieces must be None or at least 1, got {reduce_pieces=}")
  physical = tuple(int(n) for n in physical)
  if not 1 <= len(physical) <= generation.links_per_chip // 2:
    raise ValueError(
      f"{generation.name} chips have {generation.links_per_chip} links: the model prices "
      f"tori of up to {generation.links_per_chip // 2} dimensions on them, got {physical=}"
    )
  if nbytes <= 0:
    raise ValueError(f"nbytes must be positive, got {nbytes=}")
  variant = schedule_lib.Variant(variant)
  p = int(np.prod(physical))
  if logical is None:
    ring = variant in (schedule_lib.Variant.RING, schedule_lib.Variant.BIDIRECTIONAL_RING)
    logical = (p,) if ring else physical
  sched = schedule_lib.build(collective, tuple(logical), variant)
  per_axis = _per_axis(transport, len(sched.torus))
  if any(per_axis) and reduce_pieces is not None:
    raise ValueError(
      "reduce_pieces prices the blocking Pallas kernels' pipelined adds; those of the "
      "block-scaled kernels are not modelled: pass reduce_pieces=None"
    )
  scale = wire_scale(per_axis, len(sched.torus), itemsize)
  _, loads = _embedding(sched, physical, order)
  bandwidth = latency = exposed_adds = 0.0
  for link, hops, added, continues, count in _step_loads(sched, nbytes, loads, scale):
    transfer = link.max() / generation.link_bandwidth
    bandwidth += count * transfer
    latency += count * hops * generation.hop_latency
    if reduce_pieces is not None and added:
      add = 3 * added / generation.hbm_bandwidth
      if continues:  # its pieces were sent as the step before summed them
        step = max(transfer, add, (transfer + add) / reduce_pieces)
      else:
        step = max(transfer, add) + min(transfer, add) / reduce_pieces
      exposed_adds += count * (step - transfer)
  return Prediction(
    collective,
    variant.value,
    physical,
    sched.torus,
    float(nbytes),
    sched.num_steps,
    bandwidth,
    latency,
    lower_bound(collective, p, nbytes, generation),
    exposed_adds,
    per_axis if any(per_axis) else None,
  )


def compared_schedules(
  physical: Sequence[int],
) -> list[tuple[schedule_lib.Variant, tuple[int, ...]]]:
  """(variant, logical torus) pairs worth comparing on ``physical``: every variant on its
  default torus, and on a 3-D torus ``X x Y x Z`` also the 2-D variants on ``X x YZ`` (the
  best a 2-D schedule can do there: the YZ ring snakes through the Y-Z plane)."""
  physical = tuple(physical)
  p = int(np.prod(physical))
  out = []
  for variant in schedule_lib.Variant:
    ring = variant in (schedule_lib.Variant.RING, schedule_lib.Variant.BIDIRECTIONAL_RING)
    if not ring and len(physical) == 3:
      out.append((variant, (physical[0], physical[1] * physical[2])))
    out.append((variant, (p,) if ring else physical))
  return out


# ----------------------------------------------------------------------------------------
# Multislice: slices joined by the data-centre network.


@dataclasses.dataclass(frozen=True)
class MultislicePrediction:
  """Modelled time of a hierarchical all-reduce over ``num_slices`` slices:
  ``ici_s + dcn_s == time_s``, the phases one after another.

  ``reduce_scatter`` and ``all_gather`` are the ICI phases within each slice (all slices
  run them at once); ``dcn_bytes_per_host`` is what each host sends over DCN (and
  receives), its chips' rings together, in wire bytes."""

  reduce_scatter: Prediction
  all_gather: Prediction
  num_slices: int
  host: DcnHost
  dcn_bytes_per_host: float
  dcn_bandwidth_s: float
  dcn_latency_s: float
  dcn_transport: quantization.BlockScaled | None = None

  @property
  def ici_s(self) -> float:
    return self.reduce_scatter.time_s + self.all_gather.time_s

  @property
  def dcn_s(self) -> float:
    return self.dcn_bandwidth_s + self.dcn_latency_s

  @property
  def time_s(self) -> float:
    return self.ici_s + self.dcn_s


def multislice_all_reduce(
  generation: Generation,
  slice_torus: Sequence[int],
  num_slices: int,
  nbytes: float,
  dcn_transport: quantization.BlockScaled | None = None,
  *,
  itemsize: float | None = None,
  variant: schedule_lib.Variant | str = "torus_split",
  ici_transport=None,
  host: DcnHost | None = None,
  dcn_hop_latency: float | None = None,
  order: str = "snake",
) -> MultislicePrediction:
  """Modelled all-reduce of ``nbytes`` (full size, in the dtype of ``itemsize`` bytes)
  over ``num_slices`` slices of ``slice_torus`` chips, joined by DCN.

  Algorithm (hierarchical): (1) the ICI reduce-scatter of ``variant`` within each slice
  (``predict``), leaving each of the slice's ``p`` chips the slice's sum of one shard of
  ``nbytes / p``; (2) for every chip position, a ring all-reduce of that shard over DCN
  among the ``n = num_slices`` chips at that position, a ring reduce-scatter then a ring
  all-gather: ``2 (n - 1)`` steps, each sending ``shard / n`` per chip; (3) the ICI
  all-gather within each slice.

  DCN price: all chips of a host (``min(chips_per_host, p)`` of them) run their rings at
  once and share the host's NICs, so a step costs ``hop_latency + c * shard / n * r /
  bandwidth``, with ``c`` the chips sharing the host and ``r`` the wire-byte ratio of
  ``dcn_transport`` (``wire_scale``; 1 unquantized): DCN costs

      2 (n - 1) / n * c * (nbytes / p) * r / bandwidth  +  2 (n - 1) * hop_latency.

  Assumptions: the fabric between hosts is non-blocking (only the NICs limit), the three
  phases do not overlap, and the hosts' NICs carry only this traffic. ``host`` defaults to
  ``DCN_HOSTS[generation.name]``, its latency to ``dcn_hop_latency`` where given.
  ``dcn_transport`` quantizes the DCN hops only; ``ici_transport`` (as ``predict``'s
  ``transport``) the ICI phases.
  """
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f"num_slices must be a positive int, got {num_slices!r}")
  if host is None:
    if generation.name not in DCN_HOSTS:
      raise ValueError(
        f"no DCN constants for {generation.name} (known: {sorted(DCN_HOSTS)}): pass host="
      )
    host = DCN_HOSTS[generation.name]
  if dcn_hop_latency is not None:
    host = dataclasses.replace(host, hop_latency=dcn_hop_latency)
  if dcn_transport is not None and not isinstance(dcn_transport, quantization.BlockScaled):
    raise ValueError(
      f"dcn_transport must be None or a quantization.BlockScaled, got {dcn_transport!r}"
    )
  (ratio,) = wire_scale(dcn_transport, 1, itemsize)
  phases = [
    predict(
      collective,
      slice_torus,
      variant,
      nbytes,
      generation,
      order=order,
      transport=ici_transport,
      itemsize=itemsize,
    )
    for collective in ("reduce_scatter", "all_gather")
  ]
  p, n = int(np.prod(slice_torus)), num_slices
  sharing = min(host.chips_per_host, p)
  per_host = 2 * (n - 1) / n * sharing * nbytes / p * ratio
  return MultislicePrediction(
    *phases,
    num_slices=n,
    host=host,
    dcn_bytes_per_host=per_host,
    dcn_bandwidth_s=per_host / host.bandwidth,
    dcn_latency_s=2 * (n - 1) * host.hop_latency,
    dcn_transport=dcn_transport,
  )
