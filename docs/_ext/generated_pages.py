"""Pages the docs build writes from the package itself, so that nothing in them is typed by
hand and can drift:

* ``write_api_pages``: one page per name in ``torus_collectives.__all__`` (an autodoc stub
  chosen by the kind of object), and the autosummary table that lists them all;
* ``write_tuning_tables``: the tuning tables shipped in the package
  (``torus_collectives.tuning.tables.SHIPPED_DIR``), read with ``Table.from_json`` and
  rendered with ``format_table``, the tuner's own Markdown.

``setup`` runs both when the build starts (``builder-inited``), before Sphinx reads any page.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import typing

PACKAGE = "torus_collectives"
DOCS = pathlib.Path(__file__).resolve().parents[1]
API_DIR = DOCS / "api" / "generated"  # read by Sphinx as pages (the API reference)
INCLUDES_DIR = DOCS / "_generated"  # included by pages, never read as pages themselves


def _directive(obj) -> str:
  """The autodoc directive that documents ``obj``."""
  if inspect.ismodule(obj):
    return "automodule"
  if inspect.isclass(obj) and issubclass(obj, BaseException):
    return "autoexception"
  if inspect.isclass(obj):
    return "autoclass"
  if inspect.isfunction(obj):
    return "autofunction"
  return "autodata"  # tuples, typing aliases


_OPTIONS = {
  "automodule": ["   :members:"],
  "autoclass": ["   :members:"],
  "autoexception": ["   :members:"],
}


def _data_comment(name: str) -> str:
  """The comment lines right above the module-level assignment of ``name`` in the package's
  sources (where a constant is explained), or ""."""
  import torus_collectives

  root = pathlib.Path(torus_collectives.__file__).parent
  for path in sorted(root.rglob("*.py")):
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.parse(source).body:
      targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
      if any(isinstance(t, ast.Name) and t.id == name for t in targets):
        comment = []
        for line in reversed(lines[: node.lineno - 1]):
          if not line.startswith("#"):
            break
          comment.insert(0, line.lstrip("#").strip())
        return " ".join(comment)
  return ""


def _data_page(name: str, obj) -> list[str]:
  """A constant: its value, and the comment its defining module gives it."""
  lines = [f".. py:data:: {PACKAGE}.{name}", f"   :value: {obj!r}", ""]
  comment = _data_comment(name)
  return lines + ([f"   {comment}"] if comment else [])


def api_names() -> list[str]:
  """The public names, as ``torus_collectives.__all__`` lists them, sorted."""
  import torus_collectives

  return sorted(torus_collectives.__all__, key=str.lower)


def _write(path: pathlib.Path, text: str) -> None:
  """Writes ``text`` only if it changed, so an unchanged page is not rebuilt."""
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def write_api_pages(
  out_dir: pathlib.Path = API_DIR, includes_dir: pathlib.Path = INCLUDES_DIR
) -> list[pathlib.Path]:
  """One reStructuredText page per public name in ``out_dir``, and in ``includes_dir``
  ``api_summary.md``, the autosummary table of them all that the API reference page
  includes. Returns the pages, the summary last."""
  import torus_collectives

  out_dir.mkdir(parents=True, exist_ok=True)
  pages = []
  for name in api_names():
    obj = getattr(torus_collectives, name)  # the optax names load here
    directive = _directive(obj)
    title = f"``{PACKAGE}.{name}``"
    lines = [title, "=" * len(title), ""]
    if directive == "autodata":
      lines += _data_page(name, obj)
    else:
      lines += [f".. {directive}:: {PACKAGE}.{name}"] + _OPTIONS.get(directive, [])
    page = out_dir / f"{PACKAGE}.{name}.rst"
    _write(page, "\n".join(lines) + "\n")
    pages.append(page)
  stale = {p for p in out_dir.glob(f"{PACKAGE}.*.rst")} - set(pages)
  for page in stale:
    page.unlink()
  includes_dir.mkdir(parents=True, exist_ok=True)
  summary = includes_dir / "api_summary.md"
  # autosummary would describe a constant by its type's docstring: constants get a line each.
  documented = [n for n in api_names() if _directive(getattr(torus_collectives, n)) != "autodata"]
  constants = [n for n in api_names() if n not in documented]
  body = ["```{eval-rst}", ".. autosummary::", "   :nosignatures:", ""]
  body += [f"   {PACKAGE}.{name}" for name in documented] + ["```", ""]
  body += [f"- {{py:data}}`{PACKAGE}.{name}`" for name in constants]
  _write(summary, "\n".join(body) + "\n")
  return pages + [summary]


def write_tuning_tables(out_dir: pathlib.Path = INCLUDES_DIR) -> pathlib.Path:
  """``shipped_tuning_tables.md``: every shipped table, one section each, as the tuner
  prints it. Returns the file."""
  from torus_collectives.tuning import tables

  out_dir.mkdir(parents=True, exist_ok=True)
  parts = []
  for path in sorted(tables.SHIPPED_DIR.glob("*.json")):
    table = tables.Table.from_json(path.read_text())
    heading = f"### `{path.name}` (device kind `{table.device_kind}`)"
    parts += [heading, "", tables.format_table(table), ""]
  if not parts:
    parts = ["No tuning table is shipped.", ""]
  out = out_dir / "shipped_tuning_tables.md"
  _write(out, "\n".join(parts))
  return out


def _generate(app: typing.Any) -> None:
  del app
  write_api_pages()
  write_tuning_tables()


def setup(app):
  app.connect("builder-inited", _generate)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
