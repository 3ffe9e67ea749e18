"""The public API is typed and documented: every public module has an `__all__` of names it has,
listing what `import tarantella as tnt` exports; every public function, class and method has type
hints that resolve, and a Google-style docstring with `Args:`, `Returns:` and `Raises:` where it takes
arguments, returns a value or raises (these docstrings make docs/reference/api.md).

The checks read values (signatures, resolved hints, docstring sections, the exceptions a body
raises), and the last tests feed them broken examples to show that they notice."""

import ast
import builtins
import importlib
import inspect
import re
import textwrap
import types
import typing

import keras
import pytest

import tarantella as tnt
from conftest import REPO

# The modules whose names users reach through `import tarantella as tnt`.
PUBLIC_MODULES = [
    "tarantella", "tarantella.rank", "tarantella.runtime.world", "tarantella.runtime.errors", "tarantella.model",
    "tarantella.model.wrapper", "tarantella.collectives", "tarantella.data", "tarantella.data.pipelines",
    "tarantella.models", "tarantella.optimizers", "tarantella.callbacks",
]
# tnt.X for each of these X is the module: its `__all__` is what it publishes.
NAMESPACES = {"data": "tarantella.data", "models": "tarantella.models", "optimizers": "tarantella.optimizers",
              "keras.callbacks": "tarantella.callbacks"}
# Modules all of whose public functions and classes are the user's, except the ones named here,
# which the package's other modules use. (world.py and data/pipelines.py mix the two; their
# `__all__` says which are published.)
WHOLLY_PUBLIC = ["tarantella.rank", "tarantella.runtime.errors", "tarantella.model.wrapper", "tarantella.collectives",
                 "tarantella.models", "tarantella.optimizers", "tarantella.callbacks"]
PACKAGE_INTERNAL = {
    "tarantella.runtime.errors": {"remember", "first_failure", "collective_failure_behind", "with_call"},
    "tarantella.callbacks": {"for_this_rank"},
}
# Methods of tnt.Model that users call although they override keras.Model's: documented here. Other
# overrides of a Keras base class's methods (build, call, train_step, a callback's hooks, ...) are
# Keras' to document; they need type hints only.
USER_METHODS = {"compile", "fit", "evaluate", "predict", "save", "save_weights", "load_weights", "summary",
                "get_config", "from_config", "set_weights", "train_on_batch", "test_on_batch", "predict_on_batch"}
# Attributes Keras reads from a callback although keras.callbacks.Callback defines none: Keras' too.
KERAS_READS = {"async_safe"}
SECTION = re.compile(r"(Args|Arguments|Returns|Yields|Raises|Attributes|Examples?|Notes?):\s*")
ENTRY = re.compile(r" {4}(\*{0,2}[\w.]+)(?: \([^)]*\))?:")


# -- the checks ---------------------------------------------------------------------------------


def sections(doc):
    """{section name: its lines} of a Google-style docstring."""
    found, current = {}, None
    for line in inspect.cleandoc(doc or "").splitlines():
        match = SECTION.fullmatch(line)
        if match:
            current = match.group(1)
            found[current] = []
        elif current and line and not line.startswith(" "):
            current = None
        elif current:
            found[current].append(line)
    return found


def entries(lines):
    """The names a section documents: `name:`, `*args:`, `**kwargs:` (stars dropped), `package.Error:`
    (as `Error`)."""
    return [match.group(1).lstrip("*").rpartition(".")[2] for match in map(ENTRY.match, lines) if match]


def raised_exceptions(function):
    """The exception classes `function`'s own body raises by name (not those of functions it calls)."""
    function = inspect.unwrap(function)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = set()

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue  # a nested function raises when it is called, not here
            if isinstance(child, ast.Raise) and child.exc is not None:
                target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
                value = function.__globals__.get(name, getattr(builtins, name, None))
                if isinstance(value, type) and issubclass(value, BaseException):
                    names.add(name)
            walk(child)

    walk(tree.body[0])
    return names


