"""Turns the pytest-benchmark JSON into PNG plots and a markdown table.

  python -m bench.plot [bench/results/latest.json]

writes, next to the JSON:
  collectives_busbw.png   busbw against size, per collective, mesh and implementation
  collectives_ratio.png   time over the "xla" one: median of per-round ratios, same run
  throughput.png          items/s of the other benchmarks (batch norm, input pipeline,
                          training step), where the JSON has them
  cost_model_time_vs_p.png  the modelled pod-scale all-reduce (not measured)
  cost_model_time_vs_p_3d.png  the same for the 3-D tori alone (v4, v5p)
  latest.md               the tables, with the date and the machine
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import cost_model_report
from torus_collectives.sizes import size_label

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def expand(benchmarks: list[dict]) -> list[dict]:
  """One entry per variant: an interleaved benchmark (``extra_info["variants"]``, see
  bench/conftest.py) becomes one entry per variant, with that variant's median as its
  ``stats.median`` and its own figures merged into the shared ``extra_info``."""
  out = []
  for b in benchmarks:
    info = b["extra_info"]
    if "variants" not in info:
      out.append(b)
      continue
    shared = {k: v for k, v in info.items() if k != "variants"}
    for name, variant in info["variants"].items():
      out.append(
        {
          "group": b["group"],
          "stats": {"median": variant["median_s"]},
          "extra_info": {**shared, **variant, "variant": name},
        }
      )
  return out


def _collective_entries(benchmarks: list[dict]) -> list[dict]:
  return [b for b in benchmarks if b["extra_info"].get("collective")]


def _series(entries: list[dict], key: str) -> dict:
  """{(collective, mesh): {implementation: [(nbytes, value), ...]}} sorted by size."""
  out: dict = collections.defaultdict(lambda: collections.defaultdict(list))
  for b in entries:
    info = b["extra_info"]
    if key in info:
      out[info["collective"], info["mesh"]][info["variant"]].append((info["nbytes"], info[key]))
  for lines in out.values():
    for points in lines.values():
      points.sort()
  return out


def plot_collectives(
  entries: list[dict],
  key: str,
  ylabel: str,
  path: pathlib.Path,
  reference_line: float | None = None,
  logy: bool = False,
) -> None:
  series = _series(entries, key)
  meshes = sorted({mesh for _, mesh in series})
  fig, axes = plt.subplots(
    len(COLLECTIVES),
    len(meshes),
    squeeze=False,
    figsize=(5 * len(meshes), 3.2 * len(COLLECTIVES)),
    sharex=True,
  )
  for row, collective in enumerate(COLLECTIVES):
    for col, mesh in enumerate(meshes):
      ax = axes[row][col]
      for implementation, points in sorted(series.get((collective, mesh), {}).items()):
        sizes, values = zip(*points)
        ax.plot(sizes, values, marker="o", label=implementation)
      if reference_line is not None:
        ax.axhline(reference_line, color="k", lw=0.8, ls="--")
      ax.set(
        xscale="log",
        yscale="log" if logy else "linear",
        title=f"{collective}, {mesh} mesh",
        ylabel=ylabel,
      )
      ax.grid(True, which="both", alpha=0.3)
      if row == len(COLLECTIVES) - 1:
        ax.set_xlabel("size S (bytes, full buffer)")
  axes[0][0].legend()
  fig.suptitle("Measured on simulated CPU devices (not TPU)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_throughput(benchmarks: list[dict], path: pathlib.Path) -> bool:
  """Bar chart of items/s per group and variant; False if the JSON has none."""
  groups: dict = collections.defaultdict(dict)
  for b in benchmarks:
    info = b["extra_info"]
    if "items_per_s" in info:
      groups[b["group"]][info["variant"]] = (info["items_per_s"], info.get("unit", "items/s"))
  if not groups:
    return False
  fig, axes = plt.subplots(1, len(groups), squeeze=False, figsize=(4.5 * len(groups), 3.5))
  for ax, (group, variants) in zip(axes[0], sorted(groups.items())):
    names = sorted(variants)
    values = [variants[n][0] for n in names]
    ax.bar(names, values)
    ax.set(title="\n".join(textwrap.wrap(group, 36)), ylabel=variants[names[0]][1])
    if max(values) > 20 * min(values):  # e.g. the input pipeline beside the train step
      ax.set_yscale("log")
    ax.tick_params(axis="x", rotation=20)
  fig.suptitle("Measured on CPU (shared machine)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def markdown(data: dict) -> str:
  """The collective table (busbw and time ratio per implementation) and other groups."""
  machine = data.get("machine_info", {})
  cpu = machine.get("cpu", {}).get("brand_raw", "unknown CPU")
  lines = [
    f"Run {data.get('datetime', '?')} on {cpu}, {machine.get('cpu', {}).get('count', '?')}"
    " cores, 8 simulated CPU devices; timings on a shared machine are noisy.",
    "",
  ]
  benchmarks = expand(data["benchmarks"])
  entries = _collective_entries(benchmarks)
  impls = sorted(
    {b["extra_info"]["variant"] for b in entries}, key=lambda name: (name != "xla", name)
  )
  if entries:
    lines += [
      "| collective | mesh | size | "
      + " | ".join(f"{i} busbw GB/s | {i} t/t_xla" for i in impls)
      + " |",
      "|---" * (3 + 2 * len(impls)) + "|",
    ]
    rows = collections.defaultdict(dict)
    for b in entries:
      info = b["extra_info"]
      rows[info["collective"], info["mesh"], info["nbytes"]][info["variant"]] = info
    for (collective, mesh, nbytes), by_impl in sorted(
      rows.items(), key=lambda kv: (COLLECTIVES.index(kv[0][0]), kv[0][1], kv[0][2])
    ):
      cells = []
      for i in impls:
        info = by_impl.get(i, {})
        cells.append(f"{info['busbw_GBps']:.2f}" if "busbw_GBps" in info else "-")
        ratio = info.get("time_ratio_to_xla")
        cells.append(f"{ratio:.2f}" if ratio is not None else "-")
      lines.append(f"| {collective} | {mesh} | {size_label(nbytes)} | " + " | ".join(cells) + " |")
  others = [b for b in benchmarks if "items_per_s" in b["extra_info"]]
  if others:
    lines += [
      "",
      "| group | variant | median ms | throughput | baseline | t/t_baseline |",
      "|---" * 6 + "|",
    ]
    for b in sorted(others, key=lambda b: (b["group"], b["extra_info"]["variant"])):
      info = b["extra_info"]
      ratio = next((v for k, v in info.items() if k.startswith("time_ratio_to_")), None)
      lines.append(
        f"| {b['group']} | {info['variant']} | {b['stats']['median'] * 1e3:.2f} | "
        f"{info['items_per_s']:.1f} {info.get('unit', 'items/s')} | "
        f"{info.get('baseline', '-')} | {'-' if ratio is None else f'{ratio:.2f}'} |"
      )
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  source = pathlib.Path(argv[0] if argv else "bench/results/latest.json")
  out = source.parent
  data = json.loads(source.read_text())
  benchmarks = expand(data["benchmarks"])
  entries = _collective_entries(benchmarks)
  if entries:
    plot_collectives(
      entries, "busbw_GBps", "busbw (GB/s)", out / "collectives_busbw.png", logy=True
    )
    plot_collectives(
      entries,
      "time_ratio_to_xla",
      "time / time(xla)",
      out / "collectives_ratio.png",
      reference_line=1.0,
      logy=True,
    )
  plot_throughput(benchmarks, out / "throughput.png")
  cost_model_report.plot_time_vs_p(str(out / "cost_model_time_vs_p.png"))
  three_d = sorted({name for name, torus in cost_model_report.PODS if len(torus) == 3})
  cost_model_report.plot_time_vs_p(str(out / "cost_model_time_vs_p_3d.png"), generations=three_d)
  (out / "latest.md").write_text(markdown(data))
  print((out / "latest.md").read_text())


if __name__ == "__main__":
  main(sys.argv[1:])
