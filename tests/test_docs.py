"""The docs stay true to the code: every rule id a check can name is in the
table of docs/reference/checks.md, the catalog of workloads and faults is the
one the code generates, and the README stays short."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULE = re.compile(r"^((?:\d+(?:\.\d+)?(?:/\d+\.\d+)?|I\d+|B\d+|SD\d+|D\d+|L\d+|liveness|kv-content|crash|diff"
                  r"|handoff)(?=: )|(?:S|AS):\d+(?= ))")


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
    assert catalog.EMBEDDED_FAULT_WORKLOADS == FAULT_WORKLOADS


@pytest.mark.vllm
def test_the_catalog_names_the_vllm_workloads_and_faults():
    from kvtrace import catalog
    from kvtrace.record.vllm.fault_schedulers import FAULT_WORKLOADS, FAULTS
    from kvtrace.record.vllm.workloads import WORKLOADS

    assert set(catalog.VLLM_WORKLOADS) == set(WORKLOADS)
    assert set(catalog.VLLM_FAULTS) == set(FAULTS) == set(FAULT_WORKLOADS)
    assert catalog.VLLM_FAULT_WORKLOADS == FAULT_WORKLOADS
    assert set(catalog.VLLM_ALIASES.values()) <= set(WORKLOADS)