def function_problems(function, name, *, method=False, documented=True, keras_params=(), docs=None,
                      constructor=False, is_property=False):
    """What `function` lacks: type hints (which must resolve) on its parameters and return, and, if
    `documented`, a docstring with Args (naming every parameter but those `keras_params` that Keras
    documents), Returns where it returns a value and Raises naming what its body raises. `docs` are
    the docstrings to read instead of its own (a class's and its constructor's)."""
    problems = []
    function = inspect.unwrap(function)
    parameters = list(inspect.signature(function).parameters.values())[1 if method else 0:]
    for parameter in parameters:
        if parameter.annotation is inspect.Parameter.empty:
            problems.append(f"{name}: parameter {parameter.name!r} has no type hint")
    if inspect.signature(function).return_annotation is inspect.Signature.empty:
        problems.append(f"{name}: no return type hint")
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # a name the hints use is not importable where the function lives
        problems.append(f"{name}: the type hints do not resolve ({type(error).__name__}: {error})")
        hints = {}
    returns_none = hints.get("return", None) is type(None)
    if constructor and "return" in hints and not returns_none:
        problems.append(f"{name}: a constructor returns None")
    if not documented:
        return problems
    docs = [function.__doc__] if docs is None else docs
    if not any(doc and doc.strip() for doc in docs):
        return problems + [f"{name}: no docstring"]
    found = {}
    for doc in docs:
        for section, lines in sections(doc).items():
            found.setdefault("Args" if section == "Arguments" else section, []).extend(lines)
    names = [p.name for p in parameters]
    if parameters and "Args" not in found:
        problems.append(f"{name}: takes {', '.join(names)} but its docstring has no Args section")
    elif parameters:
        listed = entries(found["Args"])
        problems += [f"{name}: Args does not document {n!r}" for n in names if n not in listed and n not in keras_params]
        problems += [f"{name}: Args documents {n!r}, which it does not take" for n in listed if n not in names]
    if not (constructor or is_property or returns_none) and not any(found.get(s) for s in ("Returns", "Yields")):
        problems.append(f"{name}: returns a value but its docstring has no Returns section")
    raised = raised_exceptions(function)
    listed = entries(found.get("Raises", []))
    problems += [f"{name}: raises {e} but Raises does not name it" for e in sorted(raised) if e not in listed]
    return problems


def foreign_bases(cls):
    return [base for base in cls.__mro__[1:] if base is not object and not base.__module__.startswith("tarantella")]


def class_problems(cls, name):
    """What a public class lacks: a docstring; its constructor typed, with its arguments in the
    class's docstring; each public method and property typed and (unless it only overrides a Keras
    base class's hook) documented."""
    problems = [] if cls.__doc__ and cls.__doc__.strip() else [f"{name}: no docstring"]
    if "__init__" in vars(cls):
        init = vars(cls)["__init__"]
        problems += function_problems(init, f"{name}.__init__", method=True, constructor=True,
                                      docs=[cls.__doc__, init.__doc__])
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("tarantella"):
            continue
        for member, value in vars(klass).items():
            if member.startswith("_") or member in seen:
                continue
            seen.add(member)
            foreign = [base for base in foreign_bases(cls) if hasattr(base, member)]
            documented = member in USER_METHODS or not (foreign or member in KERAS_READS)
            keras_params = ()
            if foreign and callable(getattr(foreign[0], member)):
                keras_params = tuple(inspect.signature(getattr(foreign[0], member)).parameters)
            qualified = f"{name}.{member}"
            if isinstance(value, property):
                problems += function_problems(value.fget, qualified, method=True, documented=documented,
                                              is_property=True)
            elif isinstance(value, (classmethod, staticmethod)):
                problems += function_problems(value.__func__, qualified, method=isinstance(value, classmethod),
                                              documented=documented, keras_params=keras_params)
            elif inspect.isfunction(value):
                problems += function_problems(value, qualified, method=True, documented=documented,
                                              keras_params=keras_params)
    return problems


