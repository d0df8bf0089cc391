"""Engine bugs kvtrace found (docs/findings.md), kept as regression tests.

vLLM 0.32 stalls when a request's async KV load fails under the "recompute"
policy: the request stays in ``_inflight_prefills`` after its blocks are freed,
so its own re-admission reserves its whole sequence twice, never fits, and
blocks the waiting queue. The reference scheduler reproduces this faithfully;
replay flags it through the liveness check; vLLM's own scheduler, fed the same
inputs, makes the same decisions.

vLLM 0.32 also loads a one-token prompt with a full async hit again every time
its load completes, so it never runs. Replay's liveness check names it (vLLM's
agreement: tests/e2e/vllm/test_vllm_replay.py).

And with scheduler_reserve_full_isl off, priority scheduling and chunked long
prefills, it can admit and preempt the same requests forever. Replay's liveness
check names each of them; vLLM's own scheduler does the same on the same inputs.

Under async scheduling, it loses a streaming-input session whose turn ends
after it was preempted in the step scheduled meanwhile: no queue holds it, and
the engine goes idle with it unfinished. Replay's liveness check names it.
"""

from __future__ import annotations

import pytest

from kvtrace.engine import EngineStalled, record_embedded
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO

WORKLOAD, SEED = "load-failures", 16


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    path = tmp_path_factory.mktemp("stall") / "stall.jsonl"
    with pytest.raises(EngineStalled):
        record_embedded(path, workload=WORKLOAD, seed=SEED, counters="prefill_stats")
    return path


def _failed_then_idle(path):
    """From the trace alone: the request whose async load failed, and the first
    step after which nothing is ever scheduled again."""
    failed, last_busy = None, None
    for e in TraceReader(path):
        if isinstance(e, ev.Output) and e.connector and e.connector.failed_recving and failed is None:
            failed = e.connector.failed_recving[0]
        if isinstance(e, ev.Step) and e.scheduled():
            last_busy = e.step
    return failed, last_busy + 1


def test_the_stall_is_flagged_as_the_only_divergence(stalled):
    failed, idle_from = _failed_then_idle(stalled)
    divs = replay_file(stalled, device=None).divergences
    assert [(d.field, d.req) for d in divs] == [("progress", failed)]
    assert divs[0].step == idle_from + 63          # the 64th idle step
    assert "itself included" in divs[0].rule


def test_the_trace_says_it_was_cut_short(stalled):
    r = TraceReader(stalled)
    list(r)
    assert r.end is not None and r.end.status == "interrupted" and "stalled" in r.end.error


