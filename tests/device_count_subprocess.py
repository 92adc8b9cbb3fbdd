"""Runs a test module again as a script, with another number of simulated CPU devices.

XLA reads the device count once per process, when jax is first imported, so a test that
needs 16 devices (4x4, 2x2x4) runs its module's ``__main__`` block in a subprocess; the
block prints a marker once all its checks have passed.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_as_script(path: str, devices: int, marker: str, timeout: int = 600, args=()) -> None:
  """Runs ``path`` (with command-line ``args``) from the repository root with ``devices``
  CPU devices; asserts that it exits 0 and printed ``marker``."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
  )
  result = subprocess.run(
    [sys.executable, os.path.abspath(path), *args],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert result.returncode == 0 and marker in result.stdout, result.stderr[-3000:]
