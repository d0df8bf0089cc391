"""The import rules that keep data flowing one way (record -> trace -> replay
or diff -> report): every import of every module is read, those inside
functions included, and checked against the rules below."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests._paths import REPO

ROOT = REPO / "kvtrace"

# package -> the kvtrace packages and modules it may import (its own always).
RULES = {
    "trace": set(),                     # the format: nothing else from kvtrace
    "reference": set(),                 # the reference scheduler: nothing else
    "workers": {"trace"},               # child processes replay and diff share
    # capture: what runs inside a user's vLLM; it writes traces and reads nothing
    # else (compiled: whether the compiled path, and its KV digest kernel, runs)
    "record": {"trace", "workers", "compiled"},
    # the embedded engine: a source that runs the reference's scheduler
    "engine": {"trace", "reference", "bridge", "catalog"},
    # replay through vLLM's own scheduler: it records that scheduler as capture does
    "rerun": {"trace", "record", "results", "baseline", "_text"},
    # the lab: drivers, workloads, models and faults for commands, tests and benches
    "lab": {"trace", "record", "rerun", "diff", "catalog", "workers", "baseline", "_text"},
    # checkers: read traces, never a source's internals
    "replay": {"trace", "reference", "bridge", "baseline", "findings", "results", "writing",
               "workers", "snapshot", "_text"},
    "diff": {"trace", "findings", "results", "workers", "_text"},     # no replay internals
    # renders what it is given (results: the typed results of replay and diff);
    # rules: the catalogue of rule ids, which imports nothing
    "report": {"trace", "findings", "results", "rules", "writing", "_text"},
    # the flight recorder: keyframes as a trace is written, segments, their replay
    "flight": {"trace", "record", "replay", "reference", "bridge", "results", "findings"},
    # replay of many: one item (a trace, a segment directory), items as Ray tasks
    "fleet": {"trace", "replay", "flight", "results", "_text"},
}


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, the kvtrace module named) for each import in ``path``, a module
    of the package ``root``."""
    pkg = path.relative_to(root.parent).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvtrace")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against the module's package
                base = pkg[:len(pkg) - node.level]
                name = ".".join(base + ((node.module,) if node.module else ()))
                names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
                out += [(node.lineno, n) for n in names]
            elif node.module == "kvtrace":   # from kvtrace import bridge: the module bridge
                out += [(node.lineno, f"kvtrace.{a.name}") for a in node.names
                        if not a.name.startswith("__")]   # __version__ is no module
            elif (node.module or "").startswith("kvtrace"):
                out.append((node.lineno, node.module))
    return out


def _top(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvtrace" else None


@pytest.mark.parametrize("package", sorted(RULES))
def test_each_package_imports_only_what_its_place_allows(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in _imports(path):
            top = _top(name)
            if top is not None and top != package and top not in RULES[package]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert bad == []


def _module(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the kvtrace modules it imports, those inside functions too (a
    name imported from a package is the package's module of that name when
    there is one, else the package)."""
    files = {_module(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        named = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                named += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                          for a in node.names]
        deps = set()
        for imported in named:
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and files[imported].name != "__init__.py":
                deps.add(imported)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each set of modules that import each other, round."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    """No two modules import each other, directly or round a longer circle,
    counting imports inside functions."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_circle(tmp_path):
    pkg = tmp_path / "kvtrace" / "p"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from kvtrace.p.c import h\n")
    (pkg / "c.py").write_text("from kvtrace.p import a\n")
    (pkg / "d.py").write_text("from kvtrace.p import a\n")
    graph = import_graph(tmp_path / "kvtrace")
    assert cycles(graph) == [["kvtrace.p.a", "kvtrace.p.b", "kvtrace.p.c"]]


def test_no_module_imports_another_modules_private_names():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kvtrace")):
                bad += [f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def _module_aliases(tree: ast.AST, path: Path) -> dict[str, str]:
    """Names bound to a kvtrace module by an import in ``tree``: alias -> module."""
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvtrace") and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(pkg[:len(pkg) - node.level] + ((node.module,) if node.module else ()))
                    if node.level else node.module or "")
            if not base.startswith("kvtrace"):
                continue
            for a in node.names:
                name = f"{base}.{a.name}"
                file = ROOT.parent.joinpath(*name.split("."))
                if file.with_suffix(".py").exists() or (file / "__init__.py").exists():
                    out[a.asname or a.name] = name
    return out


def test_no_module_reaches_into_another_modules_private_names():
    """``mod._name`` on another kvtrace module, imported as ``mod``."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = _module_aliases(tree, path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} "
                           f"{aliases[node.value.id]}.{node.attr}")
    assert bad == []


def test_the_rules_see_a_bad_import(tmp_path):
    """The reader of imports finds one inside a function, relative or not."""
    mod = tmp_path / "kvtrace" / "trace" / "probe.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("def f():\n    from ..replay import replay_file\n    import kvtrace.diff\n"
                   "from . import events\n")
    names = [n for _, n in _imports(mod, tmp_path / "kvtrace")]
    assert names == ["kvtrace.trace.events", "kvtrace.replay", "kvtrace.diff"]
    assert [_top(n) for n in names] == ["trace", "replay", "diff"]


def test_every_divergence_kind_made_is_one_the_type_names_and_the_docs_explain():
    """Each kind a module gives a Divergence (a literal argument, or a default
    of the helper that makes them) is one of ``DivergenceKind``, and each of
    those but "diff" has a row in checks.md's table of kinds."""
    from typing import get_args

    from kvtrace.findings import DivergenceKind

    kinds = set(get_args(DivergenceKind))
    made = set()
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Divergence":
                arg = next((kw.value for kw in node.keywords if kw.arg == "kind"),
                           node.args[6] if len(node.args) > 6 else None)
                if isinstance(arg, ast.Constant):
                    made.add((path.name, arg.value))
            elif isinstance(node, ast.FunctionDef) and any(   # a helper's default: kind="counter"
                    getattr(getattr(c, "func", None), "id", None) == "Divergence" for c in ast.walk(node)):
                for a, default in zip(node.args.args[::-1], node.args.defaults[::-1]):
                    if a.arg == "kind" and isinstance(default, ast.Constant):
                        made.add((path.name, default.value))
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_STATE_KINDS"
                                                      for t in node.targets):
                made |= {(path.name, e.value) for e in node.value.elts}
    assert {k for _, k in made} >= {"counter", "block", "invariant", "kv-content", "diff"}
    assert [m for m in sorted(made) if m[1] not in kinds] == []
    table = (ROOT.parent / "docs" / "reference" / "checks.md").read_text()
    assert [k for k in sorted(kinds - {"diff"}) if f"| `{k}` |" not in table] == []
