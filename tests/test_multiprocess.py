"""Two JAX processes (4 simulated devices each) form one 2x4 torus over 127.0.0.1."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_match_lax():
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(port), str(i)],
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
    assert f"process {i}: 8 devices, all collectives equal lax" in out