@pytest.mark.vllm
def test_vllm_own_scheduler_stalls_the_same_way(stalled, tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this finding is checked against vLLM's scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    out = tmp_path / "vllm.jsonl"
    run = replay_through_vllm(stalled, out)
    assert run.stopped is None and not run.unanswered_lookups and not run.unused_lookups
    assert diff_files(stalled, out).divergences == []
    failed, idle_from = _failed_then_idle(out)
    with TraceReader(out) as r:
        steps = [e for e in r if isinstance(e, ev.Step)]
    # vLLM keeps looking the failed request up, step after step, and schedules nothing.
    tail = [s for s in steps if s.step >= idle_from]
    assert len(tail) > 64 and all(not s.scheduled() for s in tail)
    assert all([lk.req for lk in s.lookups] == [failed] for s in tail)


def test_a_one_token_prompt_loaded_again_and_again_is_named_once(tmp_path):
    from kvtrace.engine import record_workload
    from kvtrace.replay.liveness import RELOAD_LIMIT

    from tests.mini_traces import one_token_full_hit_workload

    path = tmp_path / "one.jsonl"
    with pytest.raises(EngineStalled):
        record_workload(path, one_token_full_hit_workload(), counters="prefill_stats")
    load_steps = [e.step for e in TraceReader(path)
                  if isinstance(e, ev.Step) and any(x.req == "one" for x in e.loads or ())]
    assert len(load_steps) > RELOAD_LIMIT
    divs = replay_file(path, device=None).divergences
    assert [(d.req, d.field, d.kind) for d in divs] == [("one", "progress", "invariant")]
    assert divs[0].step == load_steps[RELOAD_LIMIT - 1]
    assert "one-token prompt" in divs[0].rule


@pytest.mark.parametrize("status,num_tokens,flagged", [
    ("WAITING", 1, False),     # the one-token prompt back at T - 1 = 0, holding its loaded block
    ("WAITING", 2, True),      # a longer request waiting at 0 with a block: nothing explains it
    ("PREEMPTED", 1, True),    # a preempted request holds nothing
])
def test_a_one_token_prompt_waiting_on_its_loaded_block_is_not_an_I4_break(tmp_path, status,
                                                                           num_tokens, flagged):
    """On a real vLLM 0.32 engine, the one-token prompt above, its load complete
    and back at num_computed_tokens 0 (T - 1, S:3171-3172), waits holding its
    block while its re-admission finds no room (random workload mixed:1256):
    I4's exception for a completed async load covers it. The same state with two
    tokens, or preempted, is still an I4 break."""
    from kvtrace.engine import record_workload

    from tests.mini_traces import load_records, one_token_full_hit_workload, save_records

    path = tmp_path / "one.jsonl"
    with pytest.raises(EngineStalled):
        record_workload(path, one_token_full_hit_workload(), counters="prefill_stats")
    records = load_records(path)
    step = next(r for r in records if r["kind"] == "step" and r["step"] > 0
                and any(st["req"] == "one" and st["block_ids"] for st in r["states"]))
    st = next(st for st in step["states"] if st["req"] == "one")
    st.update(status=status, num_computed_tokens=0, num_tokens=num_tokens)
    divs = replay_file(save_records(records, tmp_path / "edited.jsonl"), device=None).divergences
    i4 = [(d.step, d.req) for d in divs if d.rule.startswith("I4")]
    assert i4 == ([(step["step"], "one")] if flagged else [])


def test_loads_that_fail_again_and_again_are_a_loop_named_with_its_loop():
    """A connector whose async loads of a request fail every time, under the
    recompute policy: the engine retries each one, and the next lookup takes
    the same hit again, for ever. Retrying a failed load is right, retrying it
    without end is not: the liveness rule names the request once, at its
    RELOAD_LIMIT-th load, with the steps, the tokens and the failures of its
    loop. The reference is driven directly, with the watch fed as replay
    feeds it."""
    from kvtrace.reference import ModelOutput, Scheduler, SchedulerConfig
    from kvtrace.reference import Request
    from kvtrace.replay.liveness import RELOAD_LIMIT, ProgressWatch

    class FailingStore:
        def __init__(self):
            self.loads = []

        def get_num_new_matched_tokens(self, r, n):
            return 8, True

        def update_state_after_alloc(self, r, block_ids, ext):
            if ext > 0:
                self.loads.append(ev.KVLoad(r.request_id, 0, ext))

        def request_finished(self, r, block_ids):
            return False

    store = FailingStore()
    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8,
                                  max_model_len=128, load_failure_policy="recompute"), store)
    s.add_request(Request("a", list(range(12)), max_tokens=8, block_size=4))
    watch, loading, found, load_steps = ProgressWatch(), set(), [], []
    for step in range(4 * RELOAD_LIMIT):
        store.loads = []
        out = s.schedule()
        found += watch.after_schedule(step, out, s, None, None, store.loads)
        load_steps += [step for _ in store.loads]
        model = ModelOutput(finished_recving=set(loading), failed_recving=set(loading))
        loading = {x.req for x in store.loads}
        watch.after_output(model.failed_recving, model.invalid_block_ids)
        s.update_from_output(out, model)
    assert len(load_steps) >= 2 * RELOAD_LIMIT         # it was loaded again and again
    assert [(d.req, d.field, d.step) for d in found] == [("a", "progress", load_steps[RELOAD_LIMIT - 1])]
    d = found[0]
    assert d.recorded == f"{RELOAD_LIMIT} KV loads since it was last scheduled, {RELOAD_LIMIT - 1} failed"
    assert f"makes no progress over {RELOAD_LIMIT} attempts" in d.rule
    assert f"all {RELOAD_LIMIT - 1} before the last failed (failed_recving)" in d.rule
    assert "each of tokens [0, 8)" in d.rule and "the same hit again" in d.rule
    assert f"steps {load_steps[0]}, {load_steps[1]}," in d.rule


