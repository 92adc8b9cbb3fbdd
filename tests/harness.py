"""What every test shares: meshes by shape, per-device inputs, and TPU interpret mode.

``conftest.py`` exposes these as fixtures; modules import them directly where a fixture
cannot reach (case tables built at collection time, the ``__main__`` blocks that re-run a
module in a subprocess with 16 devices).

* ``mesh(shape, names=None)``: a mesh of the first ``prod(shape)`` devices, row-major,
  axes ``x``, ``y``, ``z`` (or ``names``), Auto-typed unless told otherwise.
* ``small_integers`` (values in [-4, 4]: every sum of up to 16 of them is exact in every
  dtype, so every summation order gives the same bits) and ``random_floats`` (standard
  normal, rounded once to the dtype), with a leading axis of one entry per device for
  ``per_device``.
* ``interpret_mode(dma_execution_mode)``: the one way the suite runs Pallas TPU kernels off
  TPU: the race detector on, uninitialized memory poisoned (NaN, integers their maximum),
  no race allowed at the end, and the interpreter's global state reset if anything fails,
  so that one failure does not leak into the next test.
* For the conformance bases: ``implementation_cases`` (a test's parametrization over the
  registered implementations, with the depth of those that run Pallas kernels), ``run``
  (interpret mode where the implementation needs it) and ``group_result`` (the cases of a
  group compiled as one program).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from torus_collectives import _jax_internals as jax_internals

AXIS_NAMES = ("x", "y", "z")
# The torus ranks every conformance base runs: a ring, a 2-D and a 3-D torus of 8 devices.
RANKS = {"1d": (8,), "2d": (2, 4), "3d": (2, 2, 2)}
DMA_MODES = ("eager", "on_wait")
# Read by conftest.py: stand-in backends to register before collection ("new=existing,..."),
# and a file to write every collected test's node id and implementation to.
STAND_INS_ENV_VAR = "TORUS_COLLECTIVES_STAND_INS"
COLLECTED_ENV_VAR = "TORUS_COLLECTIVES_COLLECTED"


def mesh(shape, names=None, *, axis_types=AxisType.Auto, devices=None) -> Mesh:
  """A mesh of ``shape`` over ``devices`` (default: the first ``prod(shape)``), in order."""
  shape = tuple(shape)
  names = AXIS_NAMES[: len(shape)] if names is None else tuple(names)
  if devices is None:
    devices = jax.devices()[: math.prod(shape)]
  grid = np.array(devices, dtype=object).reshape(shape)
  return Mesh(grid, names, axis_types=(axis_types,) * len(shape))


def small_integers(shape, dtype, seed=0):
  """Values in [-4, 4]: every partial sum of up to 16 of them is exact in bf16 and f32."""
  return np.random.default_rng(seed).integers(-4, 5, size=shape).astype(dtype)


def random_floats(shape, dtype=np.float32, seed=0):
  """Standard normal values rounded once to ``dtype`` (a numpy array of that dtype)."""
  values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return np.asarray(jnp.asarray(values, dtype))


def sharded(fn, mesh, check_vma=True):
  """Jitted ``fn`` on device-local slices: inputs have a leading axis of one entry per
  device (row-major over the mesh); outputs come back the same way."""
  everything = P(tuple(mesh.axis_names))

  def body(*local):
    outs = fn(*jax.tree.map(lambda v: v[0], local))
    return jax.tree.map(lambda o: o[None], outs)

  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=everything, out_specs=everything, check_vma=check_vma)
  )


def per_device(fn, mesh, *inputs, check_vma=True):
  """Runs ``fn`` once on device-local slices (see ``sharded``)."""
  return sharded(fn, mesh, check_vma)(*inputs)


@contextlib.contextmanager
def interpret_mode(dma_execution_mode: str = "on_wait"):
  """Pallas TPU kernels run in TPU interpret mode inside the block, checked for races.

  ``dma_execution_mode`` is "eager" (a DMA lands when it starts) or "on_wait" (when it is
  waited for). Run the kernels to completion inside the block (``jax.block_until_ready``):
  the race check at its end sees only what has run."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  from jax.experimental.pallas import tpu as pltpu

  if dma_execution_mode not in DMA_MODES:
    raise ValueError(f"{dma_execution_mode=}: one of {DMA_MODES}")
  params = pltpu.InterpretParams(
    dma_execution_mode=dma_execution_mode, detect_races=True, uninitialized_memory="nan"
  )
  try:
    with (
      pltpu.force_tpu_interpret_mode(params),
      jax_internals.interpreter_callbacks_on_host_arrays(),
    ):
      yield params
    races = interpret_pallas_call.races  # None until a kernel has run
    assert races is None or not races.races_found, "the interpreter detected a data race"
  except BaseException:
    reset_interpret_mode_state()
    raise


def reset_interpret_mode_state() -> None:
  """Clears the interpreter's global state (shared memory, semaphores, race records)."""
  from jax.experimental.pallas import tpu as pltpu

  pltpu.reset_tpu_interpret_mode_state()


