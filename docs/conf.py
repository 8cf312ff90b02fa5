"""Sphinx configuration for the TileScale documentation (``nox -s docs``)."""

project = "TileScale"
author = "TileScale developers"
copyright = "2026, TileScale developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# The site's root is _root.md (index.md's text and the hidden table of contents); index.md
# itself is plain Markdown, so it reads the same on a code host.
root_doc = "_root"
exclude_patterns = ["_build", "index.md"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_use_ivar = True
html_theme = "alabaster"


def _index_page(app, exception):
    """The site's front page is also ``index.html`` (the root document is ``_root``)."""
    import shutil
    from pathlib import Path

    out = Path(app.outdir)
    if exception is None and app.builder.format == "html" and (out / "_root.html").exists():
        shutil.copyfile(out / "_root.html", out / "index.html")


def setup(app):
    app.connect("build-finished", _index_page)