@pytest.fixture(scope="module")
def preemption_loop(tmp_path_factory):
    from kvtrace.engine import record_workload

    from tests.mini_traces import preemption_loop_workload

    path = tmp_path_factory.mktemp("loop") / "loop.jsonl"
    with pytest.raises(EngineStalled, match="preemption loop: q5 was preempted 256 times"):
        record_workload(path, preemption_loop_workload(), counters="prefill_stats")
    return path


def test_requests_preempted_again_and_again_are_named(preemption_loop):
    """Counted from the trace alone: the step at which each request reaches
    PREEMPT_LIMIT preemptions without a sampled token in between."""
    from kvtrace.replay.liveness import PREEMPT_LIMIT

    count: dict[str, int] = {}
    reached: list[tuple[int, str]] = []
    for e in TraceReader(preemption_loop):
        if isinstance(e, ev.Step):
            for req in sorted(e.preempted):
                count[req] = count.get(req, 0) + 1
                if count[req] == PREEMPT_LIMIT:
                    reached.append((e.step, req))
        elif isinstance(e, ev.Output):
            for req, tokens in e.sampled.items():
                if tokens:
                    count.pop(req, None)
    assert len(reached) >= 2
    divs = replay_file(preemption_loop, device=None).divergences
    assert [(d.step, d.req) for d in divs] == reached
    assert all(d.field == "progress" and "preempted again and again" in d.rule for d in divs)


def _Step(preempted=(), finished=()):
    """A scheduler output as the liveness watch reads it: something runs (no
    stall), ``preempted`` were preempted and ``finished`` finished."""
    from kvtrace.reference import SchedulerOutput

    return SchedulerOutput([], [], [], {"other": 1}, set(preempted), set(finished))


def test_a_request_preempted_often_that_then_gets_through_is_not_a_loop():
    """Three requests each reach PREEMPT_LIMIT preemptions without a token, at
    steps LIMIT-1, LIMIT and LIMIT+1. "thrash" then samples a token: it got
    through, so nothing is reported for it (vLLM 0.32 did this on a random
    workload: tests/e2e/vllm/test_vllm_random.py, seed 542), so its report is taken
    back. "aborted" finishes without one, and "looping" is still going when
    the trace ends: their reports stand, at the step of their LIMIT-th
    preemption."""
    from kvtrace.reference import Scheduler, SchedulerConfig
    from kvtrace.replay.liveness import PREEMPT_LIMIT, ProgressWatch

    # The watch reads the scheduler only in a step that schedules nothing.
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_num_batched_tokens=64,
                                      max_num_seqs=2, max_model_len=128))
    watch, found = ProgressWatch(), []
    names = ("looping", "thrash", "aborted")
    for step in range(PREEMPT_LIMIT + 2):
        due = [n for i, n in enumerate(names) if step >= i]
        found += watch.after_schedule(step, _Step(preempted=due), sched, None, None)
        watch.after_output(set(), set(), {})
    found += watch.after_schedule(PREEMPT_LIMIT + 2, _Step(finished=["aborted"]), sched, None, None)
    watch.after_output(set(), set(), {"thrash": [7], "aborted": [9]})   # "aborted" is gone
    assert [(d.step, d.req, d.field) for d in found] == [
        (PREEMPT_LIMIT - 1, "looping", "progress"), (PREEMPT_LIMIT, "thrash", "progress"),
        (PREEMPT_LIMIT + 1, "aborted", "progress")]
    assert watch.take_back() == [found[1]]
    assert watch.take_back() == []


