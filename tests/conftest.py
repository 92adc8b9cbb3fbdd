"""Eight simulated CPU devices for every test, and the fixtures the test modules share.

XLA reads the device count once, when jax is first imported, so it is set here at module
top, before any test module imports jax.

The shared pieces themselves live in ``harness`` (importable from subprocess scripts too):
meshes by shape, per-device inputs, and the one TPU interpret-mode context. Here they are
fixtures: ``mesh``, ``small_integers``, ``random_floats`` and ``interpret`` (TPU interpret mode
for the test's body, in both DMA execution modes unless a test parametrizes it
indirectly).

Stand-in backends: with ``TORUS_COLLECTIVES_STAND_INS="new=existing,..."`` set, each
``new`` is registered before collection as a copy of the ``existing`` backend's record
under its new name, so that the conformance bases parametrize over it; with
``TORUS_COLLECTIVES_COLLECTED=path`` set, every collected test's node id and implementation
(before ``-k`` deselects any) is written to ``path`` as JSON
(``test_conformance_registry`` runs the bases so).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite checks values, not speed: XLA's cheapest compile pipeline cuts the compile time
# that dominates these tests by more than half.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Subprocess tests load libtpu (for ahead-of-time TPU compiles) while this process holds it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One persistent compilation cache for the whole run, shared by the xdist workers and every
# subprocess the tests start (they inherit the environment): a program compiled again by
# another test or process (the example's train step, re-run on resume) is read back.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="torus-collectives-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# XLA's CPU runtime runs each device's independent operations at once on one shared pool
# of max(NPROC or the core count, device count) threads, and a thread that reaches a
# collective, or an interpreted kernel's barrier, blocks there until every device has
# arrived. A device can hold two such threads at once (a kernel callback beside an
# all-reduce), so with 8 threads for 8 devices the pool can run out while a device's next
# step waits in its queue, and the step never finishes (seen on every run of the threaded
# sharded ResNet step in interpret mode). 64 threads give each of 16 simulated devices more than
# the two it can block; torus_collectives.testing.split_interpret checks the pool on entry.
os.environ.setdefault("NPROC", "64")
# In TPU interpret mode each simulated device runs its kernels in Python, the eight of them
# sharing two cores and the GIL, so a device can reach a collective minutes after its
# peers; XLA's CPU runtime aborts the whole process when a rendezvous waits 40 s. Give
# it 10 min: a real hang is still ended by pytest-timeout and by the interpreter
# extension's deadlock watchdog (torus_collectives.testing.split_interpret), stacks printed.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
  + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
).strip()

import dataclasses
import json

import harness
import jax
import pytest

NUM_DEVICES = 8


def stand_ins() -> dict[str, str]:
  """{stand-in name: the registered backend it copies}, from the environment."""
  pairs = [p for p in os.environ.get(harness.STAND_INS_ENV_VAR, "").split(",") if p.strip()]
  return dict(tuple(s.strip() for s in p.split("=", 1)) for p in pairs)


def pytest_configure(config):
  """Registers the stand-in backends before any test module is collected."""
  from torus_collectives import registry

  for name, original in stand_ins().items():
    if name not in registry.BACKENDS:
      registry.register(dataclasses.replace(registry.BACKENDS[original], name=name))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Orders the files (``_slow_files_first``); writes every collected test and its
  implementation where the environment asks."""
  _slow_files_first(items)
  path = os.environ.get(harness.COLLECTED_ENV_VAR)
  if path:
    collected = [
      {
        "id": item.nodeid,
        "impl": item.callspec.params.get("impl") if hasattr(item, "callspec") else None,
        "slow": item.get_closest_marker("slow") is not None,
      }
      for item in items
    ]
    with open(path, "w") as f:
      json.dump(collected, f)


def _slow_files_first(items) -> None:
  """Moves the files that hold a ``slow`` test ahead of the rest, keeping each file's order.

  ``make test`` hands whole files to its xdist workers in collection order; the longest
  jobs first is what lets the short files fill the end of the run on both cores."""
  slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
  items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == NUM_DEVICES, (
    "tests need 8 simulated CPU devices; import jax only after tests/conftest.py"
  )


@pytest.fixture
def mesh():
  """``harness.mesh``: ``mesh(shape, names=None)``, a mesh of the first devices."""
  return harness.mesh


@pytest.fixture
def small_integers():
  """``harness.small_integers``: ``(shape, dtype, seed)``, exact in every dtype."""
  return harness.small_integers


@pytest.fixture
def random_floats():
  """``harness.random_floats``: ``(shape, dtype, seed)``, standard normal."""
  return harness.random_floats


@pytest.fixture(params=harness.DMA_MODES)
def interpret(request):
  """The test's body runs in ``harness.interpret_mode`` (race detector on, no race allowed
  at the end), in each DMA execution mode; yields the mode. Parametrize ``interpret``
  indirectly to pick one. A fixture does not see whether its test failed, so the
  interpreter's state is reset after every test."""
  try:
    with harness.interpret_mode(request.param):
      yield request.param
  finally:
    harness.reset_interpret_mode_state()


@pytest.fixture
def isolated_tables(tmp_path, monkeypatch):
  """No shipped tuning table, an empty user cache, no installed table: only what a test
  writes (yields the folder they go in)."""
  from torus_collectives.tuning import tables

  monkeypatch.setenv(tables.ENV_VAR, str(tmp_path / "cache.json"))
  shipped = tmp_path / "shipped"
  shipped.mkdir()
  monkeypatch.setattr(tables, "SHIPPED_DIR", shipped)
  tables.use_table(None)
  tables.log_unmeasured.cache_clear()
  yield tmp_path
  tables.use_table(None)
