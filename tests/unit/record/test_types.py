"""The recorder's shape: its public interface is typed with vLLM's own
classes, never ``Any`` (nor a parameter left unannotated, which is ``Any``
too), and no function of record/ or replay/ runs to 60 lines.

Public: a module-level function or class whose name has no leading
underscore; of a class, its methods with such names, and the constructor
(``__init__``, ``__call__``) of a public class. The recording scheduler's
methods (hooks.py) count, though their classes are private: they are what
the engine's callers call."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest
from tests._require import require

from tests._paths import REPO

ROOT = REPO / "kvtrace"
# The recorder's public interface: what runs inside a user's vLLM.
INTERFACE = [ROOT / "record" / "vllm" / f"{name}.py"
             for name in ("recorder", "hooks", "header", "kv_audit", "plugin")]
LINES = 60   # no function as long as this


def _names_any(node: ast.AST | None) -> bool:
    """Whether an annotation names ``Any`` (also inside a string)."""
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Name) and n.id == "Any":
            return True
        if isinstance(n, ast.Attribute) and n.attr == "Any":
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                if _names_any(ast.parse(n.value, mode="eval")):
                    return True
            except SyntaxError:
                pass
    return False


def _public(tree: ast.Module):
    """(name, function) of each public function and method (see the module doc)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                yield node.name, node, False
        elif isinstance(node, ast.ClassDef):
            public_class = not node.name.startswith("_")
            for f in node.body:
                if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if not f.name.startswith("_") or (public_class
                                                  and f.name in ("__init__", "__call__")):
                    yield f"{node.name}.{f.name}", f, True


def untyped(source: str) -> list[str]:
    """Each public function's parameter or return that names ``Any`` or has
    no annotation."""
    out = []
    for name, f, method in _public(ast.parse(source)):
        a = f.args
        params = a.posonlyargs + a.args + a.kwonlyargs
        if method and params and params[0].arg in ("self", "cls"):
            params = params[1:]
        params += [p for p in (a.vararg, a.kwarg) if p is not None]
        for p in params:
            if p.annotation is None:
                out.append(f"{name}({p.arg}): no annotation")
            elif _names_any(p.annotation):
                out.append(f"{name}({p.arg}): Any")
        if f.returns is None and f.name != "__init__":
            out.append(f"{name}: no return annotation")
        elif _names_any(f.returns):
            out.append(f"{name}: returns Any")
    return out


def long_functions(source: str, path: str = "<module>") -> list[str]:
    """Every function (methods and nested ones included) of ``LINES`` lines or more."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = n.end_lineno - n.lineno + 1
            if length >= LINES:
                out.append(f"{path}:{n.lineno} {n.name}: {length} lines")
    return out


@pytest.mark.parametrize("path", INTERFACE, ids=lambda p: p.stem)
def test_the_recorders_public_interface_names_no_any(path):
    assert untyped(path.read_text()) == []


@pytest.mark.vllm
@pytest.mark.parametrize("path", INTERFACE, ids=lambda p: p.stem)
def test_the_recorders_annotations_name_classes_the_installed_vllm_has(path):
    """The names imported for type checking only (``if TYPE_CHECKING:``) are
    imported here, and every annotation of the module's functions and of its
    classes' methods is evaluated with them."""
    require("vllm", "vLLM is not installed: the annotations name its classes")
    module = importlib.import_module(f"kvtrace.record.vllm.{path.stem}")
    names = dict(vars(module))
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            exec(compile(ast.Module(body=node.body, type_ignores=[]), str(path), "exec"), names)
    functions = []
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            functions.append(obj)
        elif inspect.isclass(obj):
            functions += [f for f in vars(obj).values() if inspect.isfunction(f)]
    assert functions
    for f in functions:
        typing.get_type_hints(f, globalns=names)   # raises on a name that is not there


def test_the_check_sees_any_and_a_missing_annotation():
    source = '''
from typing import Any
import typing
def f(x: Any) -> None: ...
def g(x: "dict[str, Any]", *args, **kwargs: int) -> int: ...
def h(x: int) -> typing.Any: ...
def i(x: int): ...
def _private(x: Any) -> Any: ...
class C:
    def __init__(self, sched: Any): ...
    def m(self, y: list[Any]) -> None: ...
    def _p(self, y: Any) -> Any: ...
class _Mixin:
    def __init__(self, z: Any): ...
    def add_request(self, request) -> None: ...
'''
    assert untyped(source) == [
        "f(x): Any", "g(x): Any", "g(args): no annotation", "h: returns Any",
        "i: no return annotation", "C.__init__(sched): Any", "C.m(y): Any",
        "_Mixin.add_request(request): no annotation"]


@pytest.mark.parametrize("package", ["record", "replay", "flight"])
def test_no_function_runs_to_60_lines(package):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += long_functions(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == []


def test_the_length_check_counts_every_line_of_a_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(LINES - 2))
    short = f"def f():\n{body}"            # LINES - 1 lines
    long = f"class C:\n    def m(self):\n    {body.replace(chr(10), chr(10) + '    ')}    return 0\n"
    assert long_functions(short) == []
    assert long_functions(long) == [f"<module>:2 m: {LINES} lines"]
