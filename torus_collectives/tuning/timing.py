"""The one routine that times implementations against each other: the tuner's and bench/'s.

On a shared or noisy machine, timing one implementation and then another compares two
different moments of the machine: two rows of a benchmark that run the same program can
read far apart (the benchmarks page records by how much). Here every candidate is timed in
the same run, interleaved:

1. each candidate is called (compiled, then warmed) before any round is timed;
2. a round calls every candidate once, each call followed by ``jax.block_until_ready``,
   in a fresh random order each round (seeded, so every process of a multi-process run
   calls the collectives in the same order): a call is slowed by the one before it (a
   heavy predecessor leaves caches and thread pools cold), and with a fixed or rotated
   order the same candidate would always follow the same heavy one ("auto" and "xla",
   one and the same program, read further apart with a rotated order than with random
   orders in ``bench/test_collectives_bench.py``);
3. a candidate's speed relative to the baseline is the *median over rounds of the
   per-round ratio* ``t_candidate / t_baseline``: a round slowed by the machine slows both
   (the ratio survives), and a few outlier rounds do not move the median.

The decision rule on top of it (``tuning.tables.decide``) then asks a candidate to beat the
baseline with confidence (a bootstrap interval of that median), in more than one process.

Timers are injectable (``timer(name, call) -> seconds``), so the decision logic can be
tested with fake timings and several processes can be fed disagreeing ones.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

Timer = Callable[[str, Callable[[], Any]], float]
WARMUP_CALLS = 2


def wall_time(name: str, call: Callable[[], Any]) -> float:
  """Seconds of one ``call()`` until its results are ready (the default timer)."""
  del name
  start = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - start


class Interleaved:
  """Round-robin timing of named zero-argument callables.

  Args:
    candidates: name -> callable; each call must return the (jax) result to wait for.
    timer: ``timer(name, call) -> seconds``; ``wall_time`` by default.
  """

  def __init__(self, candidates: Mapping[str, Callable[[], Any]], timer: Timer | None = None):
    if not candidates:
      raise ValueError("nothing to time: candidates is empty")
    self.candidates = dict(candidates)
    self.timer = timer or wall_time
    self.times: dict[str, list[float]] = {name: [] for name in self.candidates}
    self._order = random.Random(0)  # the same sequence of orders on every process

  def warm(self, calls: int = WARMUP_CALLS) -> None:
    """Compiles and warms every candidate (``calls`` untimed calls each)."""
    for _ in range(calls):
      for call in self.candidates.values():
        jax.block_until_ready(call())

  def round(self) -> None:
    """Times every candidate once, in a random order."""
    names = list(self.candidates)
    self._order.shuffle(names)
    for name in names:
      self.times[name].append(self.timer(name, self.candidates[name]))

  def run(self, rounds: int) -> Interleaved:
    """Warms up, then times ``rounds`` rounds; returns self."""
    if rounds < 1:
      raise ValueError(f"{rounds=} must be positive")
    self.warm()
    for _ in range(rounds):
      self.round()
    return self

  def median(self, name: str) -> float:
    """Median seconds of one call of ``name``."""
    return statistics.median(self.times[name])

  def round_ratios(self, name: str, baseline: str) -> list[float]:
    """``t_name / t_baseline`` of every round, in order."""
    return [t / max(b, 1e-12) for t, b in zip(self.times[name], self.times[baseline])]

  def ratio(self, name: str, baseline: str) -> float:
    """Median over rounds of ``t_name / t_baseline``: above 1 when ``name`` is slower."""
    return statistics.median(self.round_ratios(name, baseline))

  def ratios(self, baseline: str) -> dict[str, float]:
    """``ratio(name, baseline)`` for every candidate other than ``baseline``."""
    return {name: self.ratio(name, baseline) for name in self.candidates if name != baseline}