def all_problems(module, exported=(), internal=None):
    """What a module's `__all__` gets wrong: missing, a name the module lacks, a name listed twice, an
    `exported` name left out, or (given `internal`) a public function or class of the module itself
    that is neither listed nor `internal`."""
    names = getattr(module, "__all__", None)
    if names is None:
        return [f"{module.__name__} has no __all__"]
    problems = [f"{module.__name__}.__all__ lists {n!r}, which the module lacks" for n in names
                if not hasattr(module, n)]
    problems += [f"{module.__name__}.__all__ lists {n!r} twice" for n in set(names) if names.count(n) > 1]
    problems += [f"{module.__name__}.__all__ misses {n!r}, which it exports" for n in sorted(exported)
                 if n not in names]
    if internal is not None:
        for n, value in vars(module).items():
            own = (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == module.__name__
            if own and not n.startswith("_") and n not in names and n not in internal:
                problems.append(f"{module.__name__}.{n} is public but not in __all__")
    return problems


def api_problems(objects):
    problems = []
    for name, value in objects:
        problems += class_problems(value, name) if inspect.isclass(value) else function_problems(value, name)
    return problems


def public_objects():
    """(qualified name, object) of every function and class in a public module's __all__, once each."""
    seen, found = set(), []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if (inspect.isclass(value) or inspect.isfunction(inspect.unwrap(value))) and id(value) not in seen:
                seen.add(id(value))
                found.append((f"{module_name}.{name}", value))
    return found


def exported_by(module):
    """The public functions and classes that a package (tarantella, tarantella.data, ...) takes from
    its modules and offers as its own; none for a plain module."""
    if not hasattr(module, "__path__"):
        return set()
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(inspect.unwrap(value)))
            and (getattr(value, "__module__", None) or "").startswith(module.__name__ + ".")}


# -- the package ----------------------------------------------------------------------------------


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_module_has_an_all_of_names_it_has(module_name):
    module = importlib.import_module(module_name)
    internal = None if module_name not in WHOLLY_PUBLIC else PACKAGE_INTERNAL.get(module_name, set())
    assert all_problems(module, exported_by(module), internal) == []


def test_the_package_lists_what_it_exports_and_its_modules_list_it_too():
    exported = exported_by(tnt)
    assert {"Model", "init", "allreduce", "CollectiveError", "TensorAllgatherer", "is_master_rank"} <= exported
    assert all_problems(tnt, exported) == []
    assert "__version__" in tnt.__all__
    for name in exported:  # the module that defines it publishes it as well
        home = importlib.import_module(getattr(tnt, name).__module__)
        assert home.__name__ in PUBLIC_MODULES and name in home.__all__, (name, home.__name__)
    # The namespaces are no names of a star import (they would hide the user's own keras or data).
    for namespace in NAMESPACES:
        assert namespace.split(".")[0] not in tnt.__all__
    star = {}
    exec("from tarantella import *", star)
    assert set(star) - {"__builtins__"} == set(tnt.__all__)


@pytest.mark.parametrize("attribute, module_name", sorted(NAMESPACES.items()))
def test_each_namespace_is_its_module_and_publishes_what_it_offers(attribute, module_name):
    namespace = tnt
    for part in attribute.split("."):
        namespace = getattr(namespace, part)
    module = importlib.import_module(module_name)
    assert namespace is module
    assert module.__all__ and all_problems(module, exported_by(module)) == []
    for name in module.__all__:  # published where it is defined too
        home = importlib.import_module(getattr(module, name).__module__)
        assert name in getattr(home, "__all__", ()), (module_name, name, home.__name__)


def test_every_public_function_class_and_method_is_typed_and_documented():
    objects = public_objects()
    names = {name for name, _ in objects}
    assert {"tarantella.Model", "tarantella.allreduce", "tarantella.models.load_model",
            "tarantella.optimizers.Optimizer", "tarantella.callbacks.Callback", "tarantella.init",
            "tarantella.get_rank", "tarantella.data.distribute"} <= names
    assert api_problems(objects) == []


def test_the_api_reference_shows_only_checked_and_documented_members():
    """docs/reference/api.md names functions, classes and members; each is checked above."""
    text = (REPO / "docs" / "reference" / "api.md").read_text()
    checked = {id(value) for _, value in public_objects()}
    directives = re.findall(r"^\.\. auto(function|class|exception|module):: ([\w.]+)(?:\(.*\))?\n"
                            r"((?:   :\w[\w-]*:.*\n)*)", text, flags=re.M)
    assert len(directives) > 20
    for kind, target, options in directives:
        module_name, _, name = target.rpartition(".")
        value = importlib.import_module(target) if kind == "module" else getattr(
            importlib.import_module(module_name), name)
        if kind != "module":
            assert id(value) in checked, f"{target} is in the API reference but no public module's __all__"
        members = re.search(r":members:(.*)", options)
        for member in (members.group(1).split(",") if members and members.group(1).strip() else []):
            member = member.strip()
            if kind == "module":
                assert member in value.__all__, (target, member)
                continue
            assert hasattr(value, member), (target, member)
            foreign = any(hasattr(base, member) for base in foreign_bases(value)) or member in KERAS_READS
            assert member in USER_METHODS or not foreign, f"{target}.{member} is shown but only type-checked"