def interpreted(mode: str, fn, *args):
  """``fn(*args)`` traced and run to completion in ``interpret_mode(mode)``."""
  with interpret_mode(mode):
    return jax.block_until_ready(fn(*args))


# ---------------------------------------------------------------------- conformance bases


def kernels(impl: str) -> bool:
  """``impl`` runs Pallas kernels (its record's ``pallas_kernels``): off TPU only in TPU
  interpret mode, seconds per kernel. "auto" never needs interpret mode on CPU."""
  from torus_collectives import registry

  return impl != "auto" and registry.BACKENDS[impl].pallas_kernels


def run(impl: str | None, fn, dma: str | None = None):
  """``fn()`` to completion; inside ``interpret_mode(dma or "on_wait")`` where ``impl``
  runs Pallas kernels (None: lax, a reference)."""
  if impl is not None and kernels(impl):
    with interpret_mode(dma or "on_wait"):
      return jax.block_until_ready(fn())
  return jax.block_until_ready(fn())


_GROUPS: dict = {}


def group_result(key, case, run_all, run_one):
  """The result of ``case``, taken from one program that runs every case of the group
  ``key`` (``run_all()`` returns {case: result}; it runs once per process, for the first
  test of the group that asks): compiling dominates these tests, and one program of n
  collectives compiles in a fraction of the time of n programs of one. If that program
  fails, each case runs alone (``run_one(case)``), so a failing case fails only its own
  test; the failure is reported as a warning."""
  if key not in _GROUPS:
    try:
      _GROUPS[key] = run_all()
    except Exception as error:  # noqa: BLE001 (each case then runs, and fails, alone)
      message = f"group {key} failed as one program; its cases run alone: {error!r}"
      warnings.warn(message, stacklevel=2)
      _GROUPS[key] = error
  results = _GROUPS[key]
  if isinstance(results, Exception) or case not in results:
    return run_one(case)
  return results[case]


def _case_id(value) -> str:
  if isinstance(value, tuple):
    return ("x" if value and isinstance(value[0], int) else "").join(map(str, value))
  if isinstance(value, (type, np.dtype)):
    return np.dtype(value).name
  return str(value)


def implementation_cases(
  implementations,
  argnames: str,
  *axes,
  rows=None,
  spread=None,
  kernel_free=False,
  refuses=None,
  keep=None,
):
  """``pytest.mark.parametrize("impl,dma," + argnames)`` over ``implementations`` × the
  product of ``axes`` (or the case tuples ``rows``): what a conformance base's test runs;
  ``keep(impl, *case)``, if given, says which of those it runs.

  An implementation with Pallas kernels keeps a case only if no kernel runs in it
  (``kernel_free``, or ``refuses(impl, *case)`` is not None: its record refuses the request
  at trace time) or the case is in ``spread`` ({case: DMA execution mode}); ``dma`` is that
  mode, and None in every other case. Ids: the implementation, the case, the mode.
  """
  import pytest

  spread = spread or {}
  rows = list(itertools.product(*axes)) if rows is None else [tuple(r) for r in rows]
  params = []
  for impl in implementations:
    for case in rows:
      if keep is not None and not keep(impl, *case):
        continue
      dma, marks = None, []
      if kernels(impl):
        refused = refuses is not None and refuses(impl, *case) is not None
        if not (kernel_free or refused):
          if case not in spread:
            continue
          dma, marks = spread[case], [pytest.mark.interpret]
      ids = [impl, *map(_case_id, case)] + ([dma] if dma else [])
      params.append(pytest.param(impl, dma, *case, marks=marks, id="-".join(ids)))
  return pytest.mark.parametrize(",".join(["impl", "dma", *filter(None, [argnames])]), params)


def parametrized_implementations(test) -> set[str]:
  """The implementations a test function of a base is parametrized over."""
  found = set()
  for mark in getattr(test, "pytestmark", []):
    if mark.name == "parametrize" and mark.args[0].split(",")[0] == "impl":
      for param in mark.args[1]:
        values = getattr(param, "values", param)
        found.add(values if isinstance(values, str) else values[0])
  return found


def pallas_calls(jaxpr):
  """Every ``pallas_call`` equation of ``jaxpr`` and of its sub-jaxprs, in program order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from pallas_calls(sub)


def measured_entry(topology: str, op: str, dtype: str, bucket: int, choice: str, ratio=0.5):
  """A tuning-table entry that picks ``choice`` by the package's rule: two runs, from two
  processes, each with ``MIN_ROUNDS`` rounds at ``ratio`` of XLA's time (what "auto"
  accepts; a bare ``choice`` with no runs it ignores)."""
  from torus_collectives.tuning import tables

  runs = [
    tables.Run.of({choice: [ratio] * tables.MIN_ROUNDS}, process=f"process-{i}")
    for i in range(tables.MIN_RUNS)
  ]
  entry = tables.Entry.from_runs(topology, op, dtype, bucket, runs)
  assert entry.choice == choice, entry
  return entry
