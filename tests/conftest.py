"""Eight simulated CPU devices for every test.

XLA reads the device count once, when jax is first imported, so it is set here at module
top, before any test module imports jax.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite checks values, not speed: XLA's cheapest compile pipeline cuts the compile time
# that dominates these tests by more than half.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Subprocess tests load libtpu (for ahead-of-time TPU compiles) while this process holds it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import pytest

NUM_DEVICES = 8


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == NUM_DEVICES, (
    "tests need 8 simulated CPU devices; import jax only after tests/conftest.py"
  )


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
