"""Every complete script shown in the documentation runs (serially), so that none can rot.

The tutorials show the scripts of examples/ through literalinclude, and those are tested by
their own tests. A script written into a page is a code block captioned "(a complete
script)"; this test extracts each and runs it with this Python. Any other Python block that
imports tarantella and uses no name it does not define would run as it stands: such a block
must carry that caption too (or visibly be a fragment), or this test fails.
"""

import ast
import builtins
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [page for page in PAGES if "_build" not in page.parts]
MARK = "(a complete script)"

# ```{code-block} python / ```python blocks, with their options (":caption: ...") if any.
BLOCK = re.compile(r"^```(?:\{code-block\}\s*)?(python|py)\s*\n(?P<body>.*?)^```\s*$", re.M | re.S)


def _blocks():
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text()):
            lines = match.group("body").splitlines()
            options = [line for line in lines if re.match(r"^:[a-z-]+:", line)]
            code = "\n".join(line for line in lines if line not in options).strip("\n") + "\n"
            caption = " ".join(options)
            line = page.read_text()[:match.start()].count("\n") + 1
            yield f"{page.relative_to(ROOT)}:{line}", code, MARK in caption


def _undefined_names(code):
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return used - defined


SCRIPTS = [(where, code) for where, code, marked in _blocks() if marked]


def test_the_documentation_shows_complete_scripts_and_marks_them():
    assert SCRIPTS, f"no code block captioned {MARK!r} in README.md or docs/: the extraction found nothing"
    unmarked = []
    for where, code, marked in _blocks():
        if marked or "import tarantella" not in code:
            continue
        try:
            undefined = _undefined_names(code)
        except SyntaxError:
            continue  # not Python as it stands: a fragment
        if not undefined:
            unmarked.append(where)
    assert not unmarked, (f"these blocks look like complete scripts but are not captioned {MARK!r}, so no "
                          f"test runs them: {unmarked}")


@pytest.mark.parametrize("where, code", SCRIPTS, ids=[where for where, _ in SCRIPTS])
def test_a_complete_script_in_the_documentation_runs(where, code, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(code)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
