"""Launching the two JAX processes of a multi-process test on 127.0.0.1.

Each worker script joins the cluster through ``multiprocess_setup.join(port, process_id)``;
the launcher picks the coordinator's free port, runs processes 0 and 1 under a timeout (a
dead peer fails the test instead of hanging it) and asserts that both exited 0.
"""

import os
import pathlib
import socket
import subprocess
import sys

TIMEOUT_S = 300


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two(worker: pathlib.Path, *args: str) -> list[str]:
  """Runs ``worker PORT ID *args`` as processes 0 and 1; returns their outputs."""
  port = free_port()
  # The workers set their own device count; the parent's 8 must not leak into them.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    subprocess.Popen(
      [sys.executable, str(worker), str(port), str(i), *args],
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
      outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for proc in procs:
      proc.kill()
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
  return outputs
