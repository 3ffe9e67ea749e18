"""The package's layers import one way (docs/architecture.md, "Layers"): every import of a tarantella
module, lazy ones inside functions included, is read from the source and checked against the order
written here, and the import graph has no cycle."""

import ast

import pytest

from conftest import REPO

PACKAGE = REPO / "tarantella"

# Bottom to top. A module may import modules of its own layer and of the layers below it.
LAYERS = [
    ("common", ["tarantella.common"]),
    ("runtime", ["tarantella.runtime"]),
    ("collectives, backends and data", [
        "tarantella.collectives", "tarantella.collective_calls", "tarantella.backends", "tarantella.data",
        "tarantella.optimizers"]),
    ("model", ["tarantella.model", "tarantella.models", "tarantella.callbacks", "tarantella.saving"]),
    ("resilience and observability", ["tarantella.backups", "tarantella.timeline", "tarantella.timeline_report",
                                      "tarantella.timeline_picture", "tarantella.timeline_projection"]),
    # The package and rank.py, which puts the layers together when tarantella is imported.
    ("public API", ["tarantella", "tarantella.rank"]),
]
# The `tarantella` command and its restart supervisor: they run no rank, and use `common` only.
COMMAND = "tarantella.launcher"


def module_name(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules():
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(modules):
    """(importer, imported module) for every import of tarantella in the package, at any depth of
    the code. `from tarantella import __version__` reads metadata, not a module, and is left out."""
    found = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update((name, alias.name) for alias in node.names if alias.name.startswith("tarantella"))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tarantella"):
                for alias in node.names:
                    if node.module == "tarantella" and alias.name == "__version__":
                        continue
                    submodule = f"{node.module}.{alias.name}"
                    found.add((name, submodule if submodule in modules else node.module))
    return found


def layer_of(module):
    if module == COMMAND or module.startswith(COMMAND + "."):
        return "command"
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS (and to docs/architecture.md)"
    return best[0]


def against_the_order(importer, imported):
    mine, theirs = layer_of(importer), layer_of(imported)
    if mine == "command":
        return theirs not in ("command", 0)
    if theirs == "command":
        return True  # the rank runtime never imports the launcher
    return theirs > mine


def test_every_module_belongs_to_a_layer():
    for module in package_modules():
        layer_of(module)


def test_imports_run_from_higher_layers_to_lower_ones_only():
    edges = imports(package_modules())
    upward = sorted(edge for edge in edges if against_the_order(*edge))
    assert not upward, "imports against the order of layers: " + "; ".join(f"{a} -> {b}" for a, b in upward)


def test_the_runtime_imports_no_machine_learning_framework():
    frameworks = ("tensorflow", "keras", "jax", "torch")
    for name, path in package_modules().items():
        if layer_of(name) not in (0, 1) and name != COMMAND and not name.startswith(COMMAND + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in frameworks for n in names), f"{name} imports {names}"


def test_the_import_graph_has_no_cycle():
    modules = package_modules()
    graph = {}
    for importer, imported in imports(modules):
        if importer != imported:
            graph.setdefault(importer, set()).add(imported)
    state = {}

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                cycle = path[path.index(imported):] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_checks_find_an_upward_import_and_a_cycle():
    """The rules above, applied to made-up edges, so that a broken rule cannot pass silently."""
    assert against_the_order("tarantella.runtime.world", "tarantella.model.wrapper")
    assert against_the_order("tarantella.runtime.world", "tarantella.launcher.placement")
    assert against_the_order("tarantella.launcher.job", "tarantella.runtime.world")
    assert not against_the_order("tarantella.model.wrapper", "tarantella.runtime.world")
    assert not against_the_order("tarantella.launcher.restarts", "tarantella.common.backup_files")


def test_only_the_backends_read_which_keras_backend_runs():
    # What differs per backend is a fact or a capability of its Step; backends.step_class() picks it.
    readers = [str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
               if "backend()" in path.read_text() and PACKAGE / "backends" not in path.parents]
    assert readers == []


def test_every_module_opens_with_what_it_holds():
    for name, path in package_modules().items():
        tree = ast.parse(path.read_text())
        docstring = ast.get_docstring(tree)
        assert docstring and path.read_text().lstrip().startswith('"""'), f"{name} does not open with a docstring"


def test_the_distribution_ships_every_subpackage():
    """A wheel (not an editable install) holds the packages pyproject.toml names: every folder of
    the package must be among them, or a user's `pip install tarantella` misses its modules."""
    import setuptools

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    found = (tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"])
    shipped = set(setuptools.find_packages(str(REPO), include=found["include"]))
    folders = {".".join(path.parent.relative_to(REPO).parts) for path in PACKAGE.rglob("__init__.py")}
    assert folders and folders <= shipped, f"not shipped: {sorted(folders - shipped)}"
