"""Embedded-engine traces through the replayer: clean ones replay with no
divergence; a faulted one diverges where the fault log says the engine went
wrong, on the request and field the bug class names."""

from __future__ import annotations

import pytest

from kvtrace.engine import FAULT_WORKLOADS, WORKLOADS, record_embedded
from kvtrace.findings import reached_steps
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

replay = pytest.importorskip("kvtrace.replay")


def _divergences(path):
    return list(replay.replay_file(path).divergences)


def _prompt_stats(path) -> list[ev.PromptStats]:
    with TraceReader(path) as r:
        return [e for e in r if isinstance(e, ev.PromptStats)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_clean_trace_replays_without_divergence(tmp_path, workload, seed):
    res = record_embedded(tmp_path / "t.jsonl.gz", workload=workload, seed=seed)
    assert _divergences(res.path) == []


@pytest.mark.parametrize("counters", ["legacy", "prefill_stats"])
def test_either_counter_shape_replays_without_divergence(tmp_path, counters):
    res = record_embedded(tmp_path / "t.jsonl", workload="offload", counters=counters)
    assert _divergences(res.path) == []


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    d = tmp_path_factory.mktemp("faulted-replay")
    out = {}
    for fault, workload in FAULT_WORKLOADS.items():
        res = record_embedded(d / f"{fault}.jsonl", workload=workload, fault=fault)
        out[fault] = (res, _divergences(res.path))
    return out


@pytest.mark.parametrize("fault", list(FAULT_WORKLOADS))
def test_fault_is_detected_no_earlier_than_it_fires(faulted, fault):
    res, divs = faulted[fault]
    assert divs
    # The step the trace had reached at each divergence: under async scheduling
    # step N's output comes after step N+1 and shows the state step N+1 left.
    # (A divergence found only at the end of the trace has no step.)
    reached = reached_steps(divs)
    assert min(reached.get(id(d), d.step) for d in divs if d.step is not None) >= min(
        e.step for e in res.fault_log)


def _has(divs, step, req, field):
    return any(d.step == step and d.req == req and field in d.field for d in divs)


def test_async_load_overshoot_is_named_at_the_admission(faulted):
    res, divs = faulted["async-load-overshoot"]
    first = res.fault_log[0]
    hit = [d for d in divs if d.req == first.req and d.field == "num_computed_tokens"]
    assert hit and hit[0].step >= first.step
    assert hit[0].recorded > hit[0].expected


def test_no_reload_after_preempt_is_named_at_every_unloaded_resume(faulted):
    res, divs = faulted["no-reload-after-preempt"]
    for e in res.fault_log:
        assert _has(divs, e.step, e.req, "load"), e


def test_stale_computed_after_failed_schedule_is_named_at_the_first_stale_admission(faulted):
    res, divs = faulted["stale-computed-after-failed-schedule"]
    first = res.fault_log[0]
    assert _has(divs, first.step, first.req, "num_computed_tokens")


@pytest.mark.parametrize("fault", ["stale-cached-on-preempt", "negative-external-on-invalid-blocks"])
def test_broken_legacy_counters_are_named_where_they_are_emitted(faulted, fault):
    res, divs = faulted[fault]
    broken = []
    for p in _prompt_stats(res.path):
        cached, ext = p.legacy.num_cached_tokens, p.legacy.num_external_computed_tokens
        recomputed = 1 if cached + 1 == p.prefill_stats.num_prompt_tokens else 0
        if ext < 0 or cached + recomputed - ext < 0:
            broken.append(p)
    assert broken
    for p in broken:
        assert _has(divs, p.step, p.req, "legacy.num_external_computed_tokens"), p


@pytest.mark.parametrize("where", ["states", "running"])
def test_handing_out_the_null_block_is_named(tmp_path, where):
    """Block 0 is vLLM's null block: a table that holds it is an engine bug,
    found in a request's state or in the blocks a running request was given."""
    import orjson

    res = record_embedded(tmp_path / "t.jsonl", workload="kv-pressure", seed=0)
    lines = res.path.read_bytes().splitlines()
    for i, line in enumerate(lines):
        rec = orjson.loads(line)
        if rec.get("kind") == "step" and rec["step"] > 5 and rec[where]:
            field = "block_ids" if where == "states" else "new_block_ids"
            rec[where][0][field] = [0] + rec[where][0][field][1:] if rec[where][0][field] else [0]
            lines[i] = orjson.dumps(rec)
            step = rec["step"]
            break
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(b"\n".join(lines) + b"\n")
    null = [d for d in _divergences(edited) if d.rule == "4.5: block 0 is the null block"]
    assert null and null[0].step == step
