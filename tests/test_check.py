"""The hardware check, ``python -m torus_collectives.check``, as a dry run on 8 simulated CPU
devices: it runs end to end and reports exactly what ran, with every figure of
``report.md`` in ``results.json``; a stand-in backend that sums wrong and one that never
returns (both registered by a ``--plugin`` module, in every worker) are caught, the hang
within its timeout, and the run completes; the fit recovers the cost model's constants
from noisy synthetic timings; and the tuning table it writes obeys the package's rule and
is what "auto" then reads.

Each command runs in a subprocess (it starts workers of its own), on tiny sizes, one op
and one torus: the whole file is a few worker start-ups.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from torus_collectives import registry
from torus_collectives.check import calibrate, cases, report, step
from torus_collectives.sizes import KiB, MiB
from torus_collectives.tuning import tables

pytestmark = pytest.mark.timeout(300, method="thread")

PLUGIN = textwrap.dedent(
  """
  import dataclasses
  import time

  import jax
  from torus_collectives import registry

  def _with(all_reduce):
    def load():
      return dataclasses.replace(registry.collective_backend("shard_map"), all_reduce=all_reduce)
    return load

  def _wrong(x, axes, torus):
    return registry.collective_backend("shard_map").all_reduce(x, axes, torus) + 1

  def _sleep(v):
    time.sleep(3600)
    return v

  def _never(x, axes, torus):
    return jax.pure_callback(_sleep, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  for name, fn in (("wrong_sum", _wrong), ("never_returns", _never)):
    registry.register(
      dataclasses.replace(registry.BACKENDS["shard_map"], name=name, load_collectives=_with(fn))
    )
  """
)


def _check(tmp_path, *args, plugin_dir=None):
  """Runs the check into ``tmp_path / "out"``; returns (exit status, stdout, results, md)."""
  out = tmp_path / "out"
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env[tables.ENV_VAR] = str(tmp_path / "cache.json")
  if plugin_dir is not None:
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), env.get("PYTHONPATH", "")])
  command = [sys.executable, "-m", "torus_collectives.check", "--out", str(out), *args]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
  assert (out / "results.json").exists(), done.stdout + done.stderr
  results = json.loads((out / "results.json").read_text())
  return done.returncode, done.stdout, results, (out / "report.md").read_text()


def _numbers_in_tables(markdown: str) -> list[str]:
  cells = [line for line in markdown.splitlines() if line.startswith("| ")]
  return re.findall(r"(?<![\w.:\-])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w:])", "\n".join(cells))


def _json_numbers(value) -> list[float]:
  if isinstance(value, bool):
    return []
  if isinstance(value, (int, float)):
    return [float(value)]
  if isinstance(value, dict):
    return [n for v in value.values() for n in _json_numbers(v)]
  if isinstance(value, list):
    return [n for v in value for n in _json_numbers(v)]
  if isinstance(value, str):  # ids and sizes: "psum:pallas:float32:8:24", "2x4"
    return [float(t) for t in re.findall(r"\d+(?:\.\d+)?", value)]
  return []


def _held(token: str, numbers: list[float]) -> bool:
  """Whether a figure shown as ``token`` is one of ``numbers`` at the digits shown."""
  value = float(token)
  digits = len(token.split(".")[1]) if "." in token and "e" not in token else None
  return any(
    math.isclose(n, value, rel_tol=1e-9) or (digits is not None and round(n, digits) == value)
    for n in numbers
  )


@pytest.mark.slow
def test_a_quick_dry_run_reports_what_ran(tmp_path):
  status, stdout, results, md = _check(
    tmp_path,
    "--quick",
    "--interpret",
    "--impls=pallas,lax_torus",
    "--ops=psum,split_all_reduce_leaves",
    "--dtypes=float32",
    "--tori=8",
    "--max-bytes=16KiB",
    "--no-install",
    "--train-step=off",  # the next test times it
  )
  assert status == 0, stdout
  verdict = "PASS: all 4 correctness cases agree with jax.lax (dry run on simulated CPU devices)"
  assert stdout.strip().splitlines()[-1] == f"VERDICT: {verdict}"
  assert md.splitlines()[2] == f"**Verdict: {verdict}**"
  assert "Dry run on simulated CPU devices" in md
  # Exactly the cases that ran: the matrix of the options, in the JSON and in the report.
  # --quick runs interpreted kernels at the few elements only; the split calls run in
  # interpret mode through testing.split_interpret, and lax_torus has none.
  want = {
    "psum:pallas:float32:8:24",
    "psum:lax_torus:float32:8:24",
    "psum:lax_torus:float32:8:1024",
    "split_all_reduce_leaves:pallas:float32:8:24",
  }
  ran = {c["id"] for c in results["correctness"]["cases"]}
  assert ran == want
  listed = set(re.findall(r"^\| ((?:psum|split_all_reduce_leaves):[\w:]+) \|", md, re.M))
  assert listed == want
  skipped = {s["id"]: s["reason"] for s in results["correctness"]["skipped"]}
  assert skipped["split_all_reduce_leaves:lax_torus:*"] == "no split_all_reduce_leaves"
  # Stage 2 timed lax_torus against xla (interpreted kernels are not timed), in two runs.
  rows = results["measure"]["rows"]
  assert {(r["op"], r["impl"]) for r in rows} == {
    (op, impl) for op in cases.MEASURE_OPS for impl in ("xla", "lax_torus")
  }
  assert all(r["runs"] == 2 and r["wrong"] == 0 for r in rows)
  assert any(
    "interpreted kernels are not timed" in s["reason"] for s in results["measure"]["skipped"]
  )
  # Stage 3: a fit per implementation, and a table by the rule.
  assert set(results["calibrate"]["fits"]) == {"xla", "lax_torus"}
  table = tables.Table.from_json((tmp_path / "out" / "tuning.json").read_text())
  assert len(table.entries) == 3 and all(tables.unsupported(e) is None for e in table.entries)
  assert not (tmp_path / "cache.json").exists()  # --no-install
  # Every figure in the report's tables is in results.json, at the digits shown.
  numbers = _json_numbers(results)
  missing = [t for t in _numbers_in_tables(md) if not _held(t, numbers)]
  assert not missing, missing


@pytest.mark.slow
def test_the_train_step_rows_are_reported_as_measured_or_skipped_with_reasons(tmp_path):
  status, stdout, results, md = _check(
    tmp_path,
    "--quick",
    "--only=measure",
    "--train-step=only",
    "--step-variants=xla,pallas,threaded,weight_update_sharding,xla_settings",
    "--step-rounds=3",
  )
  assert status == 0, stdout
  stage = results["train_step"]
  assert stage["ran"] and not results["measure"]["ran"]
  # Off TPU: the baseline and weight-update sharding timed, at 2 per replica, the Pallas
  # variants and the libtpu flags skipped with their reasons.
  by_variant = {r["variant"]: r for r in stage["rows"]}
  assert {v: r["status"] for v, r in by_variant.items()} == {
    "xla": "measured",
    "pallas": "skipped",
    "threaded": "skipped",
    "weight_update_sharding": "measured",
    "xla_settings": "skipped",
  }
  assert all(r["batch"] == 2 for r in stage["rows"])
  assert all(r["reason"] for r in stage["rows"] if r["status"] != "measured")
  sharded = by_variant["weight_update_sharding"]
  assert sharded["images_per_s"] > 0 and sharded["ci_low"] <= sharded["ratio"] <= sharded["ci_high"]
  assert all(
    r["prediction_note"] == step.NO_PREDICTION for r in stage["rows"] if "images_per_s" in r
  )
  # The report lists exactly the rows of results.json, each with its status and reason.
  section = md[md.index("## ResNet train step") : md.index("## Plots")]
  listed = re.findall(r"^\| (\w+) \| (\d+) \| (\w+) \|.*\| ([^|]*) \|$", section, re.M)
  want = [(r["variant"], str(r["batch"]), r["status"]) for r in stage["rows"]]
  assert [row[:3] for row in listed] == want
  for (variant, _, state, note), r in zip(listed, stage["rows"]):
    assert state != "skipped" or note == r["reason"], variant
  numbers = _json_numbers(results)
  missing = [t for t in _numbers_in_tables(md) if not _held(t, numbers)]
  assert not missing, missing
  if "train_step.png" in results["plots"]:
    assert (tmp_path / "out" / "train_step.png").stat().st_size > 0


def test_a_train_step_variant_that_hangs_is_a_row_with_its_reason():
  items, skipped = step.plan("tpu", quick=False, variants=("xla", "int8", "xla_settings"))
  assert [i["id"] for i in items] == [
    f"{v}:{b}" for b in step.TPU_BATCHES for v in ("xla", "int8", "xla_settings")
  ]
  assert not skipped and [i["own_process"] for i in items[:3]] == [False, False, True]
  measured = {"status": "measured", "times": [0.5, 0.5], "global_batch": 64}
  results = {
    "xla:8": measured | {"grad_implementation": "xla"},
    "int8:8": {"status": "hang", "detail": "no result within 300 s: the worker was killed"},
    "xla_settings:8": measured | {"times": [0.25], "grad_implementation": "xla"},
  }
  rows = step.rows(items[:3], results, [])
  assert [(r["variant"], r["status"]) for r in rows] == [
    ("xla", "measured"),
    ("int8", "hang"),
    ("xla_settings", "measured"),
  ]
  assert rows[0]["images_per_s"] == 128 and "ratio" not in rows[0]
  assert rows[1]["reason"].startswith("no result within")
  assert rows[2]["ratio"] == 0.5 and "ci_low" not in rows[2]  # its own process: no interval


@pytest.fixture(scope="module")
def broken_backends(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("broken")
  (tmp_path / "broken_backends.py").write_text(PLUGIN)
  timeout = 20
  args = (
    "--plugin=broken_backends",
    "--only=correctness",
    "--impls=wrong_sum,never_returns,lax_torus",
    "--ops=psum",
    "--dtypes=float32",
    "--tori=8",
    "--max-bytes=1KiB",
    f"--timeout-per-case={timeout}",
  )
  return timeout, *_check(tmp_path, *args, plugin_dir=tmp_path)


@pytest.mark.slow
def test_a_wrong_sum_fails_the_run_and_is_listed_first(broken_backends):
  _, status, stdout, results, md = broken_backends
  assert status == 1, stdout
  by_id = {c["id"]: c for c in results["correctness"]["cases"]}
  wrong = by_id["psum:wrong_sum:float32:8:24"]
  assert wrong["status"] == "fail" and wrong["wrong"] > 0
  assert by_id["psum:lax_torus:float32:8:24"]["status"] == "pass"
  statuses = [c["status"] for c in results["correctness"]["cases"]]
  assert statuses[-1] == "pass" and set(statuses[:-1]) == {"fail", "hang"}  # failures first
  assert md.index("## Failures") < md.index("## Correctness")
  reproducer = (
    "python -m torus_collectives.check --only correctness --case psum:wrong_sum:float32:8:24"
    " --plugin broken_backends"
  )
  assert reproducer in md and wrong["reproducer"] == reproducer
  assert "VERDICT: FAIL: 2 of 3 correctness cases failed (1 fail, 1 hang)" in stdout


@pytest.mark.slow
def test_a_case_that_never_returns_is_a_hang_and_the_run_goes_on(broken_backends):
  timeout, status, stdout, results, _ = broken_backends
  hang = {c["id"]: c for c in results["correctness"]["cases"]}["psum:never_returns:float32:8:24"]
  assert hang["status"] == "hang" and f"{timeout:g} s" in hang["detail"]
  # The cases after it ran in a fresh worker.
  assert [c["status"] for c in results["correctness"]["cases"]].count("pass") == 1
  assert results["correctness"]["counts"] == {
    "pass": 1,
    "fail": 1,
    "error": 0,
    "hang": 1,
    "crash": 0,
  }


def test_the_fit_recovers_latency_and_bandwidth_from_noisy_model_timings():
  alpha, bandwidth = 2e-6, 45e9
  rng = np.random.default_rng(0)
  points = []
  for torus in ((16,), (4, 4), (8,), (2, 4)):
    for op in cases.MEASURE_OPS:
      for nbytes in (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB):
        t = calibrate.predicted(op, torus, nbytes, alpha, bandwidth)
        points.append((op, torus, nbytes, t * rng.lognormal(0, 0.03)))
  found = calibrate.fit(points)
  assert found.points == len(points)
  assert found.alpha == pytest.approx(alpha, rel=0.1)
  assert found.bandwidth == pytest.approx(bandwidth, rel=0.05)
  assert found.rms_relative < 0.05
  # The features are cost_model.predict's own: the model and the fit agree exactly.
  exact = [(op, t, n, calibrate.predicted(op, t, n, alpha, bandwidth)) for op, t, n, _ in points]
  fitted = calibrate.fit(exact)
  assert fitted.alpha == pytest.approx(alpha, rel=1e-6)
  assert fitted.bandwidth == pytest.approx(bandwidth, rel=1e-6)


def _runs(ratio: float, processes=("one", "two"), rounds=25, seed=0) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [
    {"ratios": {"shard_map": list(rng.uniform(ratio - 0.02, ratio + 0.02, rounds))}, "process": p}
    for p in processes
  ]


def test_the_table_follows_the_rule_and_auto_reads_it(isolated_tables):
  big, small = 16 * MiB, 4 * MiB
  impls = ("xla", "shard_map")
  faster = cases.Measure("all_reduce", "float32", (2, 4), big, impls)
  even = cases.Measure("all_reduce", "float32", (2, 4), small, impls)
  once = cases.Measure("all_gather", "float32", (2, 4), big, impls)
  measured = [(faster, _runs(0.8)), (even, _runs(1.0)), (once, _runs(0.5, processes=("one",)))]
  table = calibrate.table("cpu", "a test", measured)
  choices = {(e.op, e.bucket): e.choice for e in table.entries}
  assert choices == {
    ("all_reduce", tables.size_bucket(big)): "shard_map",
    ("all_reduce", tables.size_bucket(small)): "xla",
    ("all_gather", tables.size_bucket(big)): "xla",  # one process: the rule needs two
  }
  for entry in table.entries:  # every choice is re-derived from the runs it records
    assert tables.unsupported(entry) is None
    assert tables.decide(tables.rederived(entry.runs)) == entry.choice
  calibrate.write_table(table, tables.cache_path())
  assert (
    registry.auto_implementation("all_reduce", jnp.float32, nbytes=big, torus=(2, 4)) == "shard_map"
  )
  assert (
    registry.auto_implementation("all_reduce", jnp.float32, nbytes=small, torus=(2, 4)) == "xla"
  )
  assert registry.auto_implementation("all_gather", jnp.float32, nbytes=big, torus=(2, 4)) == "xla"


def test_a_case_id_is_its_own_reproducer():
  case = cases.Case("psum_int8", "shard_map", "bfloat16", (2, 2, 2), 96)
  assert cases.Case.from_id(case.id) == case
  assert case.command().endswith(f"--case {case.id}")
  with pytest.raises(ValueError, match="not a case id"):
    cases.Case.from_id("psum:shard_map:float32")
  assert report.FAILED == ("fail", "error", "hang", "crash")
