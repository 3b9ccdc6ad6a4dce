"""Sphinx configuration for jdp's docs site (`make docs`).

The guides are the Markdown pages beside this file (MyST), the notebooks are
rendered with the outputs they are saved with (never executed here: the test
suite executes them), and the API reference is generated from the
docstrings (autodoc with Google-style sections).
"""

import jdp

project = "jdp"
author = "The jdp authors"
copyright = "The jdp authors"
release = version = jdp.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
# pypi.md is the package description (pyproject readme), not a page.
exclude_patterns = ["_build", "**.ipynb_checkpoints", "pypi.md"]
myst_heading_anchors = 3  # `page.md#a-heading` links resolve, as on a Git host
myst_enable_extensions = ["colon_fence"]
nb_execution_mode = "off"
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: autodoc documents the attributes once

html_theme = "sphinx_book_theme"
html_title = f"jdp {release}"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"
html_theme_options = {"show_toc_level": 2}
html_context = {"default_mode": "light"}  # the theme reads its colour mode from here


def _attribute_docstring(app, what, name, obj, options, lines):
    """A re-exported constant or alias gets the docstring written where it is defined.

    autodoc reads a data docstring from the source of the module named in the
    directive (``jdp``), which only re-exports it.
    """
    if what != "data" or lines:
        return
    import sys

    from sphinx.pycode import ModuleAnalyzer

    attr = name.rpartition(".")[2]
    for modname, module in sorted(sys.modules.items()):
        if modname.startswith("jdp.") and getattr(module, attr, None) is obj:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", attr))
            if docs:
                lines.extend(docs)
                return


def setup(app):
    app.connect("autodoc-process-docstring", _attribute_docstring)
