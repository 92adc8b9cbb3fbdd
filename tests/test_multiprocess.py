"""Two JAX processes (4 simulated devices each) form one 2x4 torus over 127.0.0.1."""

import json
from pathlib import Path

import pytest
from two_processes import run_two

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TUNE_WORKER = Path(__file__).with_name("multiprocess_tune_worker.py")


@pytest.mark.multiprocess
def test_two_processes_match_lax():
  for i, out in enumerate(run_two(WORKER)):
    assert f"process {i}: 8 devices, all collectives equal lax" in out


@pytest.mark.multiprocess
def test_two_processes_tune_to_one_decision_and_one_program():
  """Local timings and table files disagree (see the worker); process 0's decide, on
  both: its file's earlier run and its own run both pass lax_torus."""
  results = []
  for out in run_two(TUNE_WORKER):
    line = next(s for s in out.splitlines() if s.startswith("RESULT "))
    results.append(json.loads(line.removeprefix("RESULT ")))
  assert [r["process"] for r in results] == [0, 1]
  for r in results:
    assert r["choices"] == {"all_reduce": "lax_torus", "reduce_scatter": "lax_torus"}
    assert r["per_axis_reduce_scatter"]
  assert results[0]["program"] == results[1]["program"]
