"""``bench.overlap_report`` on a small data-parallel step compiled ahead of time for
v5e:2x2, whose answer is checked by hand from the dumped program.

``overlap_worker.py`` compiles a six-layer MLP's train step (one 16 MiB gradient leaf per
bucket, summed by ``tc.all_reduce_gradients`` on XLA) in a process of its own, with the
package's XLA settings or with libtpu's defaults, and prints its timeline. Then:

* default flags: XLA merges the gradient's six all-reduces into one synchronous
  collective after the backward pass, so the report reads 100 % exposed;
* the package's settings: every gradient collective but the last (the first layer's,
  produced when nothing is left to compute) is an async pair with backward compute
  scheduled between its start and its done, and the compute there outlasts the modelled
  transfer, so those pairs read 0 % exposed;
* the report's rows equal a hand computation from the dumped HLO text: the estimated
  cycles printed between each start and its done, at the calibrated clock, against the
  cost model's time for the bytes of the collective's operand;
* the calibrated clock leaves no compute faster than the peak FLOP rate.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import aot_skip
import pytest

pytest.importorskip("libtpu", reason=aot_skip.REASON)

from torus_collectives import cost_model

pytestmark = pytest.mark.aot

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).with_name("overlap_worker.py")


@pytest.fixture(scope="module", params=["default", "package"])
def compiled(request, tmp_path_factory):
  """(settings, the worker's JSON, the dumped program's text)."""
  hlo = tmp_path_factory.mktemp("overlap") / f"{request.param}.hlo"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
  env.pop("LIBTPU_INIT_ARGS", None)
  result = subprocess.run(
    [sys.executable, str(WORKER), request.param, str(hlo)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return request.param, json.loads(result.stdout.strip().splitlines()[-1]), hlo.read_text()


def _entry_lines(text: str) -> list[str]:
  lines = text.split("\nENTRY ", 1)[1].splitlines()[1:]
  return lines[: next(i for i, line in enumerate(lines) if line.startswith("}"))]


def test_default_flags_block_after_the_backward_pass(compiled):
  settings, result, text = compiled
  if settings != "default":
    pytest.skip("the default-flags program")
  assert result["rows"] and all(row["kind"] == "sync" for row in result["rows"])
  assert not re.search(r"all-reduce-start|async-collective-start", text)
  assert result["summary"].startswith("exposed gradient communication: ")
  assert "(100.0 %)" in result["summary"]


def test_package_settings_overlap_each_bucket_with_backward_compute(compiled):
  settings, result, text = compiled
  if settings != "package":
    pytest.skip("the program compiled with the package's settings")
  rows = result["rows"]
  assert len(rows) == 6  # one collective per bucket: six leaves, bucket_bytes=1
  *overlapped, last = rows
  assert all(row["kind"] == "async" for row in overlapped)
  assert all(row["covered_s"] > row["modelled_s"] and row["exposed_s"] == 0 for row in overlapped)
  assert last["exposed_s"] == pytest.approx(last["modelled_s"])


def test_rows_match_a_hand_computation_from_the_program(compiled):
  """Each async row: the estimated cycles of the ENTRY lines between its start and its
  done, at the calibrated clock; exposed is what of the modelled transfer they leave."""
  settings, result, text = compiled
  lines = _entry_lines(text)
  clock = result["clock_hz"]
  v5e = cost_model.GENERATIONS["v5e"]
  assert sum(row["nbytes"] for row in result["rows"]) == 6 * 2048 * 2048 * 4  # the gradient
  for row in result["rows"]:
    modelled = cost_model.predict("all_reduce", (2, 2), "torus_split", row["nbytes"], v5e).time_s
    assert row["modelled_s"] == pytest.approx(modelled)
    if row["kind"] != "async":
      assert row["exposed_s"] == pytest.approx(modelled)
      continue
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  %{row['name']} = "))
    done_name = row["name"].replace("-start", "-done")
    done = next(i for i, line in enumerate(lines) if line.startswith(f"  %{done_name} = "))
    between = lines[start + 1 : done]
    assert not any(line.startswith("  %async-collective-start") for line in between)  # no nesting
    cycles = sum(
      int(c) for line in between for c in re.findall(r'"estimated_cycles":"(\d+)"', line)
    )
    assert cycles > 0
    assert row["covered_s"] == pytest.approx(cycles / clock)
    assert row["exposed_s"] == pytest.approx(max(0.0, modelled - cycles / clock))


def test_the_calibrated_clock_leaves_no_compute_faster_than_peak(compiled):
  _, result, _ = compiled
  at_peak = result["flops"] / result["peak_flops"]
  assert result["compute_s"] >= 0.95 * at_peak
