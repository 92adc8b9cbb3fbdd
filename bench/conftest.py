"""Shared set-up of the microbenchmarks: 8 simulated CPU devices and steady-state timing.

Benchmarks that compare variants (implementations of a collective, flax against ours) time
them with the package's own routine, ``torus_collectives.tuning.timing.Interleaved``, the one the
tuner decides with: all variants of a group in one test, compiled and warmed first, then
round after round one call of each, and the ratio to the baseline as the median of the
per-round ratios. pytest-benchmark's own statistics for such a test are those of a whole
round; the per-variant figures are in ``extra_info["variants"]``.

XLA reads the device count once, when jax is first imported, so it is set here at module
top, before any benchmark module imports jax.

The default run is short (a few sizes); ``TC_BENCH_FULL=1`` selects the full sweep and
longer timing.
"""

import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import pytest
from settings import FULL

from torus_collectives.tuning import timing

NUM_DEVICES = 8
# Per benchmark: the timed rounds aim at this much wall time, within the round limits.
TARGET_SECONDS = 2.0 if FULL else 0.5
MIN_ROUNDS, MAX_ROUNDS = 7, 200
WARMUP_CALLS = 3


def _rounds(seconds_per_round: float, target: float) -> int:
  return int(min(MAX_ROUNDS, max(MIN_ROUNDS, target / max(seconds_per_round, 1e-9))))


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
    return benchmark.pedantic(call, rounds=_rounds(once, TARGET_SECONDS), iterations=1)

  return run


@pytest.fixture
def interleaved(benchmark) -> Callable:
  """Times named zero-argument calls against ``baseline`` with ``tuning.timing.Interleaved``.

  Records, per variant, ``median_s`` and ``time_ratio_to_<baseline>`` (median of per-round
  ratios, above 1 when slower) in ``extra_info["variants"]``; returns the runs.
  """

  def run(candidates: dict[str, Callable[[], Any]], baseline: str) -> timing.Interleaved:
    runs = timing.Interleaved(candidates)
    runs.warm(WARMUP_CALLS)
    start = time.perf_counter()
    runs.round()
    rounds = _rounds(time.perf_counter() - start, TARGET_SECONDS * len(candidates))
    benchmark.pedantic(runs.round, rounds=rounds, iterations=1)
    benchmark.extra_info["baseline"] = baseline
    benchmark.extra_info["variants"] = {
      name: {
        "median_s": runs.median(name),
        f"time_ratio_to_{baseline}": 1.0 if name == baseline else runs.ratio(name, baseline),
      }
      for name in candidates
    }
    return runs

  return run


def pytest_benchmark_update_json(config, benchmarks, output_json):
  """Adds a single benchmark's median time over its group's baseline's, from the same run.

  A benchmark names itself in ``extra_info["variant"]`` and its group's baseline in
  ``extra_info["baseline"]``; the baseline may be a variant of an interleaved benchmark of
  the same group. The ratio lands in ``extra_info["time_ratio_to_<baseline>"]``.
  """
  del config, benchmarks
  medians = {}
  for b in output_json["benchmarks"]:
    info = b["extra_info"]
    for name, variant in info.get("variants", {}).items():
      medians[b["group"], name] = variant["median_s"]
    if "variant" in info:
      medians[b["group"], info["variant"]] = b["stats"]["median"]
  for b in output_json["benchmarks"]:
    info = b["extra_info"]
    if "variant" in info and (b["group"], info.get("baseline")) in medians:
      ratio = b["stats"]["median"] / medians[b["group"], info["baseline"]]
      info[f"time_ratio_to_{info['baseline']}"] = ratio
