"""Two JAX processes (4 simulated devices each) form one 2x4 torus over 127.0.0.1."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TUNE_WORKER = Path(__file__).with_name("multiprocess_tune_worker.py")
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two(worker: Path) -> list[str]:
  """Runs ``worker PORT ID`` as processes 0 and 1; returns their outputs (both must pass)."""
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    subprocess.Popen(
      [sys.executable, str(worker), str(port), str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for proc in procs:
      out, _ = proc.communicate(timeout=TIMEOUT_S)  # a dead peer must fail, not hang
      outputs.append(out)
  finally:
    for proc in procs:
      proc.kill()
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
  return outputs


@pytest.mark.multiprocess
def test_two_processes_match_lax():
  for i, out in enumerate(_run_two(WORKER)):
    assert f"process {i}: 8 devices, all collectives equal lax" in out


@pytest.mark.multiprocess
def test_two_processes_tune_to_one_decision_and_one_program():
  """Local timings disagree (see the worker); process 0's decide, on both."""
  results = []
  for out in _run_two(TUNE_WORKER):
    line = next(s for s in out.splitlines() if s.startswith("RESULT "))
    results.append(json.loads(line.removeprefix("RESULT ")))
  assert [r["process"] for r in results] == [0, 1]
  for r in results:
    assert r["choices"] == {"all_reduce": "lax_torus", "reduce_scatter": "lax_torus"}
    assert r["per_axis_reduce_scatter"]
  assert results[0]["program"] == results[1]["program"]
