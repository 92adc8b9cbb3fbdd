"""Run length of the benchmarks: short by default, the full sweep with TC_BENCH_FULL=1."""

import os

FULL = os.environ.get("TC_BENCH_FULL", "") not in ("", "0")
