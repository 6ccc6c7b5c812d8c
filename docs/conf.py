"""Sphinx configuration of the documentation site (``make docs``; warnings are errors there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Importing the modules must not start anything: no GPU, no network, no MPI launch.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import adasum_lightning  # noqa: E402

project = "adasum-lightning"
author = "adasum-lightning contributors"
copyright = "2026, adasum-lightning contributors"  # noqa: A001
release = version = adasum_lightning.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
# benchmarks_notes.md is appended to the generated benchmarks.md (benchmarks/report.py): not a page.
exclude_patterns = ["_build", "benchmarks_notes.md"]
myst_heading_anchors = 4

# Google-style docstrings; the API pages list what each module exports.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "description"
autodoc_preserve_defaults = True
# Lightning's own docstrings (of the methods the strategies override) are Lightning's to document.
autodoc_inherit_docstrings = False

html_theme = "furo"
html_title = f"adasum-lightning {release}"
