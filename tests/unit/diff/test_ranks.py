"""The checks across a data-parallel run's ranks (DP1-DP3): a run whose ranks
agree passes, and each planted disagreement is named with its rank, step and
rule. The ranks are copies of traces/dp-throttle.jsonl.gz (vLLM 0.32, prefills
held back on two steps of every three, as ranks in lockstep do with
prefill_schedule_interval 3), made by tests/unit/trace/test_ranks.py's
``as_rank``; tests/e2e/vllm/test_vllm_ranks.py checks a live run of vLLM's
own data-parallel engine core."""

from __future__ import annotations

from kvtrace.diff.ranks import DP1, DP2, DP3_LOCKSTEP, DP3_NEVER, Cadence, check_ranks
from kvtrace.trace import TraceReader

from tests.unit.trace.test_ranks import THROTTLE, as_rank, make_run, rank_name


def _check(run, lockstep=True):
    return check_ranks({k: str(rank_name(run, k)) for k in range(2)}, lockstep)


def _steps(recs):
    return [r for r in recs if r.get("kind") == "step"]


def test_ranks_that_agree_pass(tmp_path):
    res = _check(make_run(tmp_path))
    assert res.divergences == [] and res.unread == {}
    arrivals = sum(1 for e in TraceReader(THROTTLE) if e.kind == "arrival")
    assert res.requests == 2 * arrivals
    assert res.steps_checked >= 20   # steps checked against the one before them, both ranks


def test_a_step_off_the_shared_counter_is_named(tmp_path):
    flipped = {}

    def flip(recs):
        held = [s for s in _steps(recs) if s["throttle_prefills"]]
        s = held[len(held) // 2]
        s["throttle_prefills"] = False
        flipped.update(step=s["step"], seq=s["seq"])

    run = make_run(tmp_path)
    as_rank(rank_name(run, 1), 1, change=flip)
    ((rank, d),) = _check(run).divergences
    assert (rank, d.step, d.seq, d.field) == (1, flipped["step"], flipped["seq"],
                                              "throttle_prefills")
    assert (d.recorded, d.expected, d.rule) == (False, True, DP3_LOCKSTEP)
    assert d.why.endswith("where the shared counter was a multiple of 3, it is not one")


def test_too_many_steps_held_back_in_a_row_are_named():
    """A stretch that starts held back: at most interval - 1 such steps before
    the shared counter reaches a multiple of the interval."""
    c = Cadence(3)
    for i, held in enumerate([True, True, True, False]):
        c.feed(_arrival(f"r{i}"), None)
        c.feed(_step(i, held), None)
    (d,) = c.found
    assert (d.step, d.recorded, d.rule) == (2, True, DP3_LOCKSTEP)
    assert "3 steps in a row" in d.why


def test_a_stretch_ends_when_the_rank_holds_no_request():
    """Between stretches the counter moves on unseen (dummy batches, a new
    wave): no step is judged against one before the rank went idle."""
    from kvtrace.trace.events import Output

    c = Cadence(3)
    c.feed(_arrival("a"), None)
    c.feed(_step(0, False), None)
    c.feed(Output(seq=90, step=0, finished={"a": "length"}), None)
    c.feed(_arrival("b"), None)
    c.feed(_step(1, False), None)   # a multiple of 3 again: fine after a gap
    assert c.found == [] and c.checked == 0


def test_an_engine_core_not_in_lockstep_holds_no_prefill_back(tmp_path):
    run = tmp_path / "run.jsonl"
    for k in range(2):
        as_rank(rank_name(run, k), k, size=1)
    divs = _check(run, lockstep=False).divergences
    held = [e.step for e in TraceReader(THROTTLE) if e.kind == "step" and e.throttle_prefills]
    assert [(k, d.step) for k, d in divs if k == 1] == [(1, s) for s in held]
    assert {d.rule for _, d in divs} == {DP3_NEVER}


def test_a_request_at_two_ranks_is_named(tmp_path):
    run = make_run(tmp_path)
    as_rank(rank_name(run, 1), 1, own_ids=False)
    as_rank(rank_name(run, 0), 0, own_ids=False)
    divs = _check(run).divergences
    ids = [e.req for e in TraceReader(THROTTLE) if e.kind == "arrival"]
    assert [(k, d.req, d.recorded, d.expected) for k, d in divs] == [(1, r, 1, 0) for r in ids]
    assert {d.rule for _, d in divs} == {DP2} and divs[0][1].line is not None


def test_ranks_built_otherwise_are_named_but_not_for_their_kv_cache_size(tmp_path):
    def other(recs):
        recs[0]["config"]["max_num_seqs"] += 1
        recs[0]["config"]["num_blocks"] += 7   # each rank sizes its own KV cache

    run = make_run(tmp_path)
    as_rank(rank_name(run, 1), 1, change=other)
    ((rank, d),) = _check(run).divergences
    base = TraceReader(THROTTLE).header.config.max_num_seqs
    assert (rank, d.field, d.recorded, d.expected, d.rule) == (
        1, "config.max_num_seqs", base + 1, base, DP1)


def test_an_unusable_rank_is_said_and_the_others_checked(tmp_path):
    run = make_run(tmp_path)
    rank_name(run, 1).write_text("not a trace\n")
    res = _check(run)
    assert list(res.unread) == [1] and res.divergences == [] and res.requests > 0


def _arrival(req):
    from kvtrace.trace.events import Arrival

    return Arrival(seq=0, req=req, prompt_token_ids=[1], max_tokens=9)


def _step(step, held):
    from kvtrace.trace.events import Step

    return Step(seq=step, step=step, throttle_prefills=held)


def test_a_pause_ends_a_stretch():
    """Paused, vLLM's scheduler counts fewer requests unfinished (none under
    PAUSED_ALL), so the wave may end, and the counter start again, while the
    rank still holds requests."""
    from kvtrace.trace.events import PauseState

    c = Cadence(3)
    c.feed(_arrival("a"), None)
    c.feed(_step(0, False), None)
    c.feed(PauseState(seq=50, state="PAUSED_ALL"), None)
    c.feed(_step(1, True), None)
    c.feed(PauseState(seq=51, state="UNPAUSED"), None)
    c.feed(_step(2, False), None)   # a new wave: the counter is 0 again
    assert c.found == [] and c.checked == 0
    c.feed(_step(3, False), None)   # held back, unpaused: one step after a multiple of 3
    assert [d.step for d in c.found] == [3]
