"""Sphinx configuration of the energon_pack documentation (MyST Markdown pages)."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

import energon_pack  # noqa: E402

project = "energon_pack"
author = "energon_pack contributors"
copyright = "energon_pack contributors"
version = energon_pack.__version__
release = energon_pack.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_fixtures", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# MyST: anchors for headings down to level 3, so pages can link to `page.md#section`.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: document through the top-level re-exports (energon_pack.<Name>) only.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Quotes and ellipses only: `--flag` in CLI help and prose stays two hyphens, not an en dash.
smartquotes_action = "qe"
# Blocks without a language (the CLI's usage lines) are shown as plain text.
highlight_language = "text"

html_theme = "nvidia_sphinx_theme"
html_title = f"energon_pack {release}"
html_static_path = ["_static"]
html_show_sourcelink = False

# sphinx-argparse reads each help string of the CLI as reStructuredText, where `|name|` is a
# substitution: the help of `offline --train-newline-after-im-end` names the token `<|im_end|>`.
# Help strings are the plain text `--help` prints, so a `|` in them is escaped before parsing.
import sphinxarg.ext  # noqa: E402

_render_list = sphinxarg.ext.render_list


def _render_help(items: list[object], markdown_help: bool, settings: object = None) -> list[object]:
    escaped = [item.replace("|", "\\|") if isinstance(item, str) else item for item in items]
    return _render_list(escaped, markdown_help, settings)


sphinxarg.ext.render_list = _render_help
