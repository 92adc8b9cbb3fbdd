"""The hardware check: ``python -m torus_collectives.check``.

One command that verifies the package on the devices jax sees, times it against XLA and
calibrates the cost model, as nccl-tests and the tuner would together: one run, one
report, one verdict.

* ``cases``: what runs, as data (every registered implementation that runs here, crossed
  with the ops, dtypes, sizes and tori), with a stable id per case;
* ``verify``: stage 1 in a worker, one case compared with ``jax.lax`` within the
  package's stated bounds;
* ``measure``: stage 2, the tuner's programs timed in interleaved rounds against XLA, and
  the nccl-tests rows (time, algbw, busbw, ratio to XLA with its interval, #wrong);
* ``step``: stage 2 from a checkout, the ResNet example's train step per variant in
  images/s against XLA, with ``bench.overlap_report``'s prediction on TPU;
* ``calibrate``: stage 3, the cost model's per-hop latency and link bandwidth fitted to
  the timings, and the tuning table the package's rule makes of them;
* ``worker`` and ``runner``: the cases run in worker processes with a watchdog per case,
  so that a case that raises, hangs or crashes is reported and the run goes on;
* ``report``: ``results.json``, ``report.md`` rendered from it, and the plots;
* ``cli``: the command line and the order of the stages.

The parent process never opens the devices (on a TPU one process at a time holds them):
a probe worker reports what is there, and every case runs in a worker. ``--plugin
MODULE`` is imported in the parent and in every worker, so a backend it registers with
``registry.register`` is checked like the built-in ones.
"""

from torus_collectives.check.cli import main

__all__ = ["main"]
