"""Stage 2: each implementation timed against XLA, reported as nccl-tests reports.

In a worker (``time_case``): the tuner's own programs (``tuning.tuner.collective_case``:
the op over every mesh axis, a deterministic buffer of small integers) for every
implementation of the case, compiled and warmed, then timed in interleaved rounds of a
fresh random order each (``tuning.timing.Interleaved``), so that a slow moment of the
machine slows every candidate of a round alike. After timing, each candidate's output is
compared with XLA's: ``#wrong`` counts elements further from XLA's than the rounding
bound allows (``registry.auto_rounding_bound``; the inputs are non-negative, so the sum
of magnitudes is XLA's result itself).

In the parent (``rows``): the rounds of the stage's runs (each in its own process) pooled
per (case, implementation), one row each:

* ``time``: the median seconds of a call (reported in microseconds);
* ``algbw = S / time`` and ``busbw``, as nccl-tests defines them, with ``S`` the full
  buffer (an all-gather's output): ``busbw = algbw * 2 (p - 1) / p`` for all-reduce,
  ``algbw * (p - 1) / p`` for reduce-scatter and all-gather (``BUS_FACTOR``);
* ``ratio``: the median of the per-round time ratios to XLA, with its two-sided bootstrap
  interval (``tuning.tables``' resamples, seed and confidence: its upper end is what the
  tuning rule compares with its threshold, run by run);
* ``#wrong`` as above.

The closing figure is each implementation's average busbw over its rows, as nccl-tests
closes with "Avg bus bandwidth".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from torus_collectives.check.cases import ITEMSIZE, Measure
from torus_collectives.tuning import tables


def bus_factor(op: str, p: int) -> float:
  """busbw / algbw for ``op`` over ``p`` devices (nccl-tests' convention)."""
  return (2 if op == "all_reduce" else 1) * (p - 1) / p


def time_case(case: Measure, rounds: int) -> dict:
  """Times ``case`` in this process: per implementation, every round's seconds, the
  per-round ratios to XLA, and ``#wrong``."""
  import jax

  from torus_collectives import registry
  from torus_collectives.check import verify
  from torus_collectives.tuning import timing, tuner

  mesh = verify.mesh(case.torus)
  built = tuner.collective_case(mesh, case.op, case.dtype, case.nbytes)
  calls = {name: built.build(name) for name in case.impls}
  runs = timing.Interleaved(calls).run(rounds)
  reference = np.asarray(jax.block_until_ready(calls[tables.BASELINE]()), np.float64)
  c = registry.auto_rounding_bound(case.op, case.dtype, math.prod(case.torus))
  wrong = {}
  for name, call in calls.items():
    got = np.asarray(jax.block_until_ready(call()), np.float64)
    wrong[name] = int(np.sum(np.abs(got - reference) > c * np.abs(reference)))
  return {
    "times": {name: runs.times[name] for name in case.impls},
    "ratios": {n: runs.round_ratios(n, tables.BASELINE) for n in case.impls[1:]},
    "wrong": wrong,
    "process": tables.PROCESS,
  }


def interval(ratios: Sequence[float]) -> tuple[float, float]:
  """The two-sided bootstrap interval of the median of ``ratios``, with the rule's
  resamples, seed and confidence (its upper end is ``tables.ci_high``)."""
  r = np.asarray(ratios, np.float64)
  if r.size == 0 or not np.all(np.isfinite(r)):
    return math.nan, math.inf
  rng = np.random.default_rng(tables.BOOTSTRAP_SEED)
  medians = np.median(r[rng.integers(0, r.size, (tables.BOOTSTRAP_RESAMPLES, r.size))], axis=1)
  tail = (1 - tables.CONFIDENCE) / 2
  return float(np.quantile(medians, tail)), float(np.quantile(medians, 1 - tail))


def sig(x: float, digits: int = 4) -> float:
  """``x`` to ``digits`` significant digits: every figure the report shows is stored
  so, and the markdown prints it with ``:g``."""
  if not math.isfinite(x) or x == 0:
    return x
  return float(f"{x:.{digits}g}")


def rows(case: Measure, runs: Sequence[dict]) -> list[dict]:
  """One nccl-style row per implementation of ``case``, from the runs' pooled rounds."""
  p = math.prod(case.torus)
  out = []
  for name in case.impls:
    times = [t for run in runs for t in run["times"].get(name, [])]
    if not times:
      continue
    t = statistics.median(times)
    algbw = case.nbytes / t / 1e9
    row = {
      "case": case.id,
      "op": case.op,
      "torus": "x".join(map(str, case.torus)),
      "size": case.nbytes,
      "count": case.nbytes // ITEMSIZE[case.dtype],
      "type": case.dtype,
      "impl": name,
      "time_us": sig(t * 1e6),
      "algbw_GBps": sig(algbw),
      "busbw_GBps": sig(algbw * bus_factor(case.op, p)),
      "wrong": max(run["wrong"].get(name, 0) for run in runs),
      "runs": len(runs),
    }
    if name != tables.BASELINE:
      ratios = [r for run in runs for r in run["ratios"].get(name, [])]
      low, high = interval(ratios)
      row |= {"ratio": sig(float(np.median(ratios))), "ci_low": sig(low), "ci_high": sig(high)}
    out.append(row)
  return out


def average_busbw(all_rows: Sequence[dict]) -> dict[str, float]:
  """Each implementation's mean busbw over its rows (nccl-tests' closing line)."""
  by: dict[str, list[float]] = {}
  for row in all_rows:
    by.setdefault(row["impl"], []).append(row["busbw_GBps"])
  return {name: sig(statistics.fmean(v)) for name, v in by.items()}
