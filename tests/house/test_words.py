"""Counts in words: the noun (and its verb) agree with the number, counts are
thousands separated, and a tuple-valued finding names its parts, in the
terminal and the HTML report alike, while --json keeps its values.

The scans run every stored trace's replay and summary at 80 columns, as a
person reads them."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from kvtrace import cli
from kvtrace._text import count, number, plural
from kvtrace.findings import Divergence, RequestFindings
from kvtrace.report.failures import also_diverge, causes_line, value_text

from tests._paths import REPO

ROOT = REPO
TRACES = sorted((ROOT / "traces").rglob("*.jsonl.gz"))
STALE = ROOT / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz"


def _cli(capsys, monkeypatch, *argv: str) -> tuple[int, str]:
    monkeypatch.setenv("COLUMNS", "80")
    code = cli.run([str(a) for a in argv])
    return code, capsys.readouterr().out


# --------------------------------------------------------------------------- the helpers


def test_count_agrees_with_its_number_and_separates_thousands():
    assert count(1, "request") == "1 request" and count(0, "request") == "0 requests"
    assert count(4538, "divergence") == "4,538 divergences"
    assert count(1, "more request") == "1 more request"
    assert plural(1, "diverges", "diverge") == "diverges" and plural(2, "diverges", "diverge") == "diverge"
    assert number(1234567) == "1,234,567" and number(-32) == "-32"


def _story(req: str | None, field: str = "num_computed_tokens", rule: str = "1.3: x",
           after: Divergence | None = None) -> RequestFindings:
    d = Divergence(3, req, field, 1, 2, rule)
    return RequestFindings(req, d, [], 1, after)


def test_the_stories_left_out_and_the_causes_agree_with_one():
    assert also_diverge([_story("a")]) == "1 more request also diverges"
    assert also_diverge([_story("a"), _story("b")]) == "2 more requests also diverge"
    assert also_diverge([_story(None)]) == "the step-wide counts also diverge"
    assert also_diverge([_story("a"), _story(None)]) == \
        "1 more request and the step-wide counts also diverge"
    root = _story("a")
    line = causes_line([root, _story("b", "block_ids", "4.5: y", after=root.cause)])
    assert line == "likely cause: num_computed_tokens (rule 1.3) in 1 request; 1 more request may follow from it"
    line = causes_line([_story("a"), _story("b", "block_ids", "4.5: y")])
    assert line == ("likely causes: num_computed_tokens (rule 1.3) in 1 request, block_ids "
                    "(rule 4.5) in 1 request")


# --------------------------------------------------------------------------- tuples named


def test_a_tuple_valued_finding_names_its_parts():
    assert value_text("state.num_computed_tokens", ["PREEMPTED", 95, 0]) == \
        "status PREEMPTED, num_computed_tokens 95, blocks 0"
    assert value_text("state.more_groups", [[40], [7, 8]]) == "group 1 [40]; group 2 [7, 8]"
    assert value_text("prefill_stats", [1024, 0, 4096]) == "local 1,024, external 0, prompt 4,096"
    assert value_text("num_free_blocks", 67359) == "67,359"
    assert value_text("state.num_computed_tokens", "<= 12345") == "<= 12,345"
    assert value_text("lookup.local", 2048) == "2,048"
    assert value_text("block_ids", [1234, 1235]) == "[1234, 1235]"   # ids, not counts


def test_the_i4_finding_is_labelled_in_the_terminal_and_the_html_and_bare_in_json(
        capsys, monkeypatch, tmp_path):
    code, out = _cli(capsys, monkeypatch, "replay", "--device", "cpu", STALE)
    flat = " ".join(out.split())
    assert code == 1
    assert "recorded: status PREEMPTED, num_computed_tokens 95, blocks 0" in flat
    assert "expected: num_computed_tokens 0 and no blocks, or a completed async load" in flat
    assert "[PREEMPTED" not in out and "c == 0" not in out
    code, out = _cli(capsys, monkeypatch, "replay", "--device", "cpu", "--json", STALE)
    first = orjson.loads(out)["likely_cause"]
    assert first["field"] == "state.num_computed_tokens" and first["recorded"] == ["PREEMPTED", 95, 0]
    html = tmp_path / "r.html"
    assert _cli(capsys, monkeypatch, "report", STALE, "-o", html)[0] == 1
    assert "status PREEMPTED, num_computed_tokens 95, blocks 0" in html.read_text()


# --------------------------------------------------------------------------- every stored trace

# "1 requests", "1 preemptions": a count of one with a plural noun. A fold's
# "+ 1 status" names a field, and is not one.
ONE_PLURAL = re.compile(r"(?<!\+ )\b1 (?!is\b|was\b|has\b|its\b)([a-z][a-z-]*s)\b")
# Where a number is an id or a time, not a count: steps, lines, blocks, slots,
# positions, tables of block ids, timestamps, citations (S:1372, PR #36752).
IDS = re.compile(r"\b(?:steps?|lines?|block|slot|positions?|at) \d+(?:[–-]\d+)?|\[[^\]]*\]"
                 r"|new blocks [\d –]+|\d+\.\d+|\S*/\S*|\b[A-Z]{1,2}:\d+|#\d+")
LONG = re.compile(r"(?<![\w,.-])\d{4,}(?![\w.]|,\d)")


def _looked_at(capsys, monkeypatch, trace: Path) -> str:
    _, replay = _cli(capsys, monkeypatch, "replay", "--device", "cpu", "--max", "100", trace)
    _, show = _cli(capsys, monkeypatch, "show", trace)
    return replay + show


@pytest.mark.parametrize("trace", TRACES, ids=[str(t.relative_to(ROOT / "traces")) for t in TRACES])
def test_no_stored_trace_reads_one_with_a_plural_or_a_long_count_unseparated(
        trace, capsys, monkeypatch):
    text = " ".join(_looked_at(capsys, monkeypatch, trace).split())
    assert ONE_PLURAL.findall(text) == []
    assert LONG.findall(IDS.sub("", text)) == []


def test_the_scans_see_what_they_are_for():
    assert ONE_PLURAL.findall("in 1 requests; 1 preemptions; + 1 status, step 8; 1 request") == \
        ["requests", "preemptions"]
    said = "recorded 67359, 1074 tokens scheduled, step 1234 (line 5678), [1234, 8], t 1795291569.585"
    assert LONG.findall(IDS.sub("", said)) == ["67359", "1074"]


def test_the_long_counts_of_stored_traces_are_separated(capsys, monkeypatch):
    """Stored traces hold counts of four digits and more (a pool of 33,677
    blocks, 1,379 divergences): the scans above meet them."""
    seen = "".join(_looked_at(capsys, monkeypatch, ROOT / "traces" / p) for p in (
        "vllm-bugs/spec-session-overshoot.jsonl.gz", "faults/stale-computed-on-preempt.jsonl.gz",
        "faults/grammar-not-awaited.jsonl.gz", "preemption.jsonl.gz"))
    flat = " ".join(seen.split())
    for said in ("33,677 blocks", "FAILED: 1,379 divergences", "num_free_blocks: recorded 67,359",
                 "1,074 tokens scheduled"):
        assert said in flat


def test_a_request_preempted_once_reads_one_preemption(capsys, monkeypatch):
    _, out = _cli(capsys, monkeypatch, "show", ROOT / "traces" / "preemption.jsonl.gz",
                  "--request", "3-827a4ea2")
    assert "; 1 preemption;" in out and "1 preemptions" not in out
