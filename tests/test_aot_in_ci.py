"""In CI the ahead-of-time TPU compiles must run, not skip.

The ``aot`` tests skip without libtpu, so a CI image that lost the ``tpu`` extra would pass
with none of them run. The extra is declared in pyproject.toml and ``make test`` installs
it; in CI (``CI`` set, as ``.ci/run`` and hosted CI services do) libtpu must be importable.
"""

import importlib
import os
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_tpu_extra_declares_libtpu_and_make_test_installs_it():
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert any(req.startswith(("jax[tpu]", "libtpu")) for req in extras["tpu"])
  installed = re.search(r"^EXTRAS := (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
  assert "tpu" in installed.group(1).split(",")


def test_ci_has_libtpu_so_the_aot_tests_run():
  if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
    pytest.skip("outside CI libtpu is optional (the aot tests skip without it); CI requires it")
  try:
    importlib.import_module("libtpu")
  except ImportError as e:
    pytest.fail(f"CI runs without libtpu ({e}): every aot test would skip; install the tpu extra")
