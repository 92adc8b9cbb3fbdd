"""Stage 3: the cost model fitted to what was measured, and the tuning table it decides.

**The fit.** ``cost_model.predict`` prices a collective as ``alpha * H + W / B``: ``H``
the hops of its steps (summed over steps, the longest routed path of each) and ``W`` the
bytes on the busiest directed link of each step, summed over steps, for the schedule the
torus implementations run (``schedule.default_variant`` of the torus). Both are linear
in the two constants, so ``H`` and ``W`` of every measured (op, torus, size) are read off
``predict`` itself with ``alpha = 1`` and ``B = 1`` (``features``): the fit and the model
cannot disagree on the schedule. ``alpha`` and ``1 / B`` are then fitted by non-negative
least squares on *relative* residuals (each equation divided by its measured time, so
that small and large buffers weigh alike) over every size, op and torus measured for an
implementation (``fit``). A torus of one axis and one of two or three differ in hops per
byte, which is what separates ``alpha`` from ``B``; with a single torus they are told
apart by size alone.

Assumptions: one link bandwidth and one per-hop latency for every link; anything a call
costs once (dispatch, a kernel launch) is not in the model, so it lands in ``alpha``
(spread over the hops). The fitted constants are what the model needs to reproduce these
timings, not the hardware's datasheet: they are printed beside the shipped constants
(``cost_model.GENERATIONS``) for that comparison.

**The table.** Each measured case becomes one ``tables.Entry`` by the package's rule
(``tables.Entry.from_runs``: a torus implementation replaces XLA only if the upper end
of its bootstrap interval is at most the threshold in each of two runs from different
processes). The check's two measurement runs are two worker processes, so the rule can
be met; with fewer runs no table is written. ``write_table`` merges it into the table
already at the path (as the tuner does) and saves it where "auto" reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import platform
from collections.abc import Sequence

import numpy as np

from torus_collectives import cost_model
from torus_collectives import schedule as schedule_lib
from torus_collectives.check.cases import Measure
from torus_collectives.tuning import tables

_UNIT = cost_model.Generation("unit", links_per_chip=6, link_bandwidth=1.0, hop_latency=1.0)


def features(op: str, torus: Sequence[int], nbytes: float) -> tuple[float, float]:
  """``(H, W)`` of ``op`` on ``torus``: its time is ``alpha * H + W / B``."""
  physical = tuple(int(n) for n in torus if n > 1) or (1,)
  pred = cost_model.predict(op, physical, schedule_lib.default_variant(physical), nbytes, _UNIT)
  return pred.latency_s, pred.bandwidth_s


def predicted(op: str, torus: Sequence[int], nbytes: float, alpha: float, bandwidth: float):
  """Seconds the model gives with these constants."""
  h, w = features(op, torus, nbytes)
  return alpha * h + w / bandwidth


@dataclasses.dataclass(frozen=True)
class Fit:
  """Fitted per-hop latency (s) and per-link one-way bandwidth (bytes/s), with the RMS
  of the relative residuals and the number of timings behind them."""

  alpha: float
  bandwidth: float
  rms_relative: float
  points: int


def _nnls2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Non-negative least squares in two unknowns: the unconstrained solution if it is
  non-negative, else the better of the two one-unknown solutions."""
  x, *_ = np.linalg.lstsq(a, b, rcond=None)
  if np.all(x >= 0):
    return x
  best, best_err = np.zeros(2), np.sum(b**2)
  for j in range(2):
    col = a[:, j]
    denom = float(col @ col)
    if denom <= 0:
      continue
    xj = max(0.0, float(col @ b) / denom)
    candidate = np.zeros(2)
    candidate[j] = xj
    err = float(np.sum((a @ candidate - b) ** 2))
    if err < best_err:
      best, best_err = candidate, err
  return best


def fit(points: Sequence[tuple[str, Sequence[int], float, float]]) -> Fit | None:
  """Fits ``alpha`` and ``B`` to ``(op, torus, nbytes, seconds)`` timings; None with
  fewer than two."""
  if len(points) < 2:
    return None
  a = np.array([features(op, torus, n) for op, torus, n, _ in points], np.float64)
  t = np.array([s for *_, s in points], np.float64)
  a_rel = a / t[:, None]
  alpha, inverse_b = _nnls2(a_rel, np.ones_like(t))
  bandwidth = math.inf if inverse_b <= 0 else 1.0 / inverse_b
  residual = a_rel @ np.array([alpha, inverse_b]) - 1.0
  return Fit(float(alpha), float(bandwidth), float(np.sqrt(np.mean(residual**2))), len(points))


def points_of(rows: Sequence[dict]) -> dict[str, list]:
  """Per implementation, the ``(op, torus, nbytes, seconds)`` of its measured rows."""
  out: dict[str, list] = {}
  for row in rows:
    torus = tuple(int(n) for n in row["torus"].split("x"))
    out.setdefault(row["impl"], []).append((row["op"], torus, row["size"], row["time_us"] * 1e-6))
  return out


def shipped_constants() -> list[dict]:
  """The model's constants per TPU generation, as shipped."""
  return [
    {
      "generation": g.name,
      "links_per_chip": g.links_per_chip,
      "link_GBps": g.link_bandwidth / 1e9,
      "alpha_us": g.hop_latency * 1e6,
    }
    for g in cost_model.GENERATIONS.values()
  ]


def entries(measured: Sequence[tuple[Measure, Sequence[dict]]]) -> list[tables.Entry]:
  """One entry per measured case, by the rule, from its runs (each run's ``process``)."""
  out = []
  for case, runs in measured:
    kept = [tables.Run.of(run["ratios"], process=run["process"]) for run in runs]
    out.append(
      tables.Entry.from_runs(
        tables.topology(case.torus), case.op, case.dtype, tables.size_bucket(case.nbytes), kept
      )
    )
  return out


def table(device_kind: str, machine: str, measured) -> tables.Table:
  return tables.Table(device_kind, machine, tables.now(), entries(measured))


def write_table(table_: tables.Table, path: str | os.PathLike) -> pathlib.Path:
  """Saves ``table_`` merged into the table already at ``path`` (the tuner's merge: an
  entry of both keeps the newest runs and is decided again)."""
  path = pathlib.Path(path)
  try:
    older = tables.Table.from_json(path.read_text())
  except (OSError, ValueError):
    older = None
  return table_.merged_into(older).save(path)


def host() -> str:
  return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)"
