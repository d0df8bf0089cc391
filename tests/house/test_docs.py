"""The docs stay true to the code: every rule id a check can name is in the
table of docs/reference/checks.md, the catalog of workloads and faults is the
one the code generates, and the README stays short."""

from __future__ import annotations

import ast
import re

import pytest

from tests._paths import REPO

ROOT = REPO
RULE = re.compile(r"^((?:\d+(?:\.\d+)?(?:/\d+\.\d+)?|I\d+|B\d+|SD\d+|D\d+|DP\d+|L\d+|liveness|kv-content|crash|diff"
                  r"|handoff)(?=: )|(?:S|AS|BP):\d+(?= ))")


def _rule_ids() -> dict[str, str]:
    """Each rule id that a string in the checkers starts with -> where."""
    found = {}
    for pkg in ("replay", "reference", "diff"):
        for path in (ROOT / "kvtrace" / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                elif isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}"
                                   for v in node.values)
                else:
                    continue
                m = RULE.match(text)
                if m:
                    found.setdefault(m.group(1), f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_rule_id_is_in_the_checks_table():
    doc = (ROOT / "docs" / "reference" / "checks.md").read_text()
    table = set(re.findall(r"^\| `([^`]+)` \|", doc.split("## Rule ids", 1)[1].split("\n## ", 1)[0],
                           re.M))
    ids = _rule_ids()
    assert len(ids) >= 20   # the scan finds the checks' rules
    assert {k: v for k, v in ids.items() if k not in table} == {}
    assert table - set(ids) == set()   # and the table lists no rule that is gone


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_docs_links_lead_somewhere():
    bad = []
    for md in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            if not (md.parent / target).exists():
                bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert bad == []


def test_the_catalog_page_is_the_generated_one():
    from kvtrace import catalog

    assert (ROOT / "docs" / "reference" / "catalog.md").read_text() == catalog.markdown()


def test_the_catalog_names_the_embedded_engines_workloads_and_faults():
    from kvtrace import catalog
    from kvtrace.engine.faults import FAULT_WORKLOADS, FAULTS
    from kvtrace.engine.workloads import WORKLOADS

    assert list(catalog.EMBEDDED_WORKLOADS) == list(WORKLOADS)
    assert list(catalog.EMBEDDED_FAULTS) == list(FAULTS)
    assert list(FAULT_WORKLOADS) == list(FAULTS)
    assert set(FAULT_WORKLOADS.values()) <= set(WORKLOADS)


@pytest.mark.vllm
def test_the_catalog_names_the_vllm_workloads_and_faults():
    from kvtrace import catalog
    from kvtrace.lab.fault_schedulers import FAULT_WORKLOADS, FAULTS
    from kvtrace.lab.workloads import WORKLOADS

    assert set(catalog.VLLM_WORKLOADS) == set(WORKLOADS)
    assert set(catalog.VLLM_FAULTS) == set(FAULTS) == set(FAULT_WORKLOADS)
    assert set(FAULT_WORKLOADS.values()) <= set(WORKLOADS)
    assert set(catalog.VLLM_ALIASES.values()) <= set(WORKLOADS)


# --------------------------------------------------------------------------- what replay refuses
#
# The reference's refusals are one list in the code (kvtrace.baseline.REFUSED);
# each page that lists them names the same things, in the same order, as a
# sentence "...: A, B, C." after the words given here.

def _named_after(text: str, words: str) -> list[str]:
    """The comma-separated list that follows ``words`` and a colon, up to the
    sentence's full stop, wrapping undone."""
    flat = " ".join(text.split())
    at = flat.index(words) + len(words)
    listed = re.match(r"[^:]*?: (.*?)\.(?:\s|$)", flat[at:])
    assert listed, f"no list after {words!r}"
    return [n.strip() for n in listed.group(1).split(", ")]


def _bad_input_row(first_cell: str) -> list[str]:
    table = (ROOT / "docs" / "reference" / "bad-input.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith(f"| {first_cell}"))
    return [n.strip() for n in row.split(" | ")[1].split(", ")]


def _refused() -> list[str]:
    from kvtrace.baseline import REFUSED

    return [r.name for r in REFUSED]


@pytest.mark.parametrize("page, words", [
    ("README.md", "**Refused with one line** (exit 2)"),
    ("docs/guide/replay.md", "rather than replayed into false divergences"),
    ("docs/reference/checks.md", "which only the reference refuses"),
])
def test_each_page_lists_what_the_reference_refuses_as_the_code_does(page, words):
    assert _named_after((ROOT / page).read_text(), words) == _refused()


def test_the_bad_input_table_lists_what_the_reference_refuses_as_the_code_does():
    assert _bad_input_row("an engine feature the reference does not model") == _refused()


def test_the_list_reader_sees_a_name_added_or_gone():
    text = "Refused: a, b (c or d), e f. Then more."
    assert _named_after(text, "Refused") == ["a", "b (c or d)", "e f"]
    assert _named_after("x: one, two.", "x") != ["one"]


def test_the_refusals_only_the_reference_makes_come_last_and_name_their_profiles():
    """checks.md says "but for its last two entries"; the profiles named are
    those that model neither sliding-window groups nor async scheduling."""
    from kvtrace.baseline import REFUSED
    from kvtrace.reference.profiles import PROFILES

    by_profile = [r.by_profile for r in REFUSED]
    assert by_profile == sorted(by_profile) and sum(by_profile) == 2
    lacking = [p.name for p in PROFILES.values()
               if not p.hybrid_kv_modelled or not p.async_scheduling_modelled]
    assert lacking == ["legacy", "0.19"]
    assert next(r.name for r in REFUSED if r.by_profile).endswith(
        "under the legacy and 0.19 profiles")


def test_the_replay_guide_says_sliding_window_and_hybrid_models_replay():
    """They are modelled (traces/hybrid/ replays with no divergence)."""
    guide = " ".join((ROOT / "docs" / "guide" / "replay.md").read_text().split())
    refused = guide.split("rather than replayed into false divergences", 1)[1].split(". ", 1)[0]
    assert "hybrid" not in refused and "sliding-window, " not in refused
    assert "Models with sliding-window layers are modelled" in guide


# --------------------------------------------------------------------------- README's promises


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())


def test_the_readme_says_report_exits_1_on_divergences_as_it_does(tmp_path, capsys):
    from kvtrace import cli

    row = _readme().split("| 1 |", 1)[1].split("|", 1)[0]   # what exit code 1 means
    assert "`report`" in row and "divergences" in row
    trace = ROOT / "traces" / "faults" / "free-before-send.jsonl.gz"
    assert cli.run(["report", str(trace), "-o", str(tmp_path / "r.html")]) == 1
    assert cli.run(["report", str(ROOT / "traces" / "preemption.jsonl.gz"), "-o",
                    str(tmp_path / "ok.html")]) == 0
    capsys.readouterr()


def test_the_readme_says_traces_are_written_0600_as_they_are(tmp_path, capsys):
    import os
    import stat

    from kvtrace import cli

    said = re.search(r"kvtrace writes one \(([^)]*)\) with mode 0600", _readme())
    assert said and said.group(1) == "`record`, `replay -o`, `redact`"
    old = os.umask(0o022)
    try:
        rec, out, red = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl.gz"
        assert cli.run(["record", "-o", str(rec), "--workload", "offload", "--requests", "4"]) == 0
        assert cli.run(["replay", "--device", "cpu", "-o", str(out), str(rec)]) in (0, 1)
        assert cli.run(["redact", str(rec), str(red)]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    assert [stat.S_IMODE(p.stat().st_mode) for p in (rec, out, red)] == [0o600] * 3
