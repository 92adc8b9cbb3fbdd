"""An alpha-beta cost model of the torus collectives at pod scale.

It prices the very ``schedule.Schedule`` objects that the kernels and the ``shard_map``
fallback execute, so the model cannot drift from the algorithm:

* The schedule's streams advance in lockstep, one global step at a time. In a step every
  device sends, per transfer, one slab of ``Transfer.slab_elements`` elements to its ring
  neighbour.
* Each logical hop is mapped onto the chips' physical links. The 2-D variants run on a
  physical torus of the same shape, one link per hop. A 1-D ring is laid onto the 2-D
  torus along a closed path (a boustrophedon "snake" by default, so neighbours on the ring
  are neighbours on the torus; "row_major" shows what a careless embedding costs), and
  hops between chips that are not neighbours follow dimension-order routing.
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
  (the pipeline's fill or drain). The next step's sends start when the step is done.

Not modelled: DMA issue overhead beyond ``alpha``, overlap of a step's latency with the
previous step's transfer, the HBM traffic of the DMAs themselves, and contention with other
traffic. The figures are modelled, never measured.

The physical lower bound for an all-reduce of ``S`` bytes over ``p`` chips with ``L``
links each is ``2 (p - 1) / p * S / (L B)``: every chip must send (and receive) that many
bytes and can push at most ``L B`` bytes/s. Reduce-scatter and all-gather need half.

Run ``python -m torus_collectives.cost_model`` for the ResNet-50 table, ``--plot PATH``
for a PNG of time against the number of chips.
"""

from __future__ import annotations

import argparse
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
    Generation("v4", links_per_chip=6, link_bandwidth=2400e9 / 8 / 6, hbm_bandwidth=1200e9),
    # Cloud TPU v5e docs: 400 GB/s bidirectional ICI per chip, 4 ICI ports, 2-D torus
    # -> 50 GB/s one way per link.
    Generation("v5e", links_per_chip=4, link_bandwidth=400e9 / 2 / 4, hbm_bandwidth=819e9),
    # Cloud TPU v5p docs: 1,200 GB/s bidirectional ICI per chip, 3-D torus (6 links)
    # -> 100 GB/s one way per link.
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
  torus: tuple[int, ...]
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


def ring_order(physical: Sequence[int], order: str = "snake") -> list[tuple[int, ...]]:
  """The chips of a 2-D torus in the order a 1-D ring visits them."""
  if order not in RING_ORDERS:
    raise ValueError(f"ring order must be one of {RING_ORDERS}, got {order=}")
  if len(physical) != 2:
    raise ValueError(f"rings are laid onto a 2-D torus, got {physical=}")
  rows, cols = physical
  out = []
  for i in range(rows):
    reverse = order == "snake" and i % 2
    out.extend((i, j) for j in (range(cols - 1, -1, -1) if reverse else range(cols)))
  return out


@functools.lru_cache(maxsize=64)
def _shift_loads(
  logical: tuple[int, ...], physical: tuple[int, ...], order: str
) -> dict[tuple[int, int], tuple[np.ndarray, int]]:
  """For each logical hop ``(axis, direction)``: uses of every physical link, max hops.

  When all devices send one slab of ``b`` bytes along a logical ``(axis, direction)``,
  physical link ``l`` carries ``b * uses[l]`` bytes.
  """
  out = {}
  for axis, n in enumerate(logical):
    for direction in (1, -1):
      uses = np.zeros(_num_links(physical))
      if logical == physical:  # 2-D schedule on its own torus: one link per hop
        for coords in np.ndindex(*physical):
          uses[_link_index(coords, axis, direction, physical)] += 1
        out[axis, direction] = (uses, 1)
        continue
      ring = ring_order(physical, order)
      hops = 0
      for r in range(n):
        path = _route(ring[r], ring[(r + direction) % n], physical)
        np.add.at(uses, path, 1)
        hops = max(hops, len(path))
      out[axis, direction] = (uses, hops)
  return out


def _embedding(
  sched: schedule_lib.Schedule, physical: Sequence[int] | None, order: str
) -> tuple[tuple[int, ...], dict]:
  physical = tuple(sched.torus if physical is None else physical)
  if sched.torus != physical:
    if len(sched.torus) != 1 or sched.num_devices != int(np.prod(physical)):
      raise ValueError(
        f"schedule torus {sched.torus} cannot be laid onto {physical=}: use a 2-D "
        "schedule of the same shape, or a 1-D ring over the same number of chips"
      )
  return physical, _shift_loads(sched.torus, physical, order)


def _step_loads(sched: schedule_lib.Schedule, nbytes: float, loads: dict):
  """Yields (bytes on every physical link, max hops, bytes each device adds) per step."""
  chunk = nbytes / sched.num_devices / sched.num_streams
  cache: dict = {}
  for step in sched.steps():
    signature = tuple(
      (t.phase.axis, t.phase.direction, t.slab_elements(sched.torus, 1), t.phase.kind) for t in step
    )
    if signature not in cache:
      link = sum(loads[axis, direction][0] * slab * chunk for axis, direction, slab, _ in signature)
      hops = max(loads[axis, direction][1] for axis, direction, _, _ in signature)
      added = sum(slab * chunk for *_, slab, kind in signature if kind == "reduce_scatter")
      cache[signature] = (link, hops, added)
    yield cache[signature]


