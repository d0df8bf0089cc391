"""The handoffs of a fleet: every decode-side request of several traces paired
with its prefill-side request in whichever trace holds it.

The fleets are traces/disagg/'s two sides (vLLM 0.32 with NixlConnector,
model-free: traces/README.md) split request by request into several traces
(``split``), as several prefill and decode servers behind one proxy would
have recorded them, and traces/faults/free-before-send.jsonl.gz, another
prefill engine whose handoffs no decode trace here reads. A planted bad
handoff in one trace of many is named with its two traces.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.diff.handoff import NotAPair
from kvtrace.diff.handoffs import diff_handoffs
from kvtrace.trace import TraceReader

from tests.mini_traces import load_records, save_records
from tests.unit.diff.test_handoff import DECODE, FREE_BEFORE_SEND, PREFILL, TRACES

# The fields of each record kind that name requests, as lists of ids, lists of
# records with a "req", or dicts keyed by request.
_LISTS = {"step": ("preempted", "finished"), "output": ("grammar_rejected", "pooled"),
          "abort": ("reqs",)}
_PARTS = {"step": ("new", "resumed", "running", "lookups", "loads", "states"),
          "output": ("states",)}
_KEYED = {"step": ("spec", "grammar"), "output": ("sampled", "finished"), "drafts": ("drafts",)}


def _kept(rec: dict, mine: set[str]) -> dict | None:
    """``rec`` with only the requests of ``mine``; None for a record of another request's."""
    kind = rec.get("kind")
    if "req" in rec:
        return rec if rec["req"] in mine else None
    for f in _LISTS.get(kind, ()):
        if rec.get(f) is not None:
            rec[f] = [r for r in rec[f] if r in mine]
    for f in _PARTS.get(kind, ()):
        if rec.get(f) is not None:
            rec[f] = [p for p in rec[f] if p["req"] in mine]
    for f in _KEYED.get(kind, ()):
        if rec.get(f) is not None:
            rec[f] = {r: v for r, v in rec[f].items() if r in mine}
    if kind == "output" and rec.get("connector"):
        rec["connector"] = {k: [r for r in v if r in mine] if k != "invalid_block_ids" else v
                            for k, v in rec["connector"].items()}
    return None if kind == "abort" and not rec["reqs"] else rec


def split(src: Path, folder: Path, parts: int, name: str) -> list[Path]:
    """``src``'s requests dealt round-robin into ``parts`` traces, each with the
    steps of its own requests (as engines serving those requests alone would
    have decided them is not claimed: a handoff diff reads what each request
    was sent, handed over and loaded, request by request)."""
    recs = load_records(src)
    ids = [r["req"] for r in recs if r.get("kind") == "arrival"]
    out = []
    for k in range(parts):
        mine = set(ids[k::parts])
        kept = [recs[0]] + [x for x in (_kept(dict(r), mine) for r in recs[1:]) if x is not None]
        out.append(save_records(kept, folder / f"{name}{k}.jsonl"))
    return out


@pytest.fixture
def fleet(tmp_path) -> dict[str, list[Path]]:
    """Three prefill traces and two decode traces of one deployment."""
    return {"prefill": split(PREFILL, tmp_path, 3, "prefill"),
            "decode": split(DECODE, tmp_path, 2, "decode")}


def test_a_fleet_pairs_every_handoff_across_its_traces(fleet):
    res = diff_handoffs(fleet["prefill"] + fleet["decode"] + [FREE_BEFORE_SEND])
    assert res.divergences == [] and res.compared == 8 and res.unknown == {}
    assert [t.role for t in res.traces] == ["prefill"] * 3 + ["decode"] * 2 + ["prefill"]
    assert sum(t.handed_over for t in res.traces[:3]) == 8
    assert [t.pulls for t in res.traces[3:5]] == [4, 4]
    # The other prefill engine's handoffs are read by no decode request here.
    assert list(res.unread) == [5] and len(res.unread[5]) == 8
    # Each split trace reads as a whole trace.
    for p in fleet["prefill"] + fleet["decode"]:
        assert sum(1 for _ in TraceReader(p)) > 0


