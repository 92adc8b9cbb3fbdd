"""Whole-step tuning: time the user's train step with each gradient summation, and let
"auto" read the result.

Why: a gradient summation whose collectives overlap the backward pass (asynchronous
kernels, XLA's asynchronous collectives, smaller buckets that start earlier) looks no
faster when its collective is timed alone, as ``tuning.tuner`` times the op
``all_reduce_gradients``. Only the whole step shows what it gains, or what a bucket size
costs.

The algorithm (``tune_step``):

1. *The key.* The baseline step, ``make_step("xla", gradients.DEFAULT_BUCKET_BYTES)``,
   is traced once (abstractly, without jit and through a new function, so that the
   user's Python runs even where a cached trace of the step exists) while
   ``gradients.recorded_requests`` records each ``all_reduce_gradients`` call. The
   largest of them (bytes on the wire) is the gradient summation the entry is for: its
   torus (the summed axes' sizes), the dtype that carries most of its bytes, and the size
   bucket of its total bytes (``tables.size_bucket``). The step must make at least one
   such call; the variants differ only in how they sum, so it is the same in all.
2. *The variants.* For each implementation ``registry.candidates`` says runs that dtype
   here (restricted to ``implementations`` if given) and that runs the recorded request
   (``registry.unsupported``), and each bucket size in ``bucket_sizes``: the step
   ``make_step(implementation, bucket_bytes)``, named ``tables.step_variant``
   (``"shard_map@4194304"``). The baseline is XLA at the default bucket size, named
   ``tables.BASELINE``; XLA at the other bucket sizes are candidates like the others.
3. *Timing.* What the op tuner does (``tuner.tune_cases`` with one ``tuner.Case`` whose
   ``candidates`` are the variants): ``timing.Interleaved`` compiles and warms every
   variant, then times ``rounds`` rounds, each calling every variant once on ``args``
   (outputs blocked on) in a seeded random order, and forms the per-round time ratios
   ``t_variant / t_baseline``. Assumed: a call of the step on ``args`` is representative
   of training (same shapes, no data-dependent work), and the step's outputs can be
   discarded (each call starts from the same ``args``; a step that donates its inputs
   cannot be called twice on them, so do not donate in the steps ``make_step`` builds).
4. *The rule.* ``tables.decide``, unchanged: a variant replaces the baseline only if the
   upper end of the bootstrap interval of its median ratio is at most ``tables.THRESHOLD``
   in each of ``tables.MIN_RUNS`` runs from different processes (a call adds one run to
   what ``output`` holds; the choice is the variant with the lowest worst-case bound). It
   picks the implementation and the bucket size together. The cost model's latency floor
   is not applied: it speaks of a collective timed alone.
5. *Storage.* One ``tables.Entry`` of op ``tables.STEP_OP`` (``"train_step"``) keyed by
   (topology, dtype, size bucket) in the table of this device kind, whose choice is a
   variant name: written to ``output`` (default: the user cache), merged with the runs
   it already holds, and installed for this process (``tables.use_table``), as the op
   tuner's entries are. With several processes, process 0's timings and file decide.
6. *What "auto" then does.* ``all_reduce_gradients(..., implementation="auto")`` over a
   torus of the same sizes, on the same device kind, for a tree of the same dominant dtype
   and size bucket (exactly: no other size inherits it) runs the entry's implementation,
   and its bucket size unless the caller passed ``bucket_bytes`` (``registry.tuned_step``).
   Where no step entry applies, or ``bitwise_as_lax`` is on, or the choice cannot run
   the call, "auto" decides as before. ``value_and_summed_grad(...,
   implementation="auto")`` reads the same entry and threads the summation through the
   backward pass where the entry's implementation has split collectives, as a step built
   on it was timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from torus_collectives import gradients, registry
from torus_collectives.sizes import MiB, size_label
from torus_collectives.tuning import tables, timing, tuner

DEFAULT_BUCKET_SIZES = (4 * MiB, gradients.DEFAULT_BUCKET_BYTES)


@dataclasses.dataclass(frozen=True)
class StepTuning:
  """What a whole-step tuning found.

  Attributes:
    implementation: the gradient summation "auto" now runs for this step's tree.
    bucket_bytes: its bucket size (the default one for the baseline).
    entry: the table entry (None when only the baseline runs here, so nothing was timed).
    request: the gradient summation the entry is keyed by.
  """

  implementation: str
  bucket_bytes: int
  entry: tables.Entry | None
  request: registry.Request


def traced_request(step: Callable[..., Any], args: Sequence[Any]) -> registry.Request:
  """The largest gradient summation ``step(*args)`` makes (its ``registry.Request``)."""
  # Without jit, and through a new function each time, so that no cached trace skips
  # the user's Python (and with it the calls to record).
  with gradients.recorded_requests() as seen, jax.disable_jit():
    jax.eval_shape(lambda *a: step(*a), *args)
  if not seen:
    raise ValueError(
      "the step sums no gradients: make_step must build a step that calls "
      "all_reduce_gradients(..., implementation=implementation, bucket_bytes=bucket_bytes)"
    )
  return max(seen, key=lambda r: r.nbytes or 0)


def variants(
  request: registry.Request,
  implementations: Sequence[str] | None,
  bucket_sizes: Sequence[int],
) -> dict[str, tuple[str, int]]:
  """``{step_variant name: (implementation, bucket bytes)}``: the baseline first."""
  device_kind = jax.devices()[0].device_kind
  dtype = request.dtypes[0] if request.dtypes else jnp.float32
  names = [
    n
    for n in registry.candidates(request.op, dtype, device_kind)
    if (implementations is None or n in implementations or n == tables.BASELINE)
    and registry.unsupported(n, request) is None
  ]
  out = {tables.BASELINE: (tables.BASELINE, gradients.DEFAULT_BUCKET_BYTES)}
  for name in names:
    for size in bucket_sizes:
      if (name, size) != out[tables.BASELINE]:
        out[tables.step_variant(name, size)] = (name, int(size))
  return out


def tune_step(
  make_step: Callable[[str, int], Callable[..., Any]],
  args: Sequence[Any],
  *,
  mesh: Mesh | None = None,
  implementations: Sequence[str] | None = None,
  bucket_sizes: Sequence[int] = DEFAULT_BUCKET_SIZES,
  rounds: int = tuner.DEFAULT_ROUNDS,
  label: str = "train step",
  output: str | None = None,
  timer: timing.Timer | None = None,
  install: bool = True,
  progress: Callable[[str], None] | None = print,
) -> StepTuning:
  """Times the train step with every gradient summation and bucket size against XLA at
  the default bucket size, adds the run to the table, and returns what "auto" now runs
  (the algorithm: this module's docstring).

  Args:
    make_step: ``make_step(implementation, bucket_bytes)`` returns the step, a callable
      of ``*args`` (jitted), that sums its gradients with ``all_reduce_gradients(...,
      implementation=implementation, bucket_bytes=bucket_bytes)``, or computes them with
      ``value_and_summed_grad`` of those arguments: then what is timed for an
      implementation with split collectives ("pallas") is the summation threaded through
      the backward pass, and "auto" in ``value_and_summed_grad`` runs it threaded.
    args: the step's arguments (a representative batch, state); not donated.
    mesh: set as the ambient mesh (``jax.set_mesh``) while the steps are traced and
      timed; None: whatever the steps use themselves.
    implementations: the gradient-summation implementations to try (of those that run
      here); None: all of them. XLA is always timed.
    bucket_sizes: the bucket sizes to try with each.
    rounds: timed rounds of the run (``tables.MIN_ROUNDS`` at least, or it passes nothing).
    label: names the step in the progress lines.
    output, timer, install, progress: as for ``tuner.tune_cases``: the table file to add
      the run to and write ("" none, None the user cache), a fake timer for tests,
      whether to install the result for this process, where progress lines go.

  Every process must make the same call (the steps' collectives span all of them).
  """
  scope = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  with scope:
    baseline = make_step(tables.BASELINE, gradients.DEFAULT_BUCKET_BYTES)
    request = traced_request(baseline, args)
    named = variants(request, implementations, bucket_sizes)

    def call(name: str) -> Callable[[], Any]:
      step = baseline if name == tables.BASELINE else make_step(*named[name])
      return lambda: step(*args)

    dtype = jnp.dtype(request.dtypes[0] if request.dtypes else jnp.float32).name
    case = tuner.Case(
      tables.STEP_OP,
      dtype,
      int(request.nbytes),
      tuple(request.torus),
      f"{tables.STEP_OP} {label}: gradients {dtype} {size_label(request.nbytes)}",
      call,
      candidates=tuple(named),
    )
    table = tuner.tune_cases(
      [case], rounds=rounds, timer=timer, output=output, install=install, progress=progress
    )
  entry = next(iter(table.entries), None)
  implementation, size = tables.parse_step_variant(
    tables.BASELINE if entry is None else entry.choice
  )
  return StepTuning(implementation, size or gradients.DEFAULT_BUCKET_BYTES, entry, request)
