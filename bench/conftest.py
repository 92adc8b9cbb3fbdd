"""Shared set-up of the microbenchmarks: 8 simulated CPU devices and steady-state timing.

XLA reads the device count once, when jax is first imported, so it is set here at module
top, before any benchmark module imports jax.

The default run is short (a few sizes); ``TC_BENCH_FULL=1`` selects the full sweep and
longer timing.
"""

import os
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from settings import FULL  # noqa: E402

NUM_DEVICES = 8
# Per benchmark: the timed rounds aim at this much wall time, within the round limits.
TARGET_SECONDS = 2.0 if FULL else 0.5
MIN_ROUNDS, MAX_ROUNDS = 7, 200
WARMUP_CALLS = 3


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == NUM_DEVICES, (
    "benchmarks need 8 simulated CPU devices; import jax only after bench/conftest.py"
  )


@pytest.fixture
def steady(benchmark) -> Callable:
  """Times ``fn(*args)`` in steady state: compiled and warmed up before the first round.

  Each round is one call followed by ``jax.block_until_ready``, so neither dispatch alone
  nor compilation is timed. Returns the last result.
  """

  def run(fn: Callable, *args):
    call = lambda: jax.block_until_ready(fn(*args))
    for _ in range(WARMUP_CALLS):  # the first compiles; the others fault in buffers
      call()
    start = time.perf_counter()
    for _ in range(WARMUP_CALLS):
      call()
    once = (time.perf_counter() - start) / WARMUP_CALLS
    rounds = int(min(MAX_ROUNDS, max(MIN_ROUNDS, TARGET_SECONDS / max(once, 1e-9))))
    return benchmark.pedantic(call, rounds=rounds, iterations=1)

  return run


def pytest_benchmark_update_json(config, benchmarks, output_json):
  """Adds each benchmark's median time over its group's baseline's, from the same run.

  A benchmark names itself in ``extra_info["variant"]`` and its group's baseline in
  ``extra_info["baseline"]`` (``"xla"`` for the collectives); the ratio lands in
  ``extra_info["time_ratio_to_<baseline>"]``, above 1 when slower than the baseline.
  """
  del config, benchmarks
  entries = [b for b in output_json["benchmarks"] if "baseline" in b["extra_info"]]
  medians = {(b["group"], b["extra_info"]["variant"]): b["stats"]["median"] for b in entries}
  for b in entries:
    baseline = b["extra_info"]["baseline"]
    if (b["group"], baseline) in medians:
      b["extra_info"][f"time_ratio_to_{baseline}"] = (
        b["stats"]["median"] / medians[b["group"], baseline]
      )