def test_a_bad_handoff_in_one_trace_of_many_is_named_with_its_two_traces(fleet, tmp_path):
    decode1 = load_records(fleet["decode"][1])
    arrival = next(r for r in decode1 if r.get("kind") == "arrival")
    arrival["kv_transfer_params"]["remote_block_ids"] = [[7, 8, 9]]
    save_records(decode1, fleet["decode"][1])
    src = arrival["kv_transfer_params"]["remote_request_id"]
    holder = next(p for p in fleet["prefill"]
                  if any(r.get("req") == src for r in load_records(p)))
    res = diff_handoffs(fleet["decode"] + fleet["prefill"])
    ((i, j, d),) = res.divergences
    assert (res.traces[i].path, res.traces[j].path) == (str(fleet["decode"][1]), str(holder))
    assert (d.req, d.field, d.recorded) == (arrival["req"], "remote_block_ids", [[7, 8, 9]])
    assert d.line is not None and res.compared == 8


def test_requests_no_trace_pairs_are_listed_per_trace(fleet):
    res = diff_handoffs(fleet["prefill"][:2] + fleet["decode"])
    missing = {r["req"] for r in load_records(fleet["prefill"][2]) if r.get("kind") == "arrival"}
    unknown = {req for reqs in res.unknown.values() for req in reqs}
    readers = {r["req"] for p in fleet["decode"] for r in load_records(p)
               if r.get("kind") == "arrival"
               and r["kv_transfer_params"]["remote_request_id"] in missing}
    assert unknown == readers and readers and set(res.unknown) <= {2, 3}
    assert res.compared == 8 - len(readers) and res.divergences == []


def test_a_prefill_request_two_decode_requests_read_is_named(fleet):
    """The same decode trace twice under two names: each of its requests
    reads a prefill request the other copy reads already."""
    copy = fleet["decode"][0].with_name("again.jsonl")
    copy.write_bytes(fleet["decode"][0].read_bytes())
    res = diff_handoffs(fleet["prefill"] + fleet["decode"] + [copy])
    again = {d.req for i, _, d in res.divergences if res.traces[i].path == str(copy)}
    assert again == {r["req"] for r in load_records(copy) if r.get("kind") == "arrival"}
    assert all(d.field == "remote_request_id" and "read by one decode-side request" in d.rule
               for _, _, d in res.divergences)


def test_an_id_two_prefill_traces_hold_is_told_apart_by_the_engine_it_names(fleet, tmp_path):
    twin = tmp_path / "twin.jsonl"
    recs = load_records(fleet["prefill"][0])
    for r in recs:
        params = r.get("kv_transfer_params") or {}
        if "remote_engine_id" in params:
            params["remote_engine_id"] = "another-engine"
    save_records(recs, twin)
    res = diff_handoffs(fleet["prefill"] + [twin] + fleet["decode"])
    assert res.divergences == [] and res.compared == 8 and list(res.unread) == [3]
    # Without engine ids (a redacted fleet), which one was read cannot be told.
    for p in fleet["decode"]:
        recs = load_records(p)
        for r in recs:
            (r.get("kv_transfer_params") or {}).pop("remote_engine_id", None)
        save_records(recs, p)
    res = diff_handoffs(fleet["prefill"] + [twin] + fleet["decode"])
    assert {d.field for _, _, d in res.divergences} == {"remote_request_id"}
    assert all("twin.jsonl" in d.expected for _, _, d in res.divergences)


def test_a_trace_without_a_connector_or_named_twice_is_refused(fleet):
    with pytest.raises(NotAPair, match="has no KV connector"):
        diff_handoffs(fleet["prefill"] + [TRACES / "preemption.jsonl.gz"])
    with pytest.raises(NotAPair, match="are the same trace"):
        diff_handoffs(fleet["prefill"] + [fleet["prefill"][0]])


def test_a_pair_whose_two_decode_requests_read_one_prefill_request_names_the_second(tmp_path):
    """The two-trace diff makes the same check."""
    from kvtrace.diff import diff_files

    recs = load_records(DECODE)
    first, second = [r for r in recs if r.get("kind") == "arrival"][:2]
    lost = second["kv_transfer_params"]["remote_request_id"]
    second["kv_transfer_params"] = dict(first["kv_transfer_params"])
    res = diff_files(PREFILL, save_records(recs, tmp_path / "d.jsonl"))
    (d,) = res.divergences
    assert (d.req, d.field, d.expected) == (second["req"], "remote_request_id",
                                            f"read by {first['req']} alone")
    assert res.only_a == [lost] and res.requests_compared == 8
