"""Sphinx configuration of the torus-collectives documentation (``make docs``).

Pages are Markdown (myst-parser); the API reference is generated from the package's
docstrings (autodoc, Google style through napoleon). ``_ext/generated_pages.py`` writes,
when the build starts, one API page per name in ``torus_collectives.__all__`` and the
shipped tuning tables as Markdown, so neither is typed by hand.
"""

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout's sources, whatever else is installed
sys.path.insert(0, str(DOCS / "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "torus-collectives"
author = "torus-collectives authors"
copyright = "the torus-collectives authors"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "generated_pages",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# _generated/ holds files that pages include; they are not pages themselves.
exclude_patterns = ["_build", "_generated"]

myst_heading_anchors = 3

autosummary_generate = False  # generated_pages writes the pages, from __all__
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "torus-collectives"
