"""``python -m torus_collectives.check``: the command line, and the order of the stages.

1. probe: a worker reports the devices (the parent never opens them itself);
2. correctness (``cases``, ``verify``), in workers (``runner``);
3. measurement (``measure``), in ``--measure-runs`` (2) batches, each in fresh workers,
   so that the tuning rule's runs come from different processes; implementations that
   failed a correctness case are not timed; then, from a checkout, the ResNet example's
   train step per variant against XLA (``step``, ``--train-step``);
4. calibration and the tuning table (``calibrate``), in this process, from the timings;
5. the report (``report``) and the verdict: exit status 0 when every correctness case
   that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Sequence

from torus_collectives import registry
from torus_collectives.check import calibrate, cases, measure, report, runner, step
from torus_collectives.sizes import parse_size, size_label
from torus_collectives.tuning import tables

STAGES = ("correctness", "measure", "calibrate")
DEFAULT_TIMEOUT_S = 300.0


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m torus_collectives.check",
    description="Verify torus-collectives on this machine's devices against jax.lax, time "
    "it against XLA, fit the cost model and write the tuning table 'auto' reads.",
  )
  add = parser.add_argument
  add("--quick", action="store_true", help="a few small sizes, two tori, fewer dtypes and rounds")
  add("--out", default="torus-check", help="report folder (default: ./torus-check)")
  add(
    "--interpret", action="store_true", help="off TPU: run the Pallas kernels in TPU interpret mode"
  )
  add("--only", default=",".join(STAGES), help=f"stages to run, of {','.join(STAGES)}")
  add("--max-bytes", default="64MiB", help="largest per-device buffer (default 64MiB)")
  add("--timeout-per-case", type=float, default=DEFAULT_TIMEOUT_S, help="seconds, compile included")
  add("--case", action="append", default=[], metavar="ID", help="run only this correctness case")
  add(
    "--plugin",
    action="append",
    default=[],
    metavar="MODULE",
    help="import MODULE in every process (registers backends)",
  )
  add("--ops", help=f"correctness ops to run (default all: {','.join(cases.OPS)})")
  add("--impls", help="implementations to run (default: every registered one)")
  add("--dtypes", help=f"dtypes (default: {','.join(cases.DTYPES)})")
  add("--tori", help="tori to run, e.g. 8,2x4 (default: every torus the devices form)")
  add("--rounds", type=int, help="timed rounds per measurement run (default 25; --quick 10)")
  add(
    "--measure-runs",
    type=int,
    default=tables.MIN_RUNS,
    help="measurement runs, each in fresh processes",
  )
  add(
    "--train-step",
    choices=("auto", "off", "only"),
    default="auto",
    help="stage 2 times the ResNet example's train step where resnet/ imports (auto), "
    "never (off), or alone, without the collectives (only)",
  )
  add(
    "--step-variants",
    default=",".join(step.VARIANTS),
    help=f"train-step variants (default all: {','.join(step.VARIANTS)})",
  )
  add("--step-rounds", type=int, help="timed rounds per train-step variant (default 20; --quick 5)")
  add(
    "--no-install",
    action="store_true",
    help="write the tuning table to --out only, not where 'auto' reads",
  )
  add(
    "--cpu-devices",
    type=int,
    help="on a CPU host: simulate this many devices (sets JAX_PLATFORMS=cpu and XLA_FLAGS)",
  )
  return parser


def _split(text: str | None) -> list[str] | None:
  return None if text is None else [t for t in text.split(",") if t]


def _say(text: str) -> None:
  print(text, flush=True)


def _dry_run_note(machine: cases.Machine, interpret: bool) -> str | None:
  if machine.platform == "tpu":
    return None
  where = "simulated CPU devices" if machine.platform == "cpu" else f"{machine.platform} devices"
  kernels = " with the Pallas kernels in TPU interpret mode" if interpret else ""
  return (
    f"Dry run on {where}{kernels}: this checks the package and the pipeline; no time in "
    "this report is a TPU measurement, and the fitted constants describe this host, not "
    "a TPU interconnect."
  )


def _reproducer_options(args, case: cases.Case) -> list[str]:
  """What a case's command needs besides its id: the plugins, interpret mode for
  kernels interpreted here, and the simulated devices."""
  extra = [f"--plugin {m}" for m in args.plugin]
  if args.interpret and registry.BACKENDS[case.impl].pallas_kernels:
    extra.append("--interpret")
  if args.cpu_devices:
    extra.append(f"--cpu-devices {args.cpu_devices}")
  return extra


def _correctness(args, machine, plugins, durations) -> dict:
  start = time.perf_counter()
  if args.case:
    todo, skipped = [cases.Case.from_id(i) for i in args.case], []
  else:
    todo, skipped = cases.correctness_cases(
      machine,
      quick=args.quick,
      interpret=args.interpret,
      max_bytes=parse_size(args.max_bytes),
      ops=_split(args.ops) or cases.OPS,
      impls=_split(args.impls),
      dtypes=_split(args.dtypes) or cases.DTYPES,
      toruses=[cases.parse_topology(t) for t in _split(args.tori)] if args.tori else None,
    )
  _say(f"stage 1, correctness: {len(todo)} case(s), {len(skipped)} kind(s) not run here")
  progress = _progress("  ", len(todo))
  results, _ = runner.run_batch(
    "correctness",
    [c.id for c in todo],
    timeout_s=args.timeout_per_case,
    interpret=args.interpret,
    plugins=plugins,
    on_result=progress,
  )
  rows = []
  for c in todo:
    r = results.get(c.id, {"status": "error", "detail": "no result"})
    rows.append(
      {"id": c.id, **dataclasses.asdict(c), "torus": cases.topology(c.torus), **r}
      | {"reproducer": c.command(_reproducer_options(args, c))}
    )
  rows.sort(key=lambda r: r["status"] not in report.FAILED)  # failures first
  durations["correctness"] = round(time.perf_counter() - start, 1)
  counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", *report.FAILED)}
  return {
    "ran": True,
    "cases": rows,
    "skipped": [dataclasses.asdict(s) for s in skipped],
    "counts": counts,
  }


def _progress(prefix: str, total: int):
  """A progress callback: one line per case as it ends."""
  done = [0]

  def say(case_id: str, result: dict) -> None:
    done[0] += 1
    status = result["status"]
    detail = "" if status in ("pass", "measured") else f": {result.get('detail', '')[:200]}"
    _say(f"{prefix}[{done[0]}/{total}] {case_id} {status}{detail}")

  return say


def _measure(args, machine, plugins, exclude, durations) -> tuple[dict, list]:
  start = time.perf_counter()
  rounds = args.rounds or (tables.MIN_ROUNDS if args.quick else 25)
  todo, skipped = cases.measure_cases(
    machine,
    quick=args.quick,
    max_bytes=parse_size(args.max_bytes),
    impls=_split(args.impls),
    dtypes=[d for d in _split(args.dtypes) or [] if d != "int32"] or None,
    toruses=[cases.parse_topology(t) for t in _split(args.tori)] if args.tori else None,
    exclude=exclude,
  )
  _say(f"stage 2, measurement: {len(todo)} case(s) x {args.measure_runs} run(s) of {rounds} rounds")
  items = [dataclasses.asdict(m) | {"id": m.id} for m in todo]
  runs: dict[str, list[dict]] = {m.id: [] for m in todo}
  failed = []
  for run in range(1, args.measure_runs + 1):
    progress = _progress(f"  run {run}, ", len(todo))
    results, _ = runner.run_batch(
      "measure",
      items,
      timeout_s=args.timeout_per_case,
      plugins=plugins,
      rounds=rounds,
      on_result=progress,
    )
    for m in todo:
      r = results.get(m.id, {"status": "error", "detail": "no result"})
      if r["status"] == "measured":
        runs[m.id].append(r)
      else:
        failed.append(
          {"id": f"{m.id} (run {run})", "status": r["status"], "detail": r.get("detail", "")}
        )
  measured = [(m, runs[m.id]) for m in todo if runs[m.id]]
  rows = [row for m, rs in measured for row in measure.rows(m, rs)]
  durations["measure"] = round(time.perf_counter() - start, 1)
  note = (
    f"Each row pools the rounds of {args.measure_runs} run(s) of {rounds} interleaved rounds, "
    "each run in its own worker process; time is the median of a call; t/t_xla the median "
    "per-round time ratio to xla with its bootstrap interval."
  )
  stage = {
    "ran": True,
    "rows": rows,
    "average_busbw_GBps": measure.average_busbw(rows),
    "failed": failed,
    "skipped": [dataclasses.asdict(s) for s in skipped],
    "rounds": rounds,
    "runs": args.measure_runs,
    "note": note,
  }
  return stage, measured


def _calibrate(args, machine, measured, rows, durations) -> dict:
  start = time.perf_counter()
  fits, predicted = {}, []
  for impl, points in calibrate.points_of(rows).items():
    found = calibrate.fit(points)
    if found is None:
      continue
    fits[impl] = {
      "alpha_us": measure.sig(found.alpha * 1e6),
      "link_GBps": measure.sig(found.bandwidth / 1e9),
      "rms_relative": measure.sig(found.rms_relative),
      "points": found.points,
    }
    for op, torus, nbytes, seconds in points:
      model = calibrate.predicted(op, torus, nbytes, found.alpha, found.bandwidth)
      predicted.append(
        {
          "impl": impl,
          "case": f"{op}:{cases.topology(torus)}:{nbytes}",
          "measured_us": measure.sig(seconds * 1e6),
          "predicted_us": measure.sig(model * 1e6),
        }
      )
  complete = [(m, rs) for m, rs in measured if len(rs) >= tables.MIN_RUNS]
  table_info: dict = {"entries": 0, "path": None, "installed": None}
  if not complete:
    table_info["note"] = (
      f"No tuning table written: the rule needs {tables.MIN_RUNS} runs from different "
      "processes of each case, and no case has them."
    )
  else:
    table = calibrate.table(machine.device_kind, calibrate.host(), complete)
    out_path = calibrate.write_table(table, pathlib.Path(args.out) / "tuning.json")
    installed = None
    if not args.no_install:
      installed = str(calibrate.write_table(table, tables.cache_path()))
    choices = {
      f"{e.op} {e.dtype} {e.topology} {size_label(2**e.bucket)}": e.choice for e in table.entries
    }
    picked = {k: v for k, v in choices.items() if v != tables.BASELINE}
    table_info |= {
      "entries": len(table.entries),
      "path": str(out_path),
      "installed": installed,
      "choices": choices,
      "json": json.loads(table.to_json()),
      "markdown": tables.format_table(table),
      "note": (
        f"{len(table.entries)} entries by the package's rule, written to {out_path}"
        + (f' and to {installed}, where "auto" reads' if installed else " only (--no-install)")
        + (
          f"; a torus implementation replaces xla in {len(picked)}."
          if picked
          else "; xla everywhere."
        )
      ),
    }
  durations["calibrate"] = round(time.perf_counter() - start, 3)
  note = (
    "alpha and the per-link bandwidth fitted by non-negative least squares on relative "
    "residuals to every measured time of each implementation, with the hops and link bytes "
    "of cost_model.predict for the torus's default schedule (torus_collectives.check.calibrate)."
  )
  return {
    "ran": True,
    "fits": fits,
    "predicted": predicted,
    "shipped": calibrate.shipped_constants(),
    "table": table_info,
    "note": note,
  }


def _verdict(stage: dict | None, dry_run: bool) -> tuple[str, int]:
  suffix = " (dry run on simulated CPU devices)" if dry_run else ""
  if stage is None or not stage.get("ran"):
    return "NOT CHECKED: the correctness stage did not run" + suffix, 0
  failed = [c for c in stage["cases"] if c["status"] in report.FAILED]
  total = len(stage["cases"])
  if not failed:
    return f"PASS: all {total} correctness cases agree with jax.lax" + suffix, 0
  kinds = {s: sum(c["status"] == s for c in failed) for s in report.FAILED}
  what = ", ".join(f"{n} {s}" for s, n in kinds.items() if n)
  return (
    f"FAIL: {len(failed)} of {total} correctness cases failed ({what}); first: {failed[0]['id']}"
    + suffix,
    1,
  )


def _train_step(args, machine, plugins, only, durations) -> dict:
  """Stage 2's train step (``step``): every variant at every batch, each in a worker, the
  one under the package's XLA settings in workers of its own."""
  if args.train_step == "off" or not {"measure", "calibrate"} & only:
    return {"ran": False, "status": "skipped", "reason": "not run (--only or --train-step off)"}
  if not step.available():
    return {
      "ran": False,
      "status": "skipped",
      "reason": "it needs the checkout's resnet/ package, which the wheel does not install: "
      "run the check from a checkout of the repository",
    }
  start = time.perf_counter()
  rounds = args.step_rounds or (5 if args.quick else 20)
  items, skipped = step.plan(machine.platform, args.quick, _split(args.step_variants) or ())
  _say(f"stage 2, train step: {len(items)} variant(s) x batch, {rounds} rounds each")
  results: dict[str, dict] = {}
  for own in (False, True):
    batch = [i for i in items if i["own_process"] == own]
    if not batch:
      continue
    found, _ = runner.run_batch(
      "step",
      batch,
      timeout_s=args.timeout_per_case,
      plugins=plugins,
      rounds=rounds,
      on_result=_progress("  ", len(items)),
      xla_settings=own,
    )
    results |= found
  rows = step.rows(items, results, skipped)
  durations["train_step"] = round(time.perf_counter() - start, 1)
  measured = [r for r in rows if r["status"] == "measured"]
  described = next((r for r in results.values() if "model" in r), {})
  what = (
    f"{described.get('model')}, {described.get('image_size')} px {described.get('dtype')}"
    if "model" in described
    else "the example's model"
  )
  note = (
    f"{what}: resnet.train.make_train_step on every device, global batch = per-replica batch "
    f"x {machine.device_count}, not donated; each variant timed in {rounds} rounds "
    "interleaved with xla in its worker; images/s from the median call; t/t_xla the median "
    "per-round time ratio with its bootstrap interval."
  )
  return {
    "ran": True,
    "status": "measured" if measured else "nothing measured",
    "rows": rows,
    "rounds": rounds,
    "confidence_percent": round(100 * tables.CONFIDENCE),
    "note": note,
  }