@pytest.mark.vllm
def test_vllm_own_scheduler_loops_the_same_way(preemption_loop, tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this finding is checked against vLLM's scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    out = tmp_path / "vllm.jsonl"
    res = replay_through_vllm(preemption_loop, out)
    steps = sum(isinstance(e, ev.Step) for e in TraceReader(preemption_loop))
    assert res.faithful_inputs and res.steps == steps > 500
    assert diff_files(preemption_loop, out).divergences == []


# --------------------------------------------------------------------------- vLLM 0.32: a hit on a block never written


UNCOMPUTED_HIT = (REPO / "traces" / "vllm-bugs"
                  / "priority-preempt-uncomputed-hit.jsonl.gz")


def _wrong_reads(path) -> list[tuple[int, str, list[int]]]:
    """Worked from the records alone, apart from the shadow-KV check: each
    step's scheduled tokens write their positions into the request's blocks
    (past its last token, its drafts: speculative decoding); when a request is
    admitted with a prefix hit, every hit position whose slot was last written
    by a request with a different prefix up to that position (or never) is a
    wrong read. Returns (step, request, wrong positions)."""
    with TraceReader(path) as r:
        bs = r.header.config.block_size
        prompts, tables, slots, found = {}, {}, {}, []
        out_tokens: dict[str, list[int]] = {}
        for e in r:
            if isinstance(e, ev.Arrival):
                prompts[e.req] = list(e.prompt_token_ids)
                out_tokens[e.req] = []
            elif isinstance(e, ev.Step):
                for s in e.states:
                    tables[s.req] = list(s.block_ids)
                admitted = [(x.req, x.num_computed_tokens, x.num_scheduled_tokens)
                            for x in e.new + e.resumed]
                running = [(x.req, x.num_computed_tokens, x.num_scheduled_tokens) for x in e.running]
                # One forward pass writes every scheduled position before any is read;
                # the positions past the last token hold the drafts scheduled.
                for req, start, n in admitted + running:
                    tokens = prompts[req] + out_tokens[req] + (e.spec or {}).get(req, [])
                    for p in range(start, start + n):
                        slots[(tables[req][p // bs], p % bs)] = tuple(tokens[:p + 1])
                for req, start, _ in admitted:      # a hit: positions below start are read
                    tokens = prompts[req] + out_tokens[req]
                    wrong = [p for p in range(start)
                             if slots.get((tables[req][p // bs], p % bs)) != tuple(tokens[:p + 1])]
                    if wrong:
                        found.append((e.step, req, wrong))
            elif isinstance(e, ev.Output):
                for req, toks in e.sampled.items():
                    out_tokens[req] += toks
    return found


def test_a_prefix_hit_on_a_block_its_preempted_request_never_wrote_is_flagged():
    """A real vLLM 0.32 run (traces/vllm-bugs/priority-preempt-uncomputed-hit,
    docs/findings.md): a request scheduled in a step and then preempted in it
    for a request of higher priority leaves the block that step was to fill
    cached; when it comes back, its prefix hit takes that block, whose last
    slots hold another request's KV. Every count agrees with the reference;
    only the shadow-KV check sees it, at the steps that read those slots."""
    expected = _wrong_reads(UNCOMPUTED_HIT)
    assert len(expected) == 1
    step, req, wrong = expected[0]
    divs = replay_file(UNCOMPUTED_HIT, device="cpu").divergences
    assert divs and all(d.kind == "kv-content" and d.req == req for d in divs), [d.to_json() for d in divs]
    assert divs[0].step == step
    first_wrong = min(wrong)
    assert f"(position {first_wrong})" in divs[0].recorded
    assert f"{len(wrong)} of " in divs[0].recorded
    # Without the content check, replay finds nothing: the counts are all vLLM's rules.
    assert replay_file(UNCOMPUTED_HIT, device=None).divergences == []


@pytest.mark.vllm
def test_vllm_own_scheduler_makes_the_same_uncomputed_hit(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this finding is checked against vLLM's scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    out = tmp_path / "vllm.jsonl"
    res = replay_through_vllm(UNCOMPUTED_HIT, out)
    assert res.faithful_inputs and res.stopped is None
    assert diff_files(UNCOMPUTED_HIT, out).divergences == []


# --------------------------------------------------------------------------- vLLM 0.32: a session lost from the queues


LOST_SESSION = (REPO / "traces" / "vllm-bugs"
                / "async-session-lost.jsonl.gz")


def _turns_ended_while_preempted(path) -> list[tuple[int, str]]:
    """Worked from the records alone: (output step, session) for each
    streaming-input session whose turn an output ends while a step recorded
    after the session was last scheduled has preempted it (under async
    scheduling the next step is scheduled, and may preempt it, before the
    output of the step before comes back)."""
    sessions, preempted, found = set(), set(), []
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.Arrival) and e.resumable:
                sessions.add(e.req)
            elif isinstance(e, ev.Step):
                preempted.update(e.preempted)
                preempted.difference_update(s.req for s in (*e.new, *e.resumed, *e.running))
            elif isinstance(e, ev.Output):
                found += [(e.step, req) for req in sorted(e.turn_ends()) if req in sessions & preempted]
    return found


def test_a_session_lost_from_the_queues_is_flagged():
    """A real vLLM 0.32 run (traces/vllm-bugs/async-session-lost,
    docs/findings.md): a session preempted while its last output was in flight
    ends its turn in that output. vLLM puts it back in the waiting queue, then
    takes it out with the preempted requests that stopped; it is never
    scheduled again, and the engine, which counts only its queues, goes idle
    with it unfinished (the driver stopped it). Every count agrees with the
    reference, which keeps vLLM's rules; replay names the session, at that
    output, by the liveness check alone."""
    lost = _turns_ended_while_preempted(LOST_SESSION)
    assert len(lost) == 1
    step, req = lost[0]
    with TraceReader(LOST_SESSION) as r:
        records = list(r)
        end = r.end
    assert end.status == "interrupted" and "would wait for ever" in end.error and req in end.error
    at = next(i for i, e in enumerate(records) if isinstance(e, ev.Output) and e.step == step)
    later = [e for e in records[at:] if isinstance(e, ev.Step)]
    assert later and not any(s.req == req for e in later for s in (*e.new, *e.resumed, *e.running))
    divs = replay_file(LOST_SESSION, device="cpu").divergences
    assert [(d.step, d.req, d.field, d.kind) for d in divs] == [(step, req, "progress", "invariant")], \
        [d.to_json() for d in divs]
    assert divs[0].recorded.endswith("in no queue") and divs[0].seq == records[at].seq


@pytest.mark.vllm
def test_vllm_own_scheduler_loses_the_same_session(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this finding is checked against vLLM's scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    out = tmp_path / "vllm.jsonl"
    res = replay_through_vllm(LOST_SESSION, out)
    assert res.faithful_inputs
    assert diff_files(LOST_SESSION, out).divergences == []
    with TraceReader(out) as r:
        steps = [e.step for e in r if isinstance(e, ev.Step)]
    with TraceReader(LOST_SESSION) as r:
        assert steps == [e.step for e in r if isinstance(e, ev.Step)]


OVERSHOOT = (REPO / "traces" / "vllm-bugs"
             / "spec-session-overshoot.jsonl.gz")


def turns_ended_past_their_tokens(path) -> dict[str, list[tuple[int, int, int]]]:
    """Worked from the records alone: per streaming-input session, (output
    step, num_tokens, num_computed_tokens) for each turn an output ends with
    more tokens counted as computed than the session has: the drafts of its
    last step that the stop cut."""
    found: dict[str, list[tuple[int, int, int]]] = {}
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.Output):
                for req, st in sorted(e.turn_ends().items()):
                    if st.num_computed_tokens > st.num_tokens:
                        found.setdefault(req, []).append((e.step, st.num_tokens, st.num_computed_tokens))
    return found


def test_a_turn_stopped_inside_accepted_drafts_skips_the_next_chunks_first_tokens():
    """A real vLLM 0.32 run (traces/vllm-bugs/spec-session-overshoot,
    docs/findings.md): a session of 40 tokens, max_tokens 10, drafting 3
    tokens a step with a draft model that is the model itself (every draft
    accepted): 1, then 4 and 4 tokens, then a step of 4 of which the stop keeps
    1. Its turn ends at 50 tokens with 52 counted as computed, and its next
    chunk's first two tokens, at positions 50 and 51, are never computed:
    every later read of them is wrong KV to the shadow-KV check, and nothing
    else diverges. (Its second turn, the last, overshoots too; no chunk
    follows it.)"""
    prompt, max_tokens, k = 40, 10, 3
    ends = turns_ended_past_their_tokens(OVERSHOOT)
    assert list(ends) == ["0-session"]
    (_, num_tokens, computed), second = ends["0-session"]   # its second turn (the last) too
    assert num_tokens == prompt + max_tokens
    assert computed == prompt + 3 * (1 + k)   # three decode steps, each of 1 + k positions
    divs = replay_file(OVERSHOOT, device="cpu", worker=0).divergences
    assert divs and {(d.req, d.kind) for d in divs} == {("0-session", "kv-content")}
    assert f"(position {num_tokens})" in divs[0].recorded
    assert replay_file(OVERSHOOT, device=None, worker=0).divergences == []


def test_vllm_own_scheduler_counts_the_cut_drafts_the_same_way(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this finding is checked against vLLM's scheduler")
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    out = tmp_path / "vllm.jsonl"
    assert replay_through_vllm(OVERSHOOT, out).faithful_inputs
    assert diff_files(OVERSHOOT, out).divergences == []
