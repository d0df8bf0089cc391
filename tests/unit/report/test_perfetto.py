"""Perfetto export: Chrome trace-event JSON with request tracks, counters and divergences."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from kvtrace.findings import Divergence
from kvtrace.replay import replay_file
from kvtrace.report.perfetto import REQUESTS_PID, SCHEDULER_PID, US_PER_STEP, export_perfetto
from kvtrace.trace.io import TraceError, TraceReader
from kvtrace.trace.events import Arrival, Step

from tests._paths import REPO
from tests.mini_traces import write_mini_trace

TRACES = REPO / "traces"
SLICES = {"waiting", "loading KV", "prefill", "decode", "preempted"}


def _export(trace: Path, out: Path, divergences=None) -> dict:
    export_perfetto(trace, out, divergences)
    with open(out) as f:
        doc = json.load(f)                    # plain json: what the Perfetto UI parses
    return doc


def _check_well_formed(doc: dict, trace: Path) -> dict[str, int]:
    evs = doc["traceEvents"]
    assert {e["ph"] for e in evs} <= {"M", "X", "C", "i"}
    arrivals = [e.req for e in TraceReader(trace) if isinstance(e, Arrival)]
    names = {e["tid"]: e["args"]["name"] for e in evs
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == REQUESTS_PID}
    # One track per request, in arrival order.
    assert [names[t] for t in sorted(names)] == arrivals
    per_track = defaultdict(list)
    for e in evs:
        assert isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int)
        if e["ph"] in "XCi":
            assert isinstance(e["ts"], int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["name"] in SLICES and e["dur"] > 0 and e["pid"] == REQUESTS_PID
            assert e["tid"] in names
            per_track[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g")
    for tid, slices in per_track.items():
        slices.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(slices, slices[1:]):
            assert a1 <= b0, f"{names[tid]}: {an} [{a0}, {a1}) overlaps {bn} [{b0}, {b1})"
    counters = Counter(e["name"] for e in evs if e["ph"] == "C")
    steps = sum(1 for e in TraceReader(trace) if isinstance(e, Step))
    assert counters["scheduled tokens"] == steps
    assert counters["running requests"] == steps
    assert all(e["pid"] == SCHEDULER_PID for e in evs if e["ph"] == "C")
    return Counter(e["name"] for e in evs if e["ph"] == "X")


def test_faulted_trace_divergences_become_instant_events(tmp_path):
    trace = TRACES / "faults" / "async-load-overshoot.jsonl.gz"
    divs = replay_file(trace, device=None).divergences
    assert divs
    doc = _export(trace, tmp_path / "out.json", divs)
    slices = _check_well_formed(doc, trace)
    assert slices["loading KV"] == 1 and slices["prefill"] >= 1 and slices["decode"] >= 1
    evs = doc["traceEvents"]
    tids = {e["args"]["name"]: e["tid"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"
            and e["pid"] == REQUESTS_PID}
    marks = [e for e in evs if e["ph"] == "i" and e["cat"] == "divergence"]
    assert len(marks) == len(divs)
    for d, m in zip(sorted(divs, key=lambda d: d.step), sorted(marks, key=lambda m: m["ts"])):
        assert m["tid"] == tids[d.req] and m["pid"] == REQUESTS_PID
        assert d.step * US_PER_STEP <= m["ts"] < (d.step + 1) * US_PER_STEP
        assert m["args"]["recorded"] == d.recorded and m["args"]["expected"] == d.expected
        assert m["name"] == f"divergence: {d.field}"
    # The overshoot: admitted at 64 instead of 40, right after the async load.
    first = min(marks, key=lambda m: m["ts"])
    assert first["args"]["field"] == "num_computed_tokens"
    assert (first["args"]["recorded"], first["args"]["expected"]) == (64, 40)
    load = next(e for e in evs if e["ph"] == "X" and e["name"] == "loading KV")
    assert load["tid"] == first["tid"] and load["ts"] + load["dur"] == first["ts"] - US_PER_STEP // 2
    free = [e for e in evs if e["ph"] == "C" and e["name"] == "free blocks"]
    assert free and all("free" in e["args"] for e in free)


def test_connector_trace_tracks(tmp_path):
    trace = TRACES / "connector.jsonl.gz"
    doc = _export(trace, tmp_path / "out.json")
    slices = _check_well_formed(doc, trace)
    assert set(slices) == SLICES
    evs = doc["traceEvents"]
    tid = next(e["tid"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"
               and e["args"]["name"] == "2-a1675dff")
    track = sorted((e["ts"] // US_PER_STEP, (e["ts"] + e["dur"]) // US_PER_STEP, e["name"])
                   for e in evs if e["ph"] == "X" and e["tid"] == tid)
    # Async load at step 0, admitted at 1 with the whole prompt loaded, decoding until it is
    # preempted at 23, re-loaded at 40, resumed at 41, finished after step 58.
    assert track == [(0, 1, "loading KV"), (1, 2, "prefill"), (2, 23, "decode"), (23, 40, "preempted"),
                     (40, 41, "loading KV"), (41, 59, "decode")]
    assert not [e for e in evs if e["ph"] == "i" and e["cat"] == "divergence"]


def test_preemptions_and_chunked_prefills(tmp_path):
    trace = TRACES / "preemption.jsonl.gz"
    slices = _check_well_formed(_export(trace, tmp_path / "p.json"), trace)
    assert slices["preempted"] == 5
    trace = TRACES / "priority.jsonl.gz"
    doc = _export(trace, tmp_path / "q.json")
    slices = _check_well_formed(doc, trace)
    chunks = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "prefill"]
    assert max(e["args"]["chunk"] for e in chunks) >= 3     # long_prefill_token_threshold=48


def test_step_wide_divergence_goes_to_the_scheduler_track(tmp_path):
    trace = write_mini_trace(tmp_path / "t.jsonl")
    d = Divergence(step=1, req=None, field="num_free_blocks", recorded=3, expected=4, rule="4.5")
    doc = _export(trace, tmp_path / "o.json", [d])
    _check_well_formed(doc, trace)
    (m,) = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["cat"] == "divergence"]
    assert m["pid"] == SCHEDULER_PID and m["s"] == "p" and m["args"]["recorded"] == 3


def test_truncated_trace_exports_up_to_the_cut(tmp_path):
    whole = write_mini_trace(tmp_path / "whole.jsonl")
    cut = tmp_path / "cut.jsonl"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    doc = _export(cut, tmp_path / "o.json")
    assert "cut off" in doc["metadata"]["truncation"]
    _check_well_formed(doc, cut)


def test_unusable_trace_leaves_no_output(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    out = tmp_path / "o.json"
    with pytest.raises(TraceError):
        export_perfetto(bad, out)
    assert not out.exists()
