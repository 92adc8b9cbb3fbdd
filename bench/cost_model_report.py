"""The cost model's report: ResNet-50's gradient collective priced on the paper's pod,
today's 2-D pods (v5e, v6e) and 3-D slices of v4 and v5p, as a table and a PNG; then the
same on v5e and v6e with block-scaled int8 transport (blocks of 128, bfloat16 scales)
against the bound of the unquantized gradient, and a hierarchical all-reduce over 4
slices joined by the data-centre network, with and without int8 on the DCN hops.

  python -m bench.cost_model_report [--alpha S] [--dcn-alpha S]
      [--collective all_reduce] [--reduce-pieces K] [--plot PATH]
      [--plot-generations v4,v5p]

Every figure is the alpha-beta model of ``torus_collectives.cost_model`` (modelled, never
measured); the pricing lives there, this module only tabulates and plots it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from torus_collectives import schedule as schedule_lib
from torus_collectives.cost_model import (
  DEFAULT_DCN_HOP_LATENCY_S,
  DEFAULT_HOP_LATENCY_S,
  GENERATIONS,
  RESNET50_PARAMS,
  Generation,
  compared_schedules,
  lower_bound,
  multislice_all_reduce,
  predict,
)
from torus_collectives.quantization import BlockScaled

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
# Block-scaled transport priced on today's 2-D pods, and the multislice configuration:
# 4 slices of 16x16 (4 x v5e-256 and 4 x v6e-256) all-reducing the bfloat16 gradient.
INT8 = BlockScaled("int8", 128)
QUANTIZED_PODS = (("v5e", (16, 16)), ("v6e", (16, 16)))
MULTISLICE_PODS = QUANTIZED_PODS
MULTISLICE_SLICES = 4
MULTISLICE_DTYPE = "bfloat16"


def resnet50_table(
  alpha: float | None = None,
  collective: schedule_lib.Collective = "all_reduce",
  reduce_pieces: int | None = None,
  *,
  pods: Sequence[tuple[str, tuple[int, ...]]] = PODS,
  transport: BlockScaled | None = None,
) -> list[dict]:
  """One row per pod, gradient dtype and compared (variant, logical torus) schedule.

  With ``transport``, every axis sends it (``predict``'s ``transport``), and each row
  also holds the unquantized prediction (``"unquantized"``) it is compared with; the adds
  are then not priced (``reduce_pieces`` ignored: the int8 kernels' adds are not modelled).
  """
  rows = []
  for name, torus in pods:
    generation = _with_alpha(GENERATIONS[name], alpha)
    for dtype, itemsize in DTYPE_BYTES.items():
      for variant, logical in compared_schedules(torus):
        price = functools.partial(
          predict, collective, torus, variant, RESNET50_PARAMS * itemsize, generation
        )
        row = {"generation": name, "dtype": dtype}
        if transport is None:
          row["prediction"] = price(logical=logical, reduce_pieces=reduce_pieces)
        else:
          row["unquantized"] = price(logical=logical)
          row["prediction"] = price(logical=logical, transport=transport, itemsize=itemsize)
        rows.append(row)
  return rows


def multislice_table(
  alpha: float | None = None,
  dcn_alpha: float | None = None,
  pods: Sequence[tuple[str, tuple[int, ...]]] = MULTISLICE_PODS,
  num_slices: int = MULTISLICE_SLICES,
  dtype: str = MULTISLICE_DTYPE,
) -> list[dict]:
  """Per pod, the hierarchical all-reduce of ResNet-50's gradient over ``num_slices``
  slices (split torus schedule within each), without and with int8 on the DCN hops, and
  the one-slice all-reduce it is compared with."""
  rows = []
  itemsize = DTYPE_BYTES[dtype]
  for name, torus in pods:
    generation = _with_alpha(GENERATIONS[name], alpha)
    nbytes = RESNET50_PARAMS * itemsize
    one_slice = predict("all_reduce", torus, "torus_split", nbytes, generation)
    for dcn in (None, INT8):
      pred = multislice_all_reduce(
        generation, torus, num_slices, nbytes, dcn, itemsize=itemsize, dcn_hop_latency=dcn_alpha
      )
      rows.append({"generation": name, "dtype": dtype, "prediction": pred, "one_slice": one_slice})
  return rows


def _transport_label(fmt: BlockScaled | None) -> str:
  return "none" if fmt is None else f"{fmt.dtype}/{fmt.block_size}"


def _with_alpha(generation: Generation, alpha: float | None) -> Generation:
  return generation if alpha is None else dataclasses.replace(generation, hop_latency=alpha)


def _shape(torus: Sequence[int]) -> str:
  return "x".join(map(str, torus))


def format_predictions(rows: list[dict]) -> str:
  """The table of ``resnet50_table`` rows; rows with an unquantized twin (a ``transport``
  table) lead with the transport and end with the time over the unquantized one."""
  quantized = any("unquantized" in row for row in rows)
  header = (
    (f"{'transport':<11}" if quantized else "")
    + f"{'pod':<15}{'dtype':<10}{'variant':<20}{'on':<9}{'steps':>6}{'time ms':>10}"
    f"{'bw ms':>9}{'lat ms':>9}{'bound ms':>10}{'x bound':>9}"
    + (f"{'x unquant':>11}" if quantized else "")
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    pred = row["prediction"]
    pod = f"{row['generation']} {_shape(pred.torus)}"
    lead = f"{_transport_label(pred.transport and pred.transport[0]):<11}" if quantized else ""
    tail = f"{pred.time_s / row['unquantized'].time_s:>11.2f}" if quantized else ""
    lines.append(
      f"{lead}{pod:<15}{row['dtype']:<10}{pred.variant:<20}{_shape(pred.logical):<9}"
      f"{pred.steps:>6}{pred.time_s * 1e3:>10.3f}{pred.bandwidth_s * 1e3:>9.3f}"
      f"{pred.latency_s * 1e3:>9.3f}{pred.bound_s * 1e3:>10.3f}{pred.ratio_to_bound:>9.2f}"
      f"{tail}"
    )
  return "\n".join(lines)


def format_multislice(rows: list[dict]) -> str:
  header = (
    f"{'slices':<20}{'dtype':<10}{'dcn':<10}{'ici ms':>9}{'dcn bw ms':>11}{'dcn lat ms':>12}"
    f"{'dcn ms':>9}{'time ms':>10}{'x 1 slice':>11}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    pred = row["prediction"]
    slices = f"{pred.num_slices} x {row['generation']} {_shape(pred.reduce_scatter.torus)}"
    lines.append(
      f"{slices:<20}{row['dtype']:<10}{_transport_label(pred.dcn_transport):<10}"
      f"{pred.ici_s * 1e3:>9.3f}{pred.dcn_bandwidth_s * 1e3:>11.3f}"
      f"{pred.dcn_latency_s * 1e3:>12.3f}{pred.dcn_s * 1e3:>9.3f}{pred.time_s * 1e3:>10.3f}"
      f"{pred.time_s / row['one_slice'].time_s:>11.2f}"
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
    for variant, logical in compared_schedules((sides[0],) * len(pod)):
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
    "--dcn-alpha",
    type=float,
    default=None,
    help=f"per-hop DCN latency in seconds (default {DEFAULT_DCN_HOP_LATENCY_S})",
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
  print(format_predictions(resnet50_table(args.alpha, args.collective, args.reduce_pieces)))
  print(
    f"\nblock-scaled transport {_transport_label(INT8)} ({INT8.wire_bytes_per_element:.4g} "
    "wire bytes per element, a bfloat16 scale per block) on every axis; bound and "
    "'x bound' of the unquantized dtype, 'x unquant' against the same schedule unquantized"
    + (
      " (adds not priced: the int8 kernels' adds are not modelled)"
      if args.reduce_pieces is not None
      else ""
    )
  )
  print(
    format_predictions(
      resnet50_table(args.alpha, args.collective, pods=QUANTIZED_PODS, transport=INT8)
    )
  )
  print(
    f"\nmultislice all-reduce, {MULTISLICE_DTYPE} gradient: ICI reduce-scatter in each slice "
    "(torus_split), ring all-reduce of each chip's shard over DCN, ICI all-gather; DCN per "
    "host (NICs shared by the host's chips), 'x 1 slice' against the one-slice all-reduce"
  )
  print(format_multislice(multislice_table(args.alpha, args.dcn_alpha)))
  if args.plot:
    chosen = args.plot_generations.split(",") if args.plot_generations else None
    plot_time_vs_p(args.plot, args.alpha, generations=chosen)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