# -- the checks notice what is missing ---------------------------------------------------------------


def made_up_collective(values, root=0):
    if root < 0:
        raise ValueError("no rank")
    return values


def half_documented(values: list[int], root: int = 0) -> list[int]:
    """Sends `values` from `root`."""
    if root < 0:
        raise ValueError("no rank")
    return values


def well_documented(values: list[int], root: int = 0, **kwargs: str) -> list[int]:
    """Sends `values` from `root`.

    Args:
        values: what is sent.
        root: the rank that sends.
        **kwargs: more.

    Returns:
        The root's values.

    Raises:
        ValueError: `root` is negative.
    """
    if root < 0:
        raise ValueError("no rank")
    return values


def test_the_checks_report_an_undocumented_untyped_function():
    problems = function_problems(made_up_collective, "made_up_collective")
    assert problems == ["made_up_collective: parameter 'values' has no type hint",
                        "made_up_collective: parameter 'root' has no type hint",
                        "made_up_collective: no return type hint",
                        "made_up_collective: no docstring"]
    assert api_problems([("made_up_collective", made_up_collective)]) == problems


def test_the_checks_report_missing_sections_and_parameters():
    assert function_problems(half_documented, "half") == [
        "half: takes values, root but its docstring has no Args section",
        "half: returns a value but its docstring has no Returns section",
        "half: raises ValueError but Raises does not name it"]
    assert function_problems(well_documented, "well") == []

    def stale(values: int) -> None:
        """Sends `values`.

        Args:
            values: what is sent.
            root: a parameter it no longer has.
        """

    assert function_problems(stale, "stale") == ["stale: Args documents 'root', which it does not take"]

    def unresolvable(values: int) -> None:
        """Sends `values`.

        Args:
            values: what is sent.
        """

    unresolvable.__annotations__["values"] = "NoSuchType"  # a name nowhere to be imported

    assert function_problems(unresolvable, "unresolvable")[0].startswith("unresolvable: the type hints do not resolve")


def test_the_checks_report_a_class_with_an_untyped_method_and_an_undocumented_constructor():
    class Sender:
        """Sends values."""

        def __init__(self, root: int) -> None:
            self.root = root

        def send(self, values):
            """Sends `values`."""
            return values

        @property
        def rank(self):
            return self.root

    Sender.__module__ = "tarantella.made_up"  # checked as one of the package's classes
    assert class_problems(Sender, "Sender") == [
        "Sender.__init__: takes root but its docstring has no Args section",
        "Sender.send: parameter 'values' has no type hint",
        "Sender.send: no return type hint",
        "Sender.send: takes values but its docstring has no Args section",
        "Sender.send: returns a value but its docstring has no Returns section",
        "Sender.rank: no return type hint",
        "Sender.rank: no docstring"]

    class Hook(keras.callbacks.Callback):
        """A callback: its hooks are Keras', typed but not documented here."""

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            pass

        def on_train_end(self, logs=None):
            pass

    Hook.__module__ = "tarantella.made_up"  # checked as one of the package's classes
    assert class_problems(Hook, "Hook") == ["Hook.on_train_end: parameter 'logs' has no type hint",
                                            "Hook.on_train_end: no return type hint"]


def test_the_checks_report_a_wrong_all():
    module = types.ModuleType("tarantella.made_up")
    module.__all__ = ["send", "gone", "send"]
    module.send = well_documented
    module.kept = made_up_collective
    assert all_problems(module, exported={"send", "kept"}) == [
        "tarantella.made_up.__all__ lists 'gone', which the module lacks",
        "tarantella.made_up.__all__ lists 'send' twice",
        "tarantella.made_up.__all__ misses 'kept', which it exports"]
    del module.__all__
    assert all_problems(module) == ["tarantella.made_up has no __all__"]