def link_bytes(
  sched: schedule_lib.Schedule,
  nbytes: float,
  physical: Sequence[int] | None = None,
  order: str = "snake",
) -> np.ndarray:
  """Total bytes each directed physical link carries (index: ``link_key``)."""
  physical, loads = _embedding(sched, physical, order)
  total = np.zeros(_num_links(physical))
  for link, _, _ in _step_loads(sched, nbytes, loads):
    total += link
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
  reduce_pieces: int | None = None,
) -> Prediction:
  """Modelled time of ``collective`` over ``nbytes`` (full size) on a ``physical`` torus.

  Ring variants run over all chips of the torus, laid out in ``order``. ``reduce_pieces``
  prices the reduce-scatter's adds with each slab cut into that many pipelined pieces
  (1: added only once whole; see the module docstring); None leaves them out.
  """
  if reduce_pieces is not None and reduce_pieces < 1:
    raise ValueError(f"reduce_pieces must be None or at least 1, got {reduce_pieces=}")
  physical = tuple(int(n) for n in physical)
  if len(physical) != 2:
    raise ValueError(f"the model prices 2-D tori, got {physical=}")
  if nbytes <= 0:
    raise ValueError(f"nbytes must be positive, got {nbytes=}")
  variant = schedule_lib.Variant(variant)
  p = int(np.prod(physical))
  logical = (
    (p,)
    if variant in (schedule_lib.Variant.RING, schedule_lib.Variant.BIDIRECTIONAL_RING)
    else physical
  )
  sched = schedule_lib.build(collective, logical, variant)
  _, loads = _embedding(sched, physical, order)
  bandwidth = latency = exposed_adds = 0.0
  for link, hops, added in _step_loads(sched, nbytes, loads):
    transfer = link.max() / generation.link_bandwidth
    bandwidth += transfer
    latency += hops * generation.hop_latency
    if reduce_pieces is not None and added:
      add = 3 * added / generation.hbm_bandwidth
      step = max(transfer, add) + min(transfer, add) / reduce_pieces
      exposed_adds += step - transfer
  return Prediction(
    collective,
    variant.value,
    physical,
    float(nbytes),
    sched.num_steps,
    bandwidth,
    latency,
    lower_bound(collective, p, nbytes, generation),
    exposed_adds,
  )


# ----------------------------------------------------------------------------------------
# The command line: ResNet-50's gradient on the paper's pod and on today's 2-D pods.

PODS = (("v3", (32, 32)), ("v5e", (16, 16)), ("v6e", (16, 16)))
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def resnet50_table(
  alpha: float | None = None,
  collective: schedule_lib.Collective = "all_reduce",
  reduce_pieces: int | None = None,
) -> list[dict]:
  """One row per pod, gradient dtype and variant."""
  rows = []
  for name, torus in PODS:
    generation = _with_alpha(GENERATIONS[name], alpha)
    for dtype, itemsize in DTYPE_BYTES.items():
      for variant in schedule_lib.Variant:
        pred = predict(
          collective,
          torus,
          variant,
          RESNET50_PARAMS * itemsize,
          generation,
          reduce_pieces=reduce_pieces,
        )
        rows.append({"generation": name, "dtype": dtype, "prediction": pred})
  return rows


def _with_alpha(generation: Generation, alpha: float | None) -> Generation:
  return generation if alpha is None else dataclasses.replace(generation, hop_latency=alpha)


def format_table(rows: list[dict]) -> str:
  header = (
    f"{'pod':<12}{'dtype':<10}{'variant':<20}{'steps':>6}{'time ms':>10}"
    f"{'bw ms':>9}{'lat ms':>9}{'bound ms':>10}{'x bound':>9}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    pred = row["prediction"]
    pod = f"{row['generation']} {pred.torus[0]}x{pred.torus[1]}"
    lines.append(
      f"{pod:<12}{row['dtype']:<10}{pred.variant:<20}{pred.steps:>6}"
      f"{pred.time_s * 1e3:>10.3f}{pred.bandwidth_s * 1e3:>9.3f}"
      f"{pred.latency_s * 1e3:>9.3f}{pred.bound_s * 1e3:>10.3f}{pred.ratio_to_bound:>9.2f}"
    )
  return "\n".join(lines)


def plot_time_vs_p(path: str, alpha: float | None = None, dtype: str = "float32") -> None:
  """PNG: modelled all-reduce time of ResNet-50's gradient against p, one panel per pod."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  nbytes = RESNET50_PARAMS * DTYPE_BYTES[dtype]
  fig, axes = plt.subplots(1, len(PODS), figsize=(5 * len(PODS), 4), sharey=True)
  for ax, (name, pod) in zip(axes, PODS):
    generation = _with_alpha(GENERATIONS[name], alpha)
    sides = [n for n in (2, 4, 8, 16, 32) if n <= pod[0]]
    ps = [n * n for n in sides]
    for variant in schedule_lib.Variant:
      times = [predict("all_reduce", (n, n), variant, nbytes, generation).time_s for n in sides]
      ax.plot(ps, np.array(times) * 1e3, marker="o", label=variant.value)
    bound = [lower_bound("all_reduce", p, nbytes, generation) * 1e3 for p in ps]
    ax.plot(ps, bound, "k--", label="lower bound")
    ax.set(
      xscale="log",
      yscale="log",
      xlabel="chips p (n x n torus)",
      title=f"{name}: {generation.links_per_chip} links x "
      f"{generation.link_bandwidth / 1e9:.0f} GB/s, alpha {generation.hop_latency * 1e6:g} us",
    )
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("all-reduce time (ms)")
  axes[0].legend()
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
  args = parser.parse_args(argv)
  print(
    f"ResNet-50 gradient ({RESNET50_PARAMS:,} parameters), {args.collective}, "
    "alpha-beta model (modelled, not measured)"
  )
  if args.reduce_pieces is not None:
    print(f"adds priced at HBM bandwidth, slabs in {args.reduce_pieces} pipelined piece(s)")
  print(format_table(resnet50_table(args.alpha, args.collective, args.reduce_pieces)))
  if args.plot:
    plot_time_vs_p(args.plot, args.alpha)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
