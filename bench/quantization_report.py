"""The error of block-scaled all-reduce: int8 and float8_e4m3fn blocks of 32 to 512
elements (one bfloat16 scale each), against the float64 sum, as a markdown table.

  python -m bench.quantization_report [--out PATH]

Two scales:

* p = 8, measured: ``backends.shard_map.all_reduce`` with ``transport`` on every axis, run
  on 8 simulated CPU devices (a ring of 8 and a 2x4 torus, each device's float32 buffer of
  ``N8`` elements). Each result is also checked against ``quantization.simulate`` on the
  same inputs ("= model": bitwise equal on every device).
* p = 256, modelled: ``quantization.simulate`` (the numpy float32 model of the same
  schedule, per-hop requantization included) on a 16x16 torus, each device's buffer
  ``256`` chunks of ``4 * max(B, 256)`` elements (the split schedule's 4 streams, each
  slice at least one block), to keep the run short.

Data: every device draws its own buffer, standard normal or Student-t with 3 degrees of
freedom (heavy tails: a block's largest value sets its scale), from fixed seeds, rounded
once to float32; the exact sum is the float64 sum of those float32 values.

Columns: "RMS rel" is the RMS of the error over the RMS of the exact sum; "max rel" the
largest error over the largest exact magnitude; "max err/Σa" the largest, over elements,
of the error over ``A = sum_i a_i`` (``a_i`` device i's largest magnitude in that
element's block), to be compared with ``quantization.error_bound`` ("bound c":
``|error| <= c A``; "used" is their ratio). The error is over every device's result.
"""

from __future__ import annotations

import os

# Eight simulated CPU devices: XLA reads the count when jax is first imported (which
# torus_collectives does). The values are checked, not the speed: the cheapest compile.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import dataclasses
import itertools
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from bench import markdown_report
from torus_collectives import quantization
from torus_collectives.backends import shard_map as backend

FORMATS = ("int8", "float8_e4m3fn")
BLOCK_SIZES = (32, 64, 128, 256, 512)
MEASURED_TORI = ((8,), (2, 4))
MODELLED_TORUS = (16, 16)
N8 = 65_536  # elements per device at p = 8: 8 chunks of 8,192, whole blocks of 512 per stream
DISTRIBUTIONS = ("normal", "student_t3")
AXIS_NAMES = ("x", "y", "z")
DEFAULT_OUT = pathlib.Path(__file__).parent / "results" / "quantization_errors.md"


@dataclasses.dataclass(frozen=True)
class Row:
  torus: tuple[int, ...]
  how: str  # "measured" or "modelled"
  fmt: quantization.BlockScaled
  data: str
  rms_rel: float
  max_rel: float
  max_err_over_a: float
  bound: float
  matches_model: bool | None  # measured rows: bitwise equal to ``simulate``


def draw(distribution: str, shape: Sequence[int], seed: int) -> np.ndarray:
  """float32 ``shape``, one device per leading index, each from its own seeded stream."""
  devices, rest = shape[0], tuple(shape[1:])
  out = np.empty(shape, np.float32)
  for d in range(devices):
    rng = np.random.default_rng([seed, d])
    values = rng.standard_normal(rest) if distribution == "normal" else rng.standard_t(3, rest)
    out[d] = values
  return out


