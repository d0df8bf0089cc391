"""The shadow-KV content check on whole traces: clean traces have no kv-content
divergence; KV corruption is caught as kv-content, also in traces edited so that
every counter still agrees with the reference."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import FAULT_WORKLOADS, record_embedded
from kvtrace.replay import replay_file

from tests._paths import REPO
from tests.mini_traces import load_records, save_records

TRACES = REPO / "traces"
COUNTER_KINDS = {"counter", "stats", "lookup"}


def content(divs):
    return [d for d in divs if d.kind == "kv-content"]


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.jsonl.gz")), ids=lambda p: p.name)
def test_real_vllm_traces_have_no_content_divergence(path):
    assert content(replay_file(path).divergences) == []


@pytest.mark.parametrize("path", sorted(TRACES.glob("hybrid*/**/*.jsonl.gz")),
                         ids=lambda p: str(p.relative_to(TRACES)))
def test_hybrid_and_state_model_traces_have_no_content_divergence(path):
    """Every trace of a hybrid KV cache, of state models included (real vLLM,
    vLLM's bugs and model-free runs of 0.32 and 0.33): the check runs on each,
    reads states, and finds nothing wrong."""
    res = replay_file(path)
    assert res.content_unchecked is None and res.slots_checked > 0
    assert content(res.divergences) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", sorted(TRACES.rglob("*.jsonl.gz")),
                         ids=lambda p: str(p.relative_to(TRACES)))
def test_every_trace_replays_word_for_word_the_same_on_cuda_as_on_cpu(path):
    """The shadow-KV check on CUDA reports what it reports on the CPU, clean
    traces and faulty ones alike, and verifies as many slots."""
    cpu, cuda = (replay_file(path, device=d, worker=0) for d in ("cpu", "cuda"))
    assert [d.to_json() for d in cuda.divergences] == [d.to_json() for d in cpu.divergences]
    assert cuda.slots_checked == cpu.slots_checked > 0


def test_real_vllm_async_load_overshoot_is_caught_as_content():
    divs = content(replay_file(TRACES / "faults" / "async-load-overshoot.jsonl.gz").divergences)
    assert divs and "never written" in divs[0].recorded


@pytest.mark.parametrize("fault", ["async-load-overshoot", "no-reload-after-preempt"])
def test_embedded_faults_that_corrupt_kv_are_caught_where_they_fire(tmp_path, fault):
    res = record_embedded(tmp_path / "t.jsonl", workload=FAULT_WORKLOADS[fault], fault=fault)
    divs = content(replay_file(res.path).divergences)
    first = res.fault_log[0]
    mine = [d for d in divs if d.req == first.req]
    assert mine, f"no kv-content divergence for {first.req}"
    assert mine[0].step >= first.step


@pytest.mark.parametrize("device", ["numpy", "torch-cpu"])
@pytest.mark.parametrize("fault", ["async-load-overshoot", "no-reload-after-preempt"])
def test_batches_place_divergences_as_single_steps_would(tmp_path, fault, device, monkeypatch):
    """The content check evaluates steps in batches; replay must list every
    divergence in the order a step-at-a-time check gives, also when a batch ends
    early (a step that reads many slots goes on its own)."""
    from kvtrace.replay.kv_content.core import ShadowCore

    res = record_embedded(tmp_path / "t.jsonl", workload=FAULT_WORKLOADS[fault], fault=fault)
    runs = []
    for steps, slots in ((1, ShadowCore.BATCH_SLOTS), (ShadowCore.BATCH_STEPS, ShadowCore.BATCH_SLOTS),
                         (16, 64)):
        monkeypatch.setattr(ShadowCore, "BATCH_STEPS", steps)
        monkeypatch.setattr(ShadowCore, "BATCH_SLOTS", slots)
        runs.append([d.to_json() for d in replay_file(res.path, device=device).divergences])
    kinds = [d["kind"] for d in runs[0]]
    assert kinds.count("kv-content") >= 2 and len(set(kinds)) >= 2   # interleaved with others
    assert len({d["step"] for d in runs[0] if d["kind"] == "kv-content"}) >= 2
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]


# --------------------------------------------------------------------------- edited traces


def _clean_offload(tmp_path) -> list[dict]:
    res = record_embedded(tmp_path / "clean.jsonl", workload="offload", seed=0)
    recs = load_records(res.path)
    assert replay_file(res.path).divergences == []
    return recs


def test_missing_load_is_caught_even_when_every_counter_matches(tmp_path):
    recs = _clean_offload(tmp_path)
    # Drop the first planned load: the engine counts the hit but never loads it.
    step = next(r for r in recs if r["kind"] == "step" and r.get("loads"))
    victim = step["loads"].pop(0)["req"]
    divs = replay_file(save_records(recs, tmp_path / "edited.jsonl")).divergences
    assert not [d for d in divs if d.kind in COUNTER_KINDS]
    hit = [d for d in content(divs) if d.req == victim]
    assert hit and "never written" in hit[0].recorded


def _first_admission_with_hit(recs: list[dict]):
    for r in recs:
        if r["kind"] != "step":
            continue
        for s in r["new"]:
            if s["num_computed_tokens"] > 0 and s["block_ids"]:
                return r, s
    raise AssertionError("no admission with a prefix hit")


def test_wrong_prefix_hit_is_caught_even_when_every_counter_matches(tmp_path):
    res = record_embedded(tmp_path / "clean.jsonl", workload="shared-prefix", seed=0)
    recs = load_records(res.path)
    step, entry = _first_admission_with_hit(recs)
    req, good = entry["req"], entry["block_ids"][0]
    # Point the hit at a block that some other request computed with other tokens.
    written = {b for r in recs[: recs.index(step)] if r["kind"] == "step"
               for s in r["states"] if s["req"] != req for b in s["block_ids"]}
    wrong = next(b for b in sorted(written) if b != good and b not in entry["block_ids"])
    for r in recs[recs.index(step):]:
        for group in ("new", "resumed", "states"):
            for s in r.get(group, []):
                if s["req"] == req:
                    s["block_ids"] = [wrong if b == good else b for b in s["block_ids"]]
    divs = replay_file(save_records(recs, tmp_path / "edited.jsonl")).divergences
    assert not [d for d in divs if d.kind in COUNTER_KINDS]
    hit = [d for d in content(divs) if d.req == req]
    assert hit and hit[0].step == step["step"]
    assert f"block {wrong} " in hit[0].recorded and "written by" in hit[0].recorded


def test_block_reused_while_in_use_is_caught_even_when_every_counter_matches(tmp_path):
    res = record_embedded(tmp_path / "clean.jsonl", workload="shared-prefix", seed=1)
    recs = load_records(res.path)
    steps = [r for r in recs if r["kind"] == "step"]
    # Find a step that admits a request while another request keeps running.
    for st in steps:
        running = {s["req"] for s in st["running"]}
        newcomer = next((s for s in st["new"] if s["num_computed_tokens"] == 0), None)
        if running and newcomer:
            break
    else:
        raise AssertionError("no step admits a request beside a running one")
    owner = sorted(running)[0]
    owner_table = next(s["block_ids"] for s in st["states"] if s["req"] == owner)
    stolen, given = owner_table[0], newcomer["block_ids"][0]
    # The engine hands the owner's first block to the newcomer as if it were free.
    for r in recs[recs.index(st):]:
        for group in ("new", "resumed", "states"):
            for s in r.get(group, []):
                if s["req"] == newcomer["req"]:
                    s["block_ids"] = [stolen if b == given else b for b in s["block_ids"]]
    divs = replay_file(save_records(recs, tmp_path / "edited.jsonl")).divergences
    assert not [d for d in divs if d.kind in COUNTER_KINDS]
    hit = [d for d in content(divs) if d.req == owner]
    assert hit and hit[0].step == st["step"]
    assert f"written by {newcomer['req']} at step {st['step']}" in hit[0].recorded
