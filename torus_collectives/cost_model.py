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

Not modelled: DMA issue overhead beyond ``alpha``, overlap of a step's latency with the
previous step's transfer, the HBM traffic of the DMAs themselves, and contention with other
traffic. The figures are modelled, never measured.

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

Run ``python -m torus_collectives.cost_model`` for the ResNet-50 table, ``--plot PATH``
for a PNG of time against the number of chips.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

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

RING_ORDERS = ("snake", "row_major")


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Modelled time of one collective; ``bandwidth_s + latency_s + reduce_s == time_s``.

  ``reduce_s`` is the time the reduction's adds add to the link time (0 unless priced)."""

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


def _step_loads(sched: schedule_lib.Schedule, nbytes: float, loads: dict):
  """(bytes on every physical link, max hops, bytes each device adds, whether every stream
  continues the ring phase of the step before, how many steps) for each distinct step.

  Steps that move the same slabs along the same logical hops load the links alike, so
  each kind of step is priced once.
  """
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
    link = sum(loads[axis, direction][0] * slab * chunk for axis, direction, slab, _ in signature)
    hops = max(loads[axis, direction][1] for axis, direction, _, _ in signature)
    added = sum(slab * chunk for *_, slab, kind in signature if kind == "reduce_scatter")
    yield link, hops, added, continues, count


