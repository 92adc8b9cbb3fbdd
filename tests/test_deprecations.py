"""Renamed public paths keep working for one release, with a ``DeprecationWarning`` that
names the new path; ``CHANGELOG.md`` lists them, and the package's version is its newest
released section."""

import importlib
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

MOVED_MODULES = [
  ("torus_collectives.nn", "torus_collectives.norm.linen", "BatchNorm"),
  ("torus_collectives.timing", "torus_collectives.tuning.timing", "Interleaved"),
  ("torus_collectives.tune", "torus_collectives.tuning.tuner", "main"),
  ("torus_collectives.overlap", "torus_collectives.experimental.overlap", "value_and_summed_grad"),
  ("torus_collectives.layout", "torus_collectives.tiling", "bn_view"),
  ("torus_collectives.configs", "torus_collectives.kernel_config", "KernelConfig"),
  (
    "torus_collectives.weight_update.interpreter",
    "torus_collectives.weight_update.sharded_eval",
    "Interpreter",
  ),
]


@pytest.mark.parametrize("old,new,name", MOVED_MODULES, ids=[m[0] for m in MOVED_MODULES])
def test_an_old_module_imports_warns_and_is_the_new_one(old, new, name):
  sys.modules.pop(old, None)
  with pytest.warns(DeprecationWarning, match=re.escape(new)) as caught:
    module = importlib.import_module(old)
  package = str(ROOT / "torus_collectives")
  assert not any(w.filename.startswith(package) for w in caught), "it points at the importer"
  assert getattr(module, name) is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("name", ["use_table", "Table", "Entry", "Run", "decide", "cache_path"])
def test_the_old_table_api_answers_from_tuning_and_warns(name):
  from torus_collectives import tuning
  from torus_collectives.tuning import tables

  with pytest.warns(DeprecationWarning, match=re.escape(f"tuning.tables.{name}")) as caught:
    found = getattr(tuning, name)
  assert found is getattr(tables, name)
  assert caught[0].filename == __file__  # the warning points at the line that used it
  with pytest.raises(AttributeError):
    tuning.no_such_name  # noqa: B018


# Names that left ``torus_collectives.__all__``: each still answers as ``tc.NAME``.
MOVED_NAMES = [
  ("torus_collectives", "IMPLEMENTATIONS", "torus_collectives.registry"),
  ("torus_collectives", "auto_implementation", "torus_collectives.registry"),
  ("torus_collectives", "auto_rounding_bound", "torus_collectives.registry"),
  ("torus_collectives", "lars", "torus_collectives.weight_update.trust_ratio"),
  ("torus_collectives", "scale_by_trust_ratio", "torus_collectives.weight_update.trust_ratio"),
  ("torus_collectives", "value_and_summed_grad", "torus_collectives.experimental"),
  ("torus_collectives.tuning", "tune_step", "torus_collectives.tuning.step_tuning"),
]


@pytest.mark.parametrize(
  "old,name,new", MOVED_NAMES, ids=[f"{old}.{name}" for old, name, _ in MOVED_NAMES]
)
def test_a_moved_name_answers_at_its_old_path_and_warns(old, name, new):
  if new.endswith("trust_ratio"):
    pytest.importorskip("optax")
  module = importlib.import_module(old)
  assert name not in getattr(module, "__all__", ())
  with pytest.warns(DeprecationWarning, match=re.escape(f"use {new}.{name}")) as caught:
    found = getattr(module, name)
  assert found is getattr(importlib.import_module(new), name)
  assert caught[0].filename == __file__  # the warning points at the line that used it
  with pytest.warns(DeprecationWarning, match=re.escape(f"{old}.{name} is deprecated")):
    getattr(module, name)  # every use warns, not only the first


def test_the_old_tuner_command_runs_and_warns():
  run = subprocess.run(
    [sys.executable, "-m", "torus_collectives.tune", "--help"],
    capture_output=True,
    text=True,
    timeout=120,
    env={"JAX_PLATFORMS": "cpu", "PATH": "", "PYTHONPATH": str(ROOT)},
  )
  assert run.returncode == 0, run.stderr
  assert "python -m torus_collectives.tuning" in run.stderr  # the warning names the new one
  assert "--mesh" in run.stdout


def test_the_changelog_names_every_deprecated_path_and_the_version_follows_it():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  deprecated = changelog.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
  for old, new, _ in MOVED_MODULES:
    assert f"`{old}`" in deprecated and f"`{new}`" in deprecated, old
  assert "`torus_collectives.tuning.tables`" in deprecated
  for old, name, new in MOVED_NAMES:
    assert f"`{old}.{name}`" in deprecated and f"`{new}.{name}`" in deprecated, name
  released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, re.M)
  version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
  assert released and released[0] == version
