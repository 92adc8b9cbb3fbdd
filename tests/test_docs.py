"""The documentation says only what is true and checked: its examples run, every public
name has an API page, its links resolve, and no figure in it is typed by hand.

The pages are ``README.md``, ``resnet/README.md`` and ``docs/*.md``.

* Examples: each page's fenced ``python`` blocks run in order, as one program, in a
  subprocess on 8 simulated CPU devices (``XLA_FLAGS``, as ``conftest.py`` sets for the
  suite); each asserts what it shows, mostly against ``jax.lax``.
* API: ``docs/_ext/generated_pages.py``, which the docs build runs, writes one page per name
  in ``torus_collectives.__all__`` (called here into ``tmp_path``), and renders every
  shipped tuning table through the package's own ``tuning.tables`` API.
* Tables: measured and shipped figures reach the pages only through ``{include}`` of files
  that a command generates (``bench/results/*.md``, the tuning tables above), so no line of
  a page is a Markdown table row: none starts with ``|``.
* Figures in prose: each is derived from the code or a command's output file, or recorded
  under the date and commit it was measured at (``doc_figures``), and a recorded commit is
  one of this repository's.
* Wording: nothing here has run on a TPU, so no page says that anything "runs on TPU" or
  "ran on TPU".
* Links: every relative link and image resolves to a file of the checkout, and a link's
  ``#anchor`` to a heading of its page.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import doc_figures
import pytest

import torus_collectives

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "resnet" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_TIMEOUT_S = 300

FENCE = re.compile(r"^(```+|~~~+)([^\n]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def _name(page: pathlib.Path) -> str:
  return str(page.relative_to(ROOT))


def python_blocks(text: str) -> list[str]:
  """The fenced ``python`` code blocks of a Markdown page, in order."""
  return [body for _, info, body in FENCE.findall(text) if info.strip() == "python"]


def prose(text: str) -> str:
  """The page without its fenced blocks and inline code, where links cannot be."""
  return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _generated_pages():
  path = ROOT / "docs" / "_ext" / "generated_pages.py"
  spec = importlib.util.spec_from_file_location("generated_pages", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_pages_exist():
  names = {p.name for p in PAGES}
  assert {"README.md", "index.md", "api.md", "getting-started.md"} <= names
  assert len(PAGES) >= 12


EXAMPLE_PAGES = [p for p in PAGES if python_blocks(p.read_text())]


def test_the_pages_have_examples():
  assert len(EXAMPLE_PAGES) >= 8, [_name(p) for p in EXAMPLE_PAGES]


@pytest.mark.slow
@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=_name)
def test_the_examples_run(page, tmp_path):
  program = tmp_path / "example.py"
  program.write_text("\n\n".join(python_blocks(page.read_text())))
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
  )
  run = subprocess.run(
    [sys.executable, str(program)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=EXAMPLE_TIMEOUT_S,
  )
  assert run.returncode == 0, f"{_name(page)}'s examples failed:\n{run.stdout}\n{run.stderr}"


def test_every_public_name_has_an_api_page(tmp_path):
  generated = _generated_pages()
  written = generated.write_api_pages(tmp_path / "api", tmp_path / "includes")
  *pages, summary = written
  expected = {f"torus_collectives.{name}.rst" for name in torus_collectives.__all__}
  assert {p.name for p in pages} == expected
  assert len(expected) == len(torus_collectives.__all__)
  for name in torus_collectives.__all__:
    page = (tmp_path / "api" / f"torus_collectives.{name}.rst").read_text()
    assert re.search(rf"^\.\. (auto\w+|py:data):: torus_collectives\.{name}$", page, re.M), page
    assert f"torus_collectives.{name}`" in summary.read_text() or (
      f"   torus_collectives.{name}\n" in summary.read_text()
    )


def test_the_api_page_includes_the_generated_list():
  api = (ROOT / "docs" / "api.md").read_text()
  assert "_generated/api_summary.md" in api
  assert "api/generated/torus_collectives.*" in api


def test_the_shipped_tuning_tables_are_rendered_from_the_package(tmp_path):
  from torus_collectives.tuning import tables

  out = _generated_pages().write_tuning_tables(tmp_path).read_text()
  shipped = sorted(tables.SHIPPED_DIR.glob("*.json"))
  assert shipped
  rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
  entries = sum(len(tables.Table.from_json(p.read_text()).entries) for p in shipped)
  assert len(rows) == entries + len(shipped)  # one header row per table
  assert "_generated/shipped_tuning_tables.md" in (ROOT / "docs" / "tuning.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_table_is_typed_by_hand(page):
  rows = [line for line in page.read_text().splitlines() if line.lstrip().startswith("|")]
  assert not rows, f"{_name(page)}: include a generated file instead of typing {rows[:2]}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_page_claims_a_tpu_run(page):
  text = " ".join(page.read_text().split()).lower()  # a claim may break across lines
  for claim in ("runs on tpu", "ran on tpu", "runs on a tpu", "ran on a tpu"):
    assert claim not in text, f"{_name(page)} says {claim!r}"


def slug(heading: str) -> str:
  """The anchor myst-parser (and GitHub) give a heading."""
  text = re.sub(r"[^\w\s-]", "", heading.replace("`", "").strip().lower())
  return re.sub(r"\s", "-", text)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page):
  for target in LINK.findall(prose(page.read_text())):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.is_file(), f"{_name(page)} links to {target}, which does not exist"
    assert ROOT in linked.parents, f"{_name(page)} links outside the repository: {target}"
    if anchor and linked.suffix == ".md":
      anchors = {slug(h) for h in HEADING.findall(FENCE.sub("", linked.read_text()))}
      assert anchor in anchors, f"{_name(page)} links to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_figure_is_derived_or_recorded(page):
  problems, commits = doc_figures.problems(_name(page), page.read_text())
  assert not problems, "\n".join(problems)
  if not (ROOT / ".git").exists():
    return  # an unpacked source tree: no history to look the commits up in
  for commit in commits:
    found = subprocess.run(
      ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    )
    assert found.returncode == 0, f"{_name(page)} records figures at {commit}: no such commit"


def test_the_ledger_names_pages_that_exist():
  assert {d.page for d in doc_figures.LEDGER} <= {_name(p) for p in PAGES}


def test_a_figure_edited_by_hand_is_caught():
  """A planted edit: a derived figure changed on the page, and a new figure typed into a
  section that is not a dated record."""
  page = ROOT / "docs" / "transport.md"
  text = page.read_text()
  assert not doc_figures.problems(_name(page), text)[0]
  assert "1.08 × 31/254" in text  # the error bound's ratio, rendered from the code
  edited = text.replace("1.08 × 31/254", "1.09 × 31/254")
  assert any("not found" in p for p in doc_figures.problems(_name(page), edited)[0])
  typed = text.replace("## The error bound\n", "## The error bound\n\nIt takes 3.14 ms.\n", 1)
  assert any("'3.14'" in p for p in doc_figures.problems(_name(page), typed)[0])
  recorded = typed.replace("## The error bound", "## The error bound (2026-12-05, commit 2019c4b)")
  assert not doc_figures.problems(_name(page), recorded)[0]


def test_figures_are_told_from_shapes_and_versions():
  prose = "a 16×16 torus, 4 × 8 devices, jax 0.12, Python >= 3.12, arXiv 1811.06992"
  assert doc_figures.figures(prose) == []
  assert doc_figures.figures("0.032 ms of 5.474 ms, 958 s at 6 images/s, 98.61%") == [
    "0.032",
    "5.474",
    "958 s",
    "6 images/s",
    "98.61",
  ]


TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs)\b|\b\d\.\d+\s?(?:x|×)\s(?:XLA|of|against)")


def test_no_source_quotes_a_measured_timing():
  """Timings that describe how a design choice was reached belong in the design log, with
  their date and commit; in a docstring or comment nothing keeps them true."""
  sources = sorted((ROOT / "torus_collectives").rglob("*.py")) + sorted(
    (ROOT / "kernels").glob("*.py")
  )
  found = [
    f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
    for p in sources
    for n, line in enumerate(p.read_text().splitlines(), 1)
    if TIMING.search(line)
  ]
  assert not found, "\n".join(found)
