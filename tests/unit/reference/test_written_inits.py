"""The reference's dataclasses whose ``__init__`` is written out (compiled, the
one dataclasses generates would run as Python): each must make what the
generated one would, so that the fields stay the one place that says what a
new object holds. Read from the sources, so that the compiled path is held
to it too."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from kvtrace.compiled import source_path

MODULES = ("admission", "cache_stats", "config", "interface", "output", "request", "scheduler",
           "step")


def _written_out() -> list[tuple[type, list[tuple[str, object]]]]:
    """(class, its __init__'s parameters as (name, default or REQUIRED, annotation))."""
    found = []
    for name in MODULES:
        module = f"kvtrace.reference.{name}"
        tree = ast.parse(Path(source_path(module)).read_text())
        m = importlib.import_module(module)
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(m, node.name)
            init = next((f for f in node.body
                         if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None or not dataclasses.is_dataclass(cls):
                continue
            args = init.args.args[1:]
            defaults = [REQUIRED] * (len(args) - len(init.args.defaults)) + [
                ast.literal_eval(d) for d in init.args.defaults]
            found.append((cls, [(a.arg, d, ast.unparse(a.annotation))
                                for a, d in zip(args, defaults)]))
    return found


REQUIRED = object()
WRITTEN = _written_out()


def test_the_written_out_inits_are_found():
    names = {c.__name__ for c, _ in WRITTEN}
    assert {"StepPlan", "ScheduledRequest", "SchedulerOutput", "ModelOutput", "RequestOutput",
            "Skipped", "Stopped", "ConnectorCacheStats"} <= names


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _sample(annotation: str, i: int):
    """A value of the annotated type, distinct for each ``i`` (compiled, the
    reference checks each argument's type); None for a type it does not make."""
    t = annotation.split(" | ")[0]
    for prefix, value in (("list", [i]), ("dict", {f"k{i}": i}), ("set", {i}),
                          ("tuple[int, int]", (i, i)), ("tuple", (f"t{i}",)),
                          ("int", 1000 + i), ("str", f"v{i}")):
        if t.startswith(prefix):
            return value
    return None


def _kept(got, given) -> bool:
    """``got`` is the object given (an int equal to it: compiled, ints are kept unboxed)."""
    return got is given or (type(given) is int and type(got) is int and got == given)


@pytest.mark.parametrize("cls, params", WRITTEN, ids=lambda x: getattr(x, "__name__", ""))
def test_a_written_out_init_makes_what_the_fields_say(cls, params):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = [n for n, _, _ in params]
    assert names == [n for n in fields if n in names]   # fields, in the fields' order
    required = {}
    for name, default, annotation in params:
        f = fields[name]
        if default is REQUIRED:
            assert _default(f) is dataclasses.MISSING, name   # required as a field too
            required[name] = _sample(annotation, len(required))
            assert required[name] is not None, f"{name}: no sample of {annotation}"
        elif f.default_factory is not dataclasses.MISSING:
            assert default is None, name   # None: a fresh one of the factory's
        else:
            assert default == f.default, name
    made, again = cls(**required), cls(**required)
    for name, f in fields.items():
        if name in required:
            assert _kept(getattr(made, name), required[name]), name
            continue
        want = _default(f)
        assert getattr(made, name) == want and type(getattr(made, name)) is type(want), name
        if f.default_factory is not dataclasses.MISSING:   # fresh in every object
            assert getattr(made, name) is not getattr(again, name), name


@pytest.mark.parametrize("cls, params", WRITTEN, ids=lambda x: getattr(x, "__name__", ""))
def test_a_written_out_init_keeps_each_value_it_is_given(cls, params):
    values = {name: _sample(annotation, i) for i, (name, _, annotation) in enumerate(params)}
    values = {name: v for name, v in values.items() if v is not None}
    assert len(values) >= len(params) - 1   # all, or all but one of a type not made here
    made = cls(**values)
    for name, v in values.items():
        assert _kept(getattr(made, name), v), name
