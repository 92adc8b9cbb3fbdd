"""Every import of the package goes down: no module imports one of a layer above its own.

The layers are ``LAYERS`` of ``torus_collectives/_layers.py``, top to bottom, read from its
source; the package's modules are read as source too (``ast``), so nothing is imported and
an import inside a function counts as much as one at the top of a file. ``kernels/`` is
``torus_collectives.kernels`` (``pyproject.toml``'s ``package-dir``).

What counts as an import of module ``m``: ``import m``, ``from m import name`` (of ``m.name``
where that is a module), ``importlib.import_module("m")``, and, since importing a module
runs the ``__init__`` of every package above it, each of those packages. Old paths kept for
one release are exempt in a function that warns first (``_deprecation.warn_moved``): it
loads the new path only when the old name is used.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "torus_collectives"
SOURCES = {PACKAGE: ROOT / PACKAGE, f"{PACKAGE}.kernels": ROOT / "kernels"}


def _layers() -> tuple[tuple[str, tuple[str, ...]], ...]:
  source = (ROOT / PACKAGE / "_layers.py").read_text()
  for node in ast.parse(source).body:
    if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["LAYERS"]:
      return ast.literal_eval(node.value)
  raise AssertionError("torus_collectives/_layers.py defines no LAYERS")


LAYERS = _layers()


def _modules() -> dict[str, pathlib.Path]:
  """Every module of the package, by its dotted name."""
  modules = {}
  for package, folder in SOURCES.items():
    for path in sorted(folder.rglob("*.py")):
      parts = path.relative_to(folder).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      modules[".".join((package, *parts))] = path
  return modules


MODULES = _modules()


def layer_of(module: str) -> int:
  """The index of ``module``'s layer in ``LAYERS`` (0: the top)."""
  found = [
    i
    for i, (_, names) in enumerate(LAYERS)
    for name in names
    if name == module or (name.endswith(".*") and module.startswith(name[:-1]))
  ]
  assert len(found) == 1, f"{module} is in {len(found)} layers of _layers.LAYERS, not one"
  return found[0]


def _warns_first(function: ast.AST) -> bool:
  """Whether ``function`` is an old path's loader: its first statement (after the
  docstring) calls ``warn_moved``."""
  body = [
    s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
  ]
  call = body[0].value if body and isinstance(body[0], ast.Expr) else None
  return isinstance(call, ast.Call) and "warn_moved" in (
    getattr(call.func, "id", None),
    getattr(call.func, "attr", None),
  )


def _exempt(tree: ast.Module) -> set[int]:
  """The ids of the nodes inside an old path's loader."""
  return {
    id(n)
    for f in ast.walk(tree)
    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and _warns_first(f)
    for n in ast.walk(f)
  }


def _targets(node: ast.AST, module: str) -> list[str]:
  """The package's modules that ``node`` imports, as written."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  if isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
      for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
      base = f"{package}.{base}" if base else package
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
  if (
    isinstance(node, ast.Call)
    and getattr(node.func, "attr", None) == "import_module"
    and node.args
    and isinstance(node.args[0], ast.Constant)
  ):
    return [node.args[0].value]
  return []


def imported(tree: ast.Module, module: str) -> set[str]:
  """Every module of the package that running ``tree`` (the source of ``module``) can
  import, with the packages above each (the package itself excepted: it is everyone's)."""
  exempt = _exempt(tree)
  found = set()
  for node in ast.walk(tree):
    if id(node) in exempt:
      continue
    for target in _targets(node, module):
      if target != PACKAGE and not target.startswith(f"{PACKAGE}."):
        continue
      parts = target.split(".")
      found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
  return found - {module}


def test_every_module_is_in_one_layer():
  for module in MODULES:
    layer_of(module)
  listed = {n for _, names in LAYERS for n in names if not n.endswith(".*")}
  assert not listed - set(MODULES), "_layers.LAYERS names modules that do not exist"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_nothing_above_its_layer(module):
  layer = layer_of(module)
  tree = ast.parse(MODULES[module].read_text())
  above = sorted(m for m in imported(tree, module) if m in MODULES and layer_of(m) < layer)
  assert not above, (
    f"{module} (layer {LAYERS[layer][0]!r}) imports "
    + ", ".join(f"{m} (layer {LAYERS[layer_of(m)][0]!r})" for m in above)
    + ": move what it needs down, or name it where it is used"
  )


def test_an_import_of_a_higher_layer_is_caught():
  """The check sees each way of importing: at the top, in a function, through a parent
  package, by ``importlib``; and exempts only a function that warns of an old path before
  it loads anything."""
  source = """
import importlib
from torus_collectives import registry
def f():
  from torus_collectives.tuning.tuner import main
def g():
  importlib.import_module("torus_collectives.overlap")
def h():
  warn_moved("old", "new")
  from torus_collectives.collectives import psum
def k(name):
  if name == "a":
    from torus_collectives.gradients import all_reduce_gradients
  warn_moved("old", "new")
"""
  assert imported(ast.parse(source), "torus_collectives.schedule") == {
    "torus_collectives.registry",
    "torus_collectives.tuning",
    "torus_collectives.tuning.tuner",
    "torus_collectives.overlap",
    "torus_collectives.gradients",
  }
  assert layer_of("torus_collectives.tuning.tuner") < layer_of("torus_collectives.schedule")
  assert layer_of("torus_collectives.tuning") > layer_of("torus_collectives.registry")


def test_the_package_docstring_names_every_layer():
  init = ast.get_docstring(ast.parse((ROOT / PACKAGE / "__init__.py").read_text()))
  assert "_layers" in init
  for name, _ in LAYERS:
    assert f"*{name}*" in init, f"the package docstring does not describe the layer {name!r}"
