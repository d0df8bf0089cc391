"""Every rule a divergence names has an entry in kvtrace.rules, the same as in
docs/reference/checks.md, and ``kvtrace explain RULE`` prints it."""

from __future__ import annotations

import ast
import copy
import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvtrace.diff import diff_files
from kvtrace.engine import FAULT_WORKLOADS, record_embedded
from kvtrace.replay import replay_file
from kvtrace.rules import RULES, closest, lookup, rule_id

from tests._paths import REPO

ROOT = REPO
TRACES = ROOT / "traces"
CHECKS = ROOT / "docs" / "reference" / "checks.md"


# --------------------------------------------------------------------------- ids


def test_the_id_is_what_comes_before_the_first_colon_or_space():
    assert rule_id("1.3: admission sets num_computed_tokens = local + external hit") == "1.3"
    assert rule_id("2.1/2.2: chunk = min(remaining, threshold, token budget)") == "2.1/2.2"
    assert rule_id("S:1170 an admission must leave a token to compute") == "S:1170"
    assert rule_id("kv-content: every slot ...") == "kv-content"
    assert rule_id("I6") == "I6"


def test_lookup_takes_any_case_combined_ids_and_whole_rule_strings():
    assert lookup("i1") is RULES["I1"] and lookup("KV-Content") is RULES["kv-content"]
    assert lookup("s:1170") is RULES["S:1170"]
    assert lookup("4.5/4.7") is RULES["4.5/4.7"] and lookup("4.7/4.5") is RULES["4.5/4.7"]
    assert lookup("4.7") is RULES["4.5/4.7"]        # a part no other entry has
    assert lookup("2.2") is RULES["2.2"]            # its own entry before 2.1/2.2's
    assert lookup("1.3: admission sets ...") is RULES["1.3"]
    assert lookup("I99") is None and lookup("") is None
    assert closest("legacy")[:1] == ["L1"] and "I9" in closest("I99")


# --------------------------------------------------------------------------- what kvtrace emits


def _records(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in gzip.decompress(path.read_bytes()).splitlines()]


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> list[tuple[str, str]]:
    """(where, rule) of every divergence that replay and diff report on the
    traces under traces/, on the embedded engine's recordings with each fault
    put back, on those against clean runs, and on a broken handoff."""
    d = tmp_path_factory.mktemp("explain")
    found = []
    for path in sorted(TRACES.rglob("*.jsonl.gz")):
        found += [(path.name, x.rule) for x in replay_file(path, device=None).divergences]
    for fault, workload in FAULT_WORKLOADS.items():
        bad = record_embedded(d / f"{fault}.jsonl", workload=workload, fault=fault).path
        clean = record_embedded(d / f"{workload}.jsonl", workload=workload).path
        found += [(fault, x.rule) for x in replay_file(bad, device="cpu", worker=0).divergences]
        found += [(f"diff {fault}", x.rule) for x in diff_files(clean, bad).divergences]
    found += [("diff configs", x.rule) for x in diff_files(d / "offload.jsonl",
                                                           d / "kv-pressure.jsonl").divergences]
    decode = _records(TRACES / "disagg" / "decode.jsonl.gz")
    arrival = copy.deepcopy(next(o for o in decode if o.get("kind") == "arrival"))
    arrival["kv_transfer_params"]["remote_block_ids"] = [[7, 8, 9]]
    decode = [arrival if o.get("kind") == "arrival" and o["req"] == arrival["req"] else o
              for o in decode]
    broken = d / "decode.jsonl"
    broken.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in decode))
    found += [("handoff", x.rule)
              for x in diff_files(TRACES / "disagg" / "prefill.jsonl.gz", broken).divergences]
    return found


def test_every_divergence_names_a_known_rule(emitted):
    unknown = sorted({(where, rule) for where, rule in emitted if rule_id(rule) not in RULES})
    assert unknown == []


def test_the_runs_reach_many_rules_of_every_family(emitted):
    ids = {rule_id(rule) for _, rule in emitted}
    assert len(ids) >= 25, sorted(ids)
    assert {"1.3", "I9", "L2", "L5", "kv-content", "liveness", "D1", "diff", "handoff"} <= ids


