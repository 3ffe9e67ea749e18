"""Sphinx configuration of tarantella's documentation site.

Build it from the checkout's top folder (the `docs` extra installs Sphinx, MyST and the theme):

    .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

Warnings are errors, so a broken internal link, an unknown reference or a docstring that does
not render fails the build.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # tarantella itself, also without an installed package
# Importing tarantella for autodoc makes this process a one-rank job (no MPI launcher started it):
# keep TensorFlow quiet and off any GPU while it does.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tarantella  # noqa: E402

project = "tarantella"
author = "the tarantella developers"
copyright = "the tarantella developers; GPL-3.0-or-later"
version = release = tarantella.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "tnt_reference",  # docs/_ext: the command reference and the TNT_* settings table, made from the code
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md"]

myst_heading_anchors = 3              # [text](page.md#a-heading) works for headings down to ###
myst_all_links_external = False       # every relative link is resolved, and a missing target is a warning
myst_enable_extensions = ["colon_fence", "deflist"]
suppress_warnings = []

nitpicky = True                       # every cross-reference must resolve ...
nitpick_ignore_regex = [              # ... except those into libraries this site does not document
    (r"py:.*", r"(keras|tf|tensorflow|np|numpy|jax|torch|enum|optional|callable|iterable)(\..*)?"),
    (r"py:.*", r"(int|float|str|bool|list|dict|tuple|None|object|type)"),
]

autodoc_default_options = {"members": True, "member-order": "bysource"}
default_role = "literal"               # `name` in a docstring is code, as in the Markdown pages
autodoc_typehints = "none"
autodoc_inherit_docstrings = False    # tnt.Model's own docstrings, not Keras' (which are not Sphinx markup)
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"tarantella {release}"
html_static_path = []
html_show_sourcelink = False
pygments_style = "friendly"
smartquotes = False                   # --flags and 'quotes' in generated text stay as typed
