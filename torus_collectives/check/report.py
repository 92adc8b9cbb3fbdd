"""The check's report: ``results.json`` first, and ``report.md`` rendered from it alone.

Every figure the markdown shows is read from the results dictionary that is written as
``results.json`` (measured figures are stored rounded to the digits shown, by
``measure.sig``), so the two cannot disagree. The markdown puts the verdict first, then
the failures (each with the command that reruns it alone), then the nccl-tests-style
tables, the calibrated model beside the shipped constants, the tuning table, and the
ResNet train step per variant (every row, measured, failed or skipped with its reason).
The plots (busbw against size per implementation; the calibrated model's time against the
measured; the train step's images/s per variant) need matplotlib; without it the report
says they were skipped.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

FAILED = ("fail", "error", "hang", "crash")


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:g}"
  return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
  return lines + [""]


def _size(nbytes: int) -> str:
  from torus_collectives.sizes import size_label

  return size_label(nbytes)


def _failures(results: dict) -> list[str]:
  failed = [c for c in results["correctness"]["cases"] if c["status"] in FAILED]
  if not failed:
    return []
  lines = ["## Failures", ""]
  lines += [
    "Each failing case, with the command that runs it alone (keep `results.json`: it "
    "holds each failure's error and the end of its worker's log).",
    "",
  ]
  rows = [
    (c["id"], c["status"], c.get("wrong", "-"), c.get("detail", ""), f"`{c['reproducer']}`")
    for c in failed
  ]
  return lines + _table(("case", "status", "#wrong", "detail", "reproducer"), rows)


def _correctness(results: dict) -> list[str]:
  stage = results["correctness"]
  lines = ["## Correctness", ""]
  if not stage.get("ran"):
    return lines + [stage.get("note", "not run"), ""]
  counts: dict[tuple[str, str], dict[str, int]] = {}
  for c in stage["cases"]:
    key = (c["op"], c["impl"])
    counts.setdefault(key, {}).setdefault(c["status"], 0)
    counts[key][c["status"]] += 1
  lines += [
    "Every case compared with `jax.lax`: exact on small integers, within the package's "
    "stated rounding bound on random floats (`torus_collectives.check.verify`).",
    "",
  ]
  rows = [
    (op, impl, n.get("pass", 0), sum(n.get(s, 0) for s in FAILED), ", ".join(sorted(n)))
    for (op, impl), n in sorted(counts.items())
  ]
  lines += _table(("op", "implementation", "passed", "failed", "statuses"), rows)
  lines += ["Cases that ran:", ""]
  case_rows = [
    (c["id"], c["status"], c.get("wrong", "-"), c.get("seconds", "-")) for c in stage["cases"]
  ]
  lines += _table(("case", "status", "#wrong", "seconds"), case_rows)
  if stage["skipped"]:
    lines += ["Not run here:", ""]
    lines += _table(("cases", "why"), [(s["id"], s["reason"]) for s in stage["skipped"]])
  return lines


def _measurement(results: dict) -> list[str]:
  stage = results["measure"]
  lines = ["## Measurement", ""]
  if not stage.get("ran"):
    return lines + [stage.get("note", "not run"), ""]
  lines += [stage["note"], ""]
  groups: dict[tuple, list[dict]] = {}
  for row in stage["rows"]:
    groups.setdefault((row["op"], row["torus"], row["type"]), []).append(row)
  header = (
    "size",
    "count",
    "type",
    "implementation",
    "time (us)",
    "algbw (GB/s)",
    "busbw (GB/s)",
    "t/t_xla",
    "95% CI",
    "#wrong",
  )
  for (op, torus, dtype), rows in groups.items():
    lines += [f"### {op}, {dtype}, torus {torus}", ""]
    table_rows = [
      (
        _size(r["size"]),
        r["count"],
        r["type"],
        r["impl"],
        r["time_us"],
        r["algbw_GBps"],
        r["busbw_GBps"],
        r.get("ratio", "-"),
        f"[{r['ci_low']:g}, {r['ci_high']:g}]" if "ci_low" in r else "-",
        r["wrong"],
      )
      for r in rows
    ]
    lines += _table(header, table_rows)
  lines += ["Average bus bandwidth over the rows of each implementation:", ""]
  lines += _table(("implementation", "avg busbw (GB/s)"), stage["average_busbw_GBps"].items())
  if stage["failed"]:
    lines += ["Measurements that did not complete:", ""]
    lines += _table(
      ("case", "status", "detail"), [(f["id"], f["status"], f["detail"]) for f in stage["failed"]]
    )
  if stage["skipped"]:
    lines += _table(("not timed", "why"), [(s["id"], s["reason"]) for s in stage["skipped"]])
  return lines


def _calibration(results: dict) -> list[str]:
  stage = results["calibrate"]
  lines = ["## Calibration and the tuning table", ""]
  if not stage.get("ran"):
    return lines + [stage.get("note", "not run"), ""]
  lines += [stage["note"], ""]
  fits = stage["fits"]
  if fits:
    rows = [
      (impl, f["alpha_us"], f["link_GBps"], f["rms_relative"], f["points"])
      for impl, f in fits.items()
    ]
    header = (
      "implementation",
      "alpha (us/hop)",
      "link (GB/s, one way)",
      "rms rel. residual",
      "timings",
    )
    lines += ["Fitted to this machine's timings:", ""] + _table(header, rows)
  shipped = [
    (g["generation"], g["links_per_chip"], g["link_GBps"], g["alpha_us"]) for g in stage["shipped"]
  ]
  lines += ["The cost model's shipped constants (`cost_model.GENERATIONS`):", ""]
  lines += _table(
    ("generation", "links per chip", "link (GB/s, one way)", "alpha (us/hop)"), shipped
  )
  table = stage["table"]
  lines += ["### Tuning table", "", table["note"], ""]
  if table.get("markdown"):
    lines += [table["markdown"], ""]
  return lines


def _train_step(results: dict) -> list[str]:
  stage = results["train_step"]
  lines = ["## ResNet train step", ""]
  if not stage.get("ran"):
    return lines + [f"{stage['status']}: {stage['reason']}", ""]
  lines += [stage["note"], ""]
  header = (
    "variant",
    "per-replica batch",
    "status",
    "images/s",
    "t/t_xla",
    f"{stage['confidence_percent']}% CI",
    "predicted images/s",
    "measured/predicted",
    "note",
  )
  rows = []
  for r in stage["rows"]:
    interval = f"[{r['ci_low']:g}, {r['ci_high']:g}]" if "ci_low" in r else "-"
    note = r.get("reason") or "; ".join(
      filter(None, (r.get("ratio_note"), r.get("prediction_note")))
    )
    rows.append(
      (
        r["variant"],
        r["batch"],
        r["status"],
        r.get("images_per_s", "-"),
        r.get("ratio", "-"),
        interval,
        r.get("predicted_images_per_s", "-"),
        r.get("measured_over_predicted", "-"),
        note,
      )
    )
  return lines + _table(header, rows)


def markdown(results: dict) -> str:
  """``report.md``, from ``results`` alone."""
  machine = results["machine"]
  lines = [
    "# torus-collectives hardware check",
    "",
    f"**Verdict: {results['verdict']}**",
    "",
  ]
  if results.get("dry_run_note"):
    lines += [f"> {results['dry_run_note']}", ""]
  lines += [
    f"- command: `{results['command']}`",
    f"- devices: {machine['device_count']} x {machine['device_kind']} ({machine['platform']}), "
    f"{machine['process_count']} process(es); chips' torus: {machine.get('physical') or 'none'}",
    "- versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v),
    f"- host: {results['host']}; started {results['created']}",
    "- stage seconds: " + ", ".join(f"{k} {v:g}" for k, v in results["durations_s"].items()),
    "",
  ]
  lines += _failures(results)
  lines += _correctness(results)
  lines += _measurement(results)
  lines += _calibration(results)
  lines += _train_step(results)
  lines += ["## Plots", ""]
  if results["plots"]:
    lines += [f"![{p}]({p})" for p in results["plots"]] + [""]
  lines += [results.get("plots_note") or "", ""]
  return "\n".join(lines).rstrip() + "\n"


def plots(out: pathlib.Path, results: dict) -> tuple[list[str], str | None]:
  """PNG plots into ``out``; returns (file names, a note where none could be drawn)."""
  rows = results["measure"].get("rows") or []
  steps = [r for r in results["train_step"].get("rows") or [] if "images_per_s" in r]
  if not rows and not steps:
    return [], "No plots: nothing was measured."
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return [], "Plots skipped: matplotlib is not installed (pip install matplotlib)."
  names = []
  if steps:
    names.append(_step_plot(plt, out, steps))
  if not rows:
    return names, None
  names.append(_busbw_plot(plt, out, rows))
  predicted = results["calibrate"].get("predicted") or []
  if predicted:
    fig, ax = plt.subplots(figsize=(5, 5))
    for impl in sorted({p["impl"] for p in predicted}):
      ps = [p for p in predicted if p["impl"] == impl]
      ax.scatter([p["measured_us"] for p in ps], [p["predicted_us"] for p in ps], label=impl, s=12)
    low = min(min(p["measured_us"], p["predicted_us"]) for p in predicted)
    high = max(max(p["measured_us"], p["predicted_us"]) for p in predicted)
    ax.plot([low, high], [low, high], color="grey", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured (us)", ylabel="calibrated model (us)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "model.png", dpi=100)
    plt.close(fig)
    names.append("model.png")
  return names, None


def _busbw_plot(plt, out: pathlib.Path, rows: Sequence[dict]) -> str:
  """busbw against size, a line per implementation, dtype and torus; a panel per op."""
  ops = sorted({r["op"] for r in rows})
  fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
  for ax, op in zip(axes[0], ops):
    lines: dict[str, list] = {}
    for r in rows:
      if r["op"] == op:
        lines.setdefault(f"{r['impl']} {r['type']} {r['torus']}", []).append(r)
    for label, rs in sorted(lines.items()):
      rs.sort(key=lambda r: r["size"])
      ax.plot([r["size"] for r in rs], [r["busbw_GBps"] for r in rs], marker="o", label=label)
    ax.set(xscale="log", xlabel="bytes", ylabel="busbw (GB/s)", title=op)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(out / "busbw.png", dpi=100)
  plt.close(fig)
  return "busbw.png"


def _step_plot(plt, out: pathlib.Path, steps: Sequence[dict]) -> str:
  """Bars of the train step's images/s, a group per variant, a bar per batch."""
  variants = list(dict.fromkeys(r["variant"] for r in steps))
  batches = sorted({r["batch"] for r in steps})
  width = 0.8 / len(batches)
  fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(variants), 4))
  for n, batch in enumerate(batches):
    got = {r["variant"]: r["images_per_s"] for r in steps if r["batch"] == batch}
    xs = [i + n * width for i, v in enumerate(variants) if v in got]
    ax.bar(xs, [got[v] for v in variants if v in got], width, label=f"{batch} per replica")
  ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(variants))])
  ax.set_xticklabels(variants, rotation=20, fontsize=7)
  ax.set(ylabel="images/s", title="ResNet train step")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "train_step.png", dpi=100)
  plt.close(fig)
  return "train_step.png"


def write(out: pathlib.Path, results: dict) -> None:
  """``results.json`` and ``report.md`` into ``out``."""
  (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
  (out / "report.md").write_text(markdown(results))