# --------------------------------------------------------------------------- what the code can emit
#
# A rule string is the ``rule`` argument of Divergence or SchedulerAssertion,
# or of a helper that hands its ``rule`` parameter to one of them as it is
# (the ``d(...)`` of the checks), or such a parameter's default. Each is
# resolved to the literal texts it can be: through f-strings (their text, a
# field as "{}"), ``a + b`` (a), ``x if c else y``, local names (assignments,
# and ``for ... in zip(...)`` over constant tuples), the module's constants
# and those it imports, and what the module's functions return. A parameter
# passed on, or a rule read from another divergence (``d.rule``), is checked
# where it was made.

KVTRACE = ROOT / "kvtrace"
_FORWARDED = object()
_MAKERS = {"Divergence": 5, "SchedulerAssertion": 1}
_DEF = (ast.FunctionDef, ast.AsyncFunctionDef)


class _Module:
    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.parents = {c: p for p in ast.walk(self.tree) for c in ast.iter_child_nodes(p)}
        self.consts = {t.id: n.value for n in self.tree.body if isinstance(n, ast.Assign)
                       for t in n.targets if isinstance(t, ast.Name)}
        self.imports = {a.asname or a.name: (n.module or "", n.level, a.name)
                        for n in self.tree.body if isinstance(n, ast.ImportFrom) for a in n.names}

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(ROOT)}:{node.lineno}"

    def enclosing(self, node: ast.AST):
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, _DEF):
                return node
        return None

    def function(self, name: str, scope):
        """The function ``name`` means in ``scope``: nested, else the module's."""
        while True:
            body = scope.body if scope is not None else self.tree.body
            fn = next((n for n in body if isinstance(n, _DEF) and n.name == name), None)
            if fn is not None or scope is None:
                return fn
            scope = self.enclosing(scope)


_MODULES = {p: _Module(p) for p in sorted(KVTRACE.rglob("*.py"))}


def _params(fn) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def _rule_arg(call: ast.Call, pos: int) -> ast.AST | None:
    arg = next((k.value for k in call.keywords if k.arg == "rule"), None)
    if arg is None and len(call.args) > pos and not any(
            isinstance(a, ast.Starred) for a in call.args[:pos + 1]):
        arg = call.args[pos]
    return arg


def _is_helper(fn) -> bool:
    """Whether ``fn`` hands its ``rule`` parameter as it is to a maker."""
    return "rule" in _params(fn) and any(
        isinstance(c, ast.Call) and getattr(c.func, "id", None) in _MAKERS
        and isinstance(a := _rule_arg(c, _MAKERS[c.func.id]), ast.Name) and a.id == "rule"
        for c in ast.walk(fn))


_METHODS = {fn.name: fn for m in _MODULES.values() for c in ast.walk(m.tree)
            if isinstance(c, ast.ClassDef) for fn in c.body if isinstance(fn, _DEF)}


def _rule_position(m: _Module, call: ast.Call) -> int | None:
    """Where ``call`` passes a rule: a maker's, or a helper's, position."""
    f = call.func
    if isinstance(f, ast.Name) and f.id in _MAKERS:
        return _MAKERS[f.id]
    if isinstance(f, ast.Name):
        fn, skip = m.function(f.id, m.enclosing(call)) or _passed(m, call), 0
    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
        fn, skip = _METHODS.get(f.attr), 1
    else:
        return None
    return _params(fn).index("rule") - skip if fn is not None and _is_helper(fn) else None


def _passed(m: _Module, call: ast.Call):
    """The function a parameter called at ``call`` is: the one the module's
    calls of the enclosing function pass it (the checks' ``d``, handed on)."""
    scope = m.enclosing(call)
    if scope is None or call.func.id not in _params(scope):
        return None
    k = _params(scope).index(call.func.id)
    passed = {m.function(c.args[k].id, m.enclosing(c)) for c in ast.walk(m.tree)
              if isinstance(c, ast.Call) and getattr(c.func, "id", None) == scope.name
              and len(c.args) > k and isinstance(c.args[k], ast.Name)}
    # Several callers may each pass their own maker: one whose rule comes at
    # the same place in every one stands for them all.
    places = {_params(fn).index("rule") if fn is not None and "rule" in _params(fn) else None
              for fn in passed}
    return passed.pop() if passed and len(places) == 1 and None not in places else None


