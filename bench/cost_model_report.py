"""The cost model's report: ResNet-50's gradient collective priced on the paper's pod,
today's 2-D pods (v5e, v6e) and 3-D slices of v4 and v5p, as a table and a PNG.

  python -m bench.cost_model_report [--alpha S] [--collective all_reduce]
      [--reduce-pieces K] [--plot PATH] [--plot-generations v4,v5p]

Every figure is the alpha-beta model of ``torus_collectives.cost_model`` (modelled, never
measured); the pricing lives there, this module only tabulates and plots it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import numpy as np

from torus_collectives import schedule as schedule_lib
from torus_collectives.cost_model import (
  DEFAULT_HOP_LATENCY_S,
  GENERATIONS,
  RESNET50_PARAMS,
  Generation,
  compared_schedules,
  lower_bound,
  predict,
)

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
  """One row per pod, gradient dtype and compared (variant, logical torus) schedule."""
  rows = []
  for name, torus in PODS:
    generation = _with_alpha(GENERATIONS[name], alpha)
    for dtype, itemsize in DTYPE_BYTES.items():
      for variant, logical in compared_schedules(torus):
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


def format_predictions(rows: list[dict]) -> str:
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
  if args.plot:
    chosen = args.plot_generations.split(",") if args.plot_generations else None
    plot_time_vs_p(args.plot, args.alpha, generations=chosen)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