def link_bytes(
  sched: schedule_lib.Schedule,
  nbytes: float,
  physical: Sequence[int] | None = None,
  order: str = "snake",
) -> np.ndarray:
  """Total bytes each directed physical link carries (index: ``link_key``)."""
  physical, loads = _embedding(sched, physical, order)
  total = np.zeros(_num_links(physical))
  for link, _, _, _, count in _step_loads(sched, nbytes, loads):
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
) -> Prediction:
  """Modelled time of ``collective`` over ``nbytes`` (full size) on a ``physical`` torus.

  The schedule runs on the ``logical`` torus (default: all chips in one ring for the ring
  variants, the physical torus itself for the others), folded onto the chips as
  ``placement`` says, with rings laid out in ``order``. ``reduce_pieces`` prices the
  reduce-scatter's adds with each slab cut into that many pipelined pieces (1: added only
  once whole; see the module docstring); None leaves them out.
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
  _, loads = _embedding(sched, physical, order)
  bandwidth = latency = exposed_adds = 0.0
  for link, hops, added, continues, count in _step_loads(sched, nbytes, loads):
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
  )


def candidates(physical: Sequence[int]) -> list[tuple[schedule_lib.Variant, tuple[int, ...]]]:
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
# The command line: ResNet-50's gradient on the paper's pod, today's 2-D pods (v5e, v6e)
# and 3-D slices of v4 and v5p.

PODS = (
  ("v3", (32, 32)),
  ("v5e", (16, 16)),
  ("v6e", (16, 16)),
  ("v4", (8, 8, 8)),
  ("v4", (16, 16, 16)),
  ("v5p", (8, 8, 8)),
  ("v5p", (16, 16, 16)),
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def resnet50_table(
  alpha: float | None = None,
  collective: schedule_lib.Collective = "all_reduce",
  reduce_pieces: int | None = None,
) -> list[dict]:
  """One row per pod, gradient dtype and (variant, logical torus) candidate."""
  rows = []
  for name, torus in PODS:
    generation = _with_alpha(GENERATIONS[name], alpha)
    for dtype, itemsize in DTYPE_BYTES.items():
      for variant, logical in candidates(torus):
        pred = predict(
          collective,
          torus,
          variant,
          RESNET50_PARAMS * itemsize,
          generation,
          logical=logical,
          reduce_pieces=reduce_pieces,
        )
        rows.append({"generation": name, "dtype": dtype, "prediction": pred})
  return rows


def _with_alpha(generation: Generation, alpha: float | None) -> Generation:
  return generation if alpha is None else dataclasses.replace(generation, hop_latency=alpha)


def _shape(torus: Sequence[int]) -> str:
  return "x".join(map(str, torus))


def format_table(rows: list[dict]) -> str:
  header = (
    f"{'pod':<15}{'dtype':<10}{'variant':<20}{'on':<9}{'steps':>6}{'time ms':>10}"
    f"{'bw ms':>9}{'lat ms':>9}{'bound ms':>10}{'x bound':>9}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    pred = row["prediction"]
    pod = f"{row['generation']} {_shape(pred.torus)}"
    lines.append(
      f"{pod:<15}{row['dtype']:<10}{pred.variant:<20}{_shape(pred.logical):<9}{pred.steps:>6}"
      f"{pred.time_s * 1e3:>10.3f}{pred.bandwidth_s * 1e3:>9.3f}"
      f"{pred.latency_s * 1e3:>9.3f}{pred.bound_s * 1e3:>10.3f}{pred.ratio_to_bound:>9.2f}"
    )
  return "\n".join(lines)


def plot_time_vs_p(
  path: str,
  alpha: float | None = None,
  dtype: str = "float32",
  generations: Sequence[str] | None = None,
) -> None:
  """PNG: modelled all-reduce time of ResNet-50's gradient against p, one panel per
  generation (its largest pod in ``PODS``), with the 1-D, 2-D and (on v4, v5p) 3-D
  schedules on cubic (square) slices."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  nbytes = RESNET50_PARAMS * DTYPE_BYTES[dtype]
  pods = {name: torus for name, torus in PODS if generations is None or name in generations}
  fig, axes = plt.subplots(1, len(pods), figsize=(5 * len(pods), 4.5), sharey=True, squeeze=False)
  for ax, (name, pod) in zip(axes[0], pods.items()):
    generation = _with_alpha(GENERATIONS[name], alpha)
    sides = [n for n in (2, 4, 8, 16, 32) if n <= pod[0]]
    ps = [n ** len(pod) for n in sides]
    for variant, logical in candidates((sides[0],) * len(pod)):
      folded = len(logical) == 2 and len(pod) == 3
      times = [
        predict(
          "all_reduce",
          (n,) * len(pod),
          variant,
          nbytes,
          generation,
          logical=(n, n * n) if folded else None,
        ).time_s
        for n in sides
      ]
      dims = len(logical) if variant.value.startswith("torus") else 1
      ax.plot(ps, np.array(times) * 1e3, marker="o", label=f"{variant.value} ({dims}-D)")
    bound = [lower_bound("all_reduce", p, nbytes, generation) * 1e3 for p in ps]
    ax.plot(ps, bound, "k--", label=f"{generation.links_per_chip}-link bound")
    ax.set(
      xscale="log",
      yscale="log",
      xlabel=f"chips p ({'x'.join('n' * len(pod))} torus)",
      title=f"{name}: {generation.links_per_chip} links x "
      f"{generation.link_bandwidth / 1e9:.0f} GB/s, alpha {generation.hop_latency * 1e6:g} us",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
  axes[0][0].set_ylabel("all-reduce time (ms)")
  fig.suptitle(f"ResNet-50 {dtype} gradient all-reduce: alpha-beta model, not measured")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--alpha",
    type=float,
    default=None,
    help=f"per-hop latency in seconds (default {DEFAULT_HOP_LATENCY_S})",
  )
  parser.add_argument(
    "--collective", default="all_reduce", choices=("all_reduce", "reduce_scatter", "all_gather")
  )
  parser.add_argument(
    "--reduce-pieces",
    type=int,
    default=None,
    help="also price the reduce-scatter's adds, each slab in this many pipelined pieces "
    "(1: unpipelined)",
  )
  parser.add_argument("--plot", metavar="PATH", help="also write a PNG of time against p")
  parser.add_argument(
    "--plot-generations",
    default=None,
    help="comma-separated generations to plot (default: every one in the table)",
  )
  args = parser.parse_args(argv)
  print(
    f"ResNet-50 gradient ({RESNET50_PARAMS:,} parameters), {args.collective}, "
    "alpha-beta model (modelled, not measured)"
  )
  if args.reduce_pieces is not None:
    print(f"adds priced at HBM bandwidth, slabs in {args.reduce_pieces} pipelined piece(s)")
  print(format_table(resnet50_table(args.alpha, args.collective, args.reduce_pieces)))
  if args.plot:
    chosen = args.plot_generations.split(",") if args.plot_generations else None
    plot_time_vs_p(args.plot, args.alpha, generations=chosen)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