def _module_of(m: _Module, name: str) -> _Module | None:
    module, level, _ = m.imports[name]
    base = ROOT if level == 0 else m.path.parents[level - 1]
    target = base.joinpath(*module.split(".")) if module else base
    return _MODULES.get(target.with_suffix(".py")) or _MODULES.get(target / "__init__.py")


def _resolve(m: _Module, node: ast.AST, scope) -> list:
    """The literal texts ``node`` can be, or _FORWARDED; LookupError where
    it cannot tell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _resolve(m, node.left, scope)
    if isinstance(node, ast.IfExp):
        return _resolve(m, node.body, scope) + _resolve(m, node.orelse, scope)
    if isinstance(node, (ast.Tuple, ast.List)):
        return [s for e in node.elts for s in _resolve(m, e, scope)]
    if isinstance(node, ast.Attribute) and node.attr == "rule":
        return [_FORWARDED]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and (fn := m.function(node.func.id, None)) is not None:
        return [s for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None
                for s in _resolve(m, r.value, fn)]
    if isinstance(node, ast.Name):
        return _resolve_name(m, node.id, scope)
    raise LookupError(f"{m.where(node)}: cannot tell what rule {ast.unparse(node)} is")


def _resolve_name(m: _Module, name: str, scope) -> list:
    while scope is not None:
        if name in _params(scope) + [a.arg for a in scope.args.kwonlyargs]:
            return [_FORWARDED]
        found = []
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                 for t in n.targets):
                found += _resolve(m, n.value, scope)
            elif isinstance(n, ast.For) and isinstance(n.target, ast.Tuple) \
                    and isinstance(n.iter, ast.Call) and getattr(n.iter.func, "id", "") == "zip":
                names = [getattr(t, "id", None) for t in n.target.elts]
                if name in names:
                    found += _resolve(m, n.iter.args[names.index(name)], scope)
        if found:
            return found
        scope = m.enclosing(scope)
    if name in m.consts:
        return _resolve(m, m.consts[name], None)
    if name in m.imports and (other := _module_of(m, name)) is not None:
        return _resolve_name(other, m.imports[name][2], None)
    raise LookupError(f"{m.path.relative_to(ROOT)}: cannot tell what rule {name} is")


def _rule_strings() -> list[tuple[str, object]]:
    """(where, literal text) of every rule string the code can build."""
    found = []
    for m in _MODULES.values():
        for node in ast.walk(m.tree):
            if isinstance(node, _DEF) and _is_helper(node):   # the default, if any
                names, defaults = _params(node), node.args.defaults
                at = names.index("rule") - (len(names) - len(defaults))
                if at >= 0:
                    found += [(m.where(node), s) for s in _resolve(m, defaults[at], node)]
            elif isinstance(node, ast.Call) and (pos := _rule_position(m, node)) is not None:
                arg = _rule_arg(node, pos)
                if arg is not None:
                    found += [(m.where(node), s) for s in _resolve(m, arg, m.enclosing(node))]
    return found


def test_every_rule_the_code_can_build_starts_with_a_known_id():
    built = [(where, s) for where, s in _rule_strings() if s is not _FORWARDED]
    unknown = [(where, s) for where, s in built if rule_id(s) not in RULES]
    assert unknown == []
    assert len(built) >= 60   # the scan finds the checks' rules
    assert {rule_id(s) for _, s in built} == set(RULES)   # and RULES lists none that is gone


# A string shaped like a rule ("I12: ...", "S:1234 ...") anywhere in kvtrace.
RULE_LIKE = re.compile(r"^(?:(?:\d+(?:\.\d+)*(?:/\d+\.\d+)?|[A-Z]{1,2}\d+)(?=: )"   # "1.3: ", "I12: "
                       r"|[A-Z]{1,3}:\d+(?= ))")                            # "S:1234 "


def test_no_string_in_kvtrace_is_shaped_like_an_unknown_rule():
    odd = []
    for m in _MODULES.values():
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant):
                text = node.values[0].value
            else:
                continue
            match = RULE_LIKE.match(text)
            if match and match[0] not in RULES:
                odd.append((m.where(node), text[:60]))
    assert odd == []


# --------------------------------------------------------------------------- the docs


def _rule_ids_section() -> str:
    return CHECKS.read_text().split("\n## Rule ids\n", 1)[1].split("\n## ", 1)[0]


def _plain(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_checks_md_lists_exactly_the_rules_with_the_same_text():
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", _rule_ids_section(), re.M)
    assert [i for i, _ in rows] == list(RULES)
    assert {i: _plain(t) for i, t in rows} == {i: r.text for i, r in RULES.items()}


def test_checks_md_gives_each_rule_its_behaviour_and_example():
    entries = re.split(r"^- \*\*`([^`]+)`\*\* ", _rule_ids_section(), flags=re.M)[1:]
    by_id = dict(zip(entries[::2], map(_plain, entries[1::2])))
    assert list(by_id) == list(RULES)
    for i, r in RULES.items():
        assert by_id[i] == f"vLLM: {r.behaviour} Example: {r.example}", i


def test_each_rule_points_to_a_section_of_checks_md():
    headings = set(re.findall(r"^## (.+)$", CHECKS.read_text(), re.M))
    assert {r.see for r in RULES.values() if r.see} <= headings


# --------------------------------------------------------------------------- the command


def _kvtrace(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


def test_explain_prints_the_entry_within_80_columns():
    out = _kvtrace("explain", "1.3")
    assert out.returncode == 0 and out.stderr == ""
    r = RULES["1.3"]
    text = " ".join(out.stdout.split())
    assert text.startswith(f"1.3 {r.text}")
    assert r.behaviour in text and r.example in text and "docs/reference/checks.md" in text
    assert max(map(len, out.stdout.splitlines())) <= 80


def test_explain_takes_an_id_in_any_case_and_a_part_of_a_combined_one():
    assert _kvtrace("explain", "kv-CONTENT").stdout.startswith("kv-content  ")
    assert _kvtrace("explain", "4.7").stdout.startswith("4.5/4.7  ")


def test_an_unknown_id_is_one_line_naming_it_and_the_closest_exit_2():
    out = _kvtrace("explain", "I99")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    assert "I99" in out.stderr and "I9" in out.stderr.split("I99", 1)[1]


def test_explain_alone_lists_every_id_with_its_text():
    out = _kvtrace("explain")
    assert out.returncode == 0
    starts = [line.split()[0] for line in out.stdout.splitlines() if line[:1].strip()]
    assert [s for s in starts if s in RULES] == list(RULES)
    assert max(map(len, out.stdout.splitlines())) <= 80
    text = " ".join(out.stdout.split())
    assert all(f"{i} {r.text}" in text for i, r in RULES.items())


def test_explain_loads_neither_torch_nor_vllm():
    code = ("import sys; from kvtrace.cli import run; rc = run(['explain', 'I1']); "
            "print(rc, sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines()[-1] == "0 []"


# --------------------------------------------------------------------------- words a reader knows

# The rule entries a reader outside this project cannot follow: a section of a
# document kvtrace does not ship ("semantics 5.1", "(4.3, 4.6)"), a bug's
# private class ("bug class e").
JARGON = re.compile(r"semantics \d|semantics doc|bug class|§|\((?:\d\.\d+(?:, )?)+\)"
                    r"|recompute-the-last-token rule")


@pytest.mark.parametrize("rid", list(RULES))
def test_explain_says_what_a_rule_means_without_private_jargon(rid):
    from kvtrace.commands.explain import entry

    assert JARGON.findall(" ".join(entry(RULES[rid], 80).split())) == []


def test_the_jargon_pattern_sees_what_it_is_for():
    said = ["(semantics 5.1, I1)", "bug class e", "(4.3, 4.6)", "semantics §7.1"]
    assert all(JARGON.search(s) for s in said)
    assert not JARGON.search("S:1045-1047 (LMCache #1969, PR #2007), 0.33, rule 2.2")


def test_explain_names_the_file_of_each_citation_and_what_each_letter_stands_for():
    from kvtrace.commands.explain import entry
    from kvtrace.rules import FILES

    for r in RULES.values():
        text = entry(r, 80)
        cited = set(re.findall(r"\b([A-Z]{1,2}):\d", f"{r.id} {r.text} {r.behaviour} {r.example}"))
        assert cited <= set(FILES), r.id
        for k in cited:
            assert re.search(rf"^  {k} +{re.escape(FILES[k])}$", text, re.M), (r.id, k)
    text = entry(RULES["1.3"], 80)
    letters = text.split("\nLetters\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in letters.splitlines()] == ["L", "E", "T"]
    assert "Letters" not in entry(RULES["4.5"], 80)