def _stages(args) -> set[str]:
  """The stages to run; exits on an option it cannot take."""
  only = set(_split(args.only) or ())
  if not only <= set(STAGES):
    raise SystemExit(f"--only takes stages of {STAGES}, got {sorted(only - set(STAGES))}")
  unknown = sorted(set(_split(args.step_variants) or ()) - set(step.VARIANTS))
  if unknown:
    raise SystemExit(f"--step-variants takes variants of {step.VARIANTS}, got {unknown}")
  if args.case:
    only = {"correctness"}
    try:
      args.case = [cases.Case.from_id(i).id for i in args.case]
    except ValueError as e:
      raise SystemExit(str(e)) from None
  return only


def _size_the_cpu_pool(devices: int) -> None:
  """Gives the case workers' XLA CPU pool the threads that split calls in interpret mode
  need beside the collectives of ``devices`` simulated devices
  (``testing.split_interpret.cpu_pool_problem``): ``NPROC``, raised if lower."""
  from torus_collectives.testing.split_interpret import CPU_POOL_THREADS_PER_DEVICE

  needed = CPU_POOL_THREADS_PER_DEVICE * devices
  given = os.environ.get("NPROC", "")
  if not given.isdigit() or int(given) < needed:
    os.environ["NPROC"] = str(needed)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  only = _stages(args)
  if args.cpu_devices:
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
      f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    )
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for module in args.plugin:
    importlib.import_module(module)
  created = tables.now()
  _say("probing the devices (in a worker process)")
  found = runner.probe(args.plugin)
  machine = cases.Machine(
    found["platform"],
    found["device_kind"],
    found["device_count"],
    tuple(found["physical"] or ()) or None,
  )
  _say(f"  {machine.device_count} x {machine.device_kind} ({machine.platform})")
  if args.interpret and machine.platform == "cpu":
    _size_the_cpu_pool(machine.device_count)
  dry_note = _dry_run_note(machine, args.interpret)
  durations: dict[str, float] = {}
  results: dict = {
    "command": "python -m torus_collectives.check "
    + shlex.join(sys.argv[1:] if argv is None else argv),
    "created": created,
    "host": calibrate.host(),
    "machine": {
      k: found[k] for k in ("platform", "device_kind", "device_count", "process_count", "physical")
    },
    "versions": found["versions"],
    "options": vars(args),
    "dry_run": machine.platform != "tpu",
    "dry_run_note": dry_note,
    "durations_s": durations,
  }
  correctness = measure_stage = None
  if "correctness" in only:
    correctness = _correctness(args, machine, args.plugin, durations)
  results["correctness"] = correctness or {
    "ran": False,
    "cases": [],
    "skipped": [],
    "note": "Not run (--only).",
  }
  measured, rows = [], []
  if args.train_step == "only":
    measure_stage = {"ran": False, "rows": [], "note": "Not run (--train-step only)."}
  elif "measure" in only or "calibrate" in only:
    exclude = sorted(
      {c["impl"] for c in results["correctness"]["cases"] if c["status"] in report.FAILED}
    )
    measure_stage, measured = _measure(args, machine, args.plugin, exclude, durations)
    rows = measure_stage["rows"]
  results["measure"] = measure_stage or {"ran": False, "rows": [], "note": "Not run (--only)."}
  results["train_step"] = _train_step(args, machine, args.plugin, only, durations)
  if "calibrate" in only:
    results["calibrate"] = _calibrate(args, machine, measured, rows, durations)
  else:
    results["calibrate"] = {"ran": False, "note": "Not run (--only)."}
  verdict, code = _verdict(correctness, machine.platform == "cpu")
  results["verdict"], results["exit_code"] = verdict, code
  results["plots"], results["plots_note"] = report.plots(out, results)
  report.write(out, results)
  _say(f"report: {out / 'report.md'}, {out / 'results.json'}")
  _say(f"VERDICT: {verdict}")
  return code