def errors(result: np.ndarray, inputs: np.ndarray, block: int) -> tuple[float, float, float]:
  """(RMS rel, max rel, max err / A) of ``result`` (devices, n), every device's, against
  the float64 sum over devices of ``inputs`` (devices, n); blocks of ``block`` consecutive
  elements along n. One device at a time, to keep p = 256 in memory; where every device
  holds the same bits (the all-gather forwards the bytes), one of them stands for all."""
  if all(np.array_equal(y, result[0]) for y in result[1:]):
    result = result[:1]
  exact = inputs.sum(axis=0, dtype=np.float64)
  a = np.zeros(exact.shape[0] // block)
  for x in inputs:
    a += np.abs(x.reshape(-1, block)).max(axis=-1)
  a = np.repeat(a, block)
  squares = largest = over_a = 0.0
  for y in result:
    err = np.abs(y.astype(np.float64) - exact)
    squares += float(np.sum(err**2))
    largest = max(largest, float(err.max()))
    over_a = max(over_a, float(np.max(np.divide(err, a, out=np.zeros_like(err), where=a > 0))))
  rms_rel = np.sqrt(squares / result.size) / np.sqrt(np.mean(exact**2))
  return float(rms_rel), largest / float(np.abs(exact).max()), over_a


def measured_all_reduce(torus: tuple[int, ...], fmt: quantization.BlockScaled):
  """``f(inputs)``: the ``shard_map`` all-reduce over ``torus`` of ``inputs`` (p, n), one
  row per device (row-major over the mesh), every axis sending ``fmt``; returns (p, n)."""
  p = int(np.prod(torus))
  devices = jax.devices("cpu")
  if len(devices) < p:
    raise RuntimeError(
      f"needs {p} CPU devices, found {len(devices)}: run as `python -m "
      "bench.quantization_report` (it sets XLA_FLAGS before jax is imported)"
    )
  names = AXIS_NAMES[: len(torus)]
  mesh = Mesh(
    np.array(devices[:p], dtype=object).reshape(torus),
    names,
    axis_types=(AxisType.Auto,) * len(torus),
  )
  transport = tuple(fmt for _ in names)

  def body(x):
    return backend.all_reduce(x[0], names, torus, transport=transport)[None]

  spec = P(names)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _grid(torus, flat: np.ndarray) -> np.ndarray:
  """(p, n) per-device buffers as ``simulate``'s ``torus + torus + (n / p,)`` grid."""
  p = int(np.prod(torus))
  return flat.reshape(tuple(torus) + tuple(torus) + (flat.shape[1] // p,))


def _row(torus, how, fmt, data, result, inputs, matches_model=None) -> Row:
  transport = tuple(fmt for _ in torus)
  return Row(
    tuple(torus),
    how,
    fmt,
    data,
    *errors(result, inputs, fmt.block_size),
    bound=quantization.error_bound("all_reduce", torus, transport),
    matches_model=matches_model,
  )


def measured_rows(seed: int = 0) -> list[Row]:
  """p = 8 on the ``shard_map`` implementation (one compile per torus and format)."""
  inputs = {d: draw(d, (8, N8), seed) for d in DISTRIBUTIONS}
  rows = []
  for torus, name, block in itertools.product(MEASURED_TORI, FORMATS, BLOCK_SIZES):
    fmt = quantization.BlockScaled(name, block)
    run = measured_all_reduce(torus, fmt)
    transport = tuple(fmt for _ in torus)
    for data, x in inputs.items():
      result = np.asarray(run(x))
      model = quantization.simulate("all_reduce", torus, _grid(torus, x), transport)
      same = np.array_equal(model.reshape(result.shape), result)
      rows.append(_row(torus, "measured", fmt, data, result, x, same))
  return rows


def modelled_rows(seed: int = 1) -> list[Row]:
  """p = 256 with ``quantization.simulate`` on ``MODELLED_TORUS``: per device 256 chunks of
  ``width = 4 * max(B, 256)`` (4 streams, the split schedule on 16x16, each a whole number
  of blocks), the leading ``width`` elements of each chunk of one draw per distribution."""
  torus = MODELLED_TORUS
  p = int(np.prod(torus))
  widths = {block: 4 * max(block, 256) for block in BLOCK_SIZES}
  rows = []
  for data in DISTRIBUTIONS:
    drawn = _grid(torus, draw(data, (p, p * max(widths.values())), seed))
    for block in BLOCK_SIZES:
      grid = np.ascontiguousarray(drawn[..., : widths[block]])
      for name in FORMATS:
        fmt = quantization.BlockScaled(name, block)
        result = quantization.simulate("all_reduce", torus, grid, (fmt,) * len(torus))
        rows.append(_row(torus, "modelled", fmt, data, result.reshape(p, -1), grid.reshape(p, -1)))
  return rows


def format_table(rows: list[Row]) -> str:
  header = (
    "| p | torus | how | format | block | data | RMS rel | max rel | max err/Σa | bound c "
    "| used | = model |"
  )
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  order = {name: i for i, name in enumerate(FORMATS)}
  rows = sorted(
    rows,
    key=lambda r: (
      r.how,
      len(r.torus),
      order[r.fmt.dtype],
      r.fmt.block_size,
      DISTRIBUTIONS.index(r.data),
    ),
  )
  for r in rows:
    same = "-" if r.matches_model is None else ("yes" if r.matches_model else "NO")
    lines.append(
      f"| {int(np.prod(r.torus))} | {'x'.join(map(str, r.torus))} | {r.how} | {r.fmt.dtype} "
      f"| {r.fmt.block_size} | {r.data} | {r.rms_rel:.2e} | {r.max_rel:.2e} "
      f"| {r.max_err_over_a:.2e} | {r.bound:.2e} | {r.max_err_over_a / r.bound:.1%} | {same} |"
    )
  return "\n".join(lines)


def report(seed: int = 0) -> tuple[str, float]:
  """The markdown report (title, how it was made, table) and the seconds it took."""
  start = time.perf_counter()
  rows = measured_rows(seed) + modelled_rows(seed + 1)
  seconds = time.perf_counter() - start
  how = (
    "`python -m bench.quantization_report`. p = 8: measured, `shard_map.all_reduce` on 8 "
    f"simulated CPU devices ({N8:,} float32 elements per device); p = 256: modelled, "
    "`quantization.simulate` on a 16x16 torus (each device 256 chunks of 4 max(B, 256) "
    "elements). One bfloat16 scale per block; round to nearest; every hop of the "
    "reduce-scatter requantizes, the all-gather forwards the bytes. Data: a standard "
    "normal or Student-t (3 degrees of freedom) buffer per device, fixed seeds. "
    "`max err/Σa`: the largest |error| / sum_i a_i (a_i: device i's largest magnitude in "
    "the element's block), against `quantization.error_bound` (`bound c`); `= model`: the "
    "measured result equals `simulate`'s bitwise on every device."
  )
  title = "# Block-scaled all-reduce: error against the float64 sum"
  return "\n".join([title, "", how, "", format_table(rows), ""]), seconds


def main(argv: Sequence[str] | None = None) -> None:
  markdown_report.main(argv, __doc__.split("\n\n")[0], DEFAULT_OUT, report)


if __name__ == "__main__":
  main()
