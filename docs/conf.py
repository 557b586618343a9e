"""Sphinx configuration of ClusterEnv's docs site.

Build it with ``pip install -e ".[docs]"`` then ``sphinx-build -W -b html docs docs/_build/html``
(CI builds it with warnings as errors). Pages are Markdown (MyST); the API reference is generated
from the docstrings of the public API (autodoc), which are reST.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # autodoc imports this checkout's packages, not an installed copy

import clusterenv_core  # noqa: E402

project = "ClusterEnv"
author = "ClusterEnv contributors"
release = clusterenv_core.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3  # links to a page's sections: guides/failures.md#recovery-opt-in

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = False  # the docstrings are reST (:param:), as SB3's

html_theme = "furo"
html_title = f"ClusterEnv {release}"
