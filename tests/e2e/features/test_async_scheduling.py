"""Async scheduling: traces of vLLM's ``AsyncScheduler``, recorded from a real
engine (traces/async-*.jsonl.gz, traces/README.md), replay through the
reference with no divergence, and what that needs is worked out here from the
recordings themselves: steps scheduled while earlier ones are in flight, output
placeholders inside num_computed_tokens, and KV written for tokens that an
output brings only later."""

from __future__ import annotations

import pytest

from kvtrace.replay import replay_file
from kvtrace.replay.kv_content.check import ContentCheck
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

from tests._paths import REPO
from tests.mini_traces import load_records, save_records

TRACES = REPO / "traces"
ASYNC = sorted(TRACES.glob("async-*.jsonl.gz"))
byname = pytest.mark.parametrize("path", ASYNC, ids=lambda p: p.name)


def _scheduled(rec: dict) -> list[dict]:
    return [*rec.get("new", ()), *rec.get("resumed", ()), *rec.get("running", ())]


def _in_flight(records: list[dict]):
    """Per step record: (its index, {req: recorded steps scheduling it, this one
    included, whose output is not recorded yet}), worked out from the order of
    the records alone."""
    pending: dict[int, list[str]] = {}
    for i, rec in enumerate(records):
        if rec["kind"] == "step":
            ids = [s["req"] for s in _scheduled(rec)]
            if ids:
                pending[rec["step"]] = ids
            counts: dict[str, int] = {}
            for reqs in pending.values():
                for q in reqs:
                    counts[q] = counts.get(q, 0) + 1
            yield i, counts
        elif rec["kind"] == "output":
            pending.pop(rec["step"], None)


def _placeholders(records: list[dict]):
    """Per step record: (its index, {req: output placeholders it held when the
    step was scheduled}), worked out from the records alone: one per earlier step
    whose output is not recorded yet and that samples for it. A step samples
    for a request unless its chunk stops short of the request's tokens and
    placeholders (a prefill chunk); a preemption zeroes them."""
    pending: dict[int, list[str]] = {}
    for i, rec in enumerate(records):
        if rec["kind"] == "step":
            for step in pending:
                pending[step] = [q for q in pending[step] if q not in rec["preempted"]]
            held: dict[str, int] = {}
            for reqs in pending.values():
                for q in reqs:
                    held[q] = held.get(q, 0) + 1
            states = {st["req"]: st for st in rec["states"]}
            pending[rec["step"]] = [
                s["req"] for s in _scheduled(rec)
                if states[s["req"]]["num_computed_tokens"] >= states[s["req"]]["num_tokens"]
                + held.get(s["req"], 0)]
            yield i, held
        elif rec["kind"] == "output":
            pending.pop(rec["step"], None)


def test_there_are_async_traces():
    assert len(ASYNC) >= 2


@byname
def test_the_engine_scheduled_steps_while_others_were_in_flight(path):
    records = load_records(path)
    f = records[0]["features"]
    assert f["async_scheduling"] is True and f["scheduler_cls"].endswith(".AsyncScheduler")
    steps = [r for r in records if r["kind"] == "step" and _scheduled(r)]
    overlapped = [counts for _, counts in _in_flight(records) if any(n > 1 for n in counts.values())]
    assert len(overlapped) > len(steps) // 2


@byname
def test_async_traces_replay_with_no_divergence_and_their_kv_checked(path):
    res = replay_file(path, device="cpu", worker=0)
    assert res.divergences == [] and res.stopped is None
    assert res.slots_checked > 0


@byname
def test_read_as_synchronous_the_trace_breaks_where_a_step_ran_ahead_of_an_output(path, tmp_path):
    """A synchronous engine never schedules a request whose computed tokens
    already cover every token it has: the first step record that does so is
    where a synchronous reading of the recording must part from it (its line:
    the output records in between carry their own, earlier, step numbers)."""
    records = load_records(path)
    tokens: dict[str, int] = {}
    ahead = None   # the line of that step record (the header is line 1)
    for line, rec in enumerate(records, 1):
        if rec["kind"] == "arrival":
            tokens[rec["req"]] = len(rec["prompt_token_ids"])
        elif rec["kind"] in ("step", "output"):
            if rec["kind"] == "step" and ahead is None:
                if any(s["num_computed_tokens"] >= tokens[s["req"]] for s in _scheduled(rec)):
                    ahead = line
            for st in rec["states"]:
                tokens[st["req"]] = st["num_tokens"]
    assert ahead is not None
    records[0]["features"]["async_scheduling"] = False
    sync = replay_file(save_records(records, tmp_path / "sync.jsonl"), device=None)
    assert sync.divergences and min(d.line for d in sync.divergences) == ahead


@byname
def test_the_content_check_takes_each_output_before_the_steps_that_follow_it(path):
    """Step N+1 writes the KV of the token step N samples; the check must hold
    it until that output is in. Fed in the recorded order without holding, the
    check finds slots never written."""
    found = {}
    for hold in (False, True):
        with TraceReader(path) as reader:
            check = ContentCheck(reader.header.config, "cpu", async_scheduling=hold)
            results, _ = _feed(check, reader)
            found[hold] = ([d for _, ds in results for d in ds], check.slots_checked)
            tables = check.tables
    assert found[True] == ([], found[True][1]) and found[True][1] > 0
    assert any("never written" in str(d.recorded) for d in found[False][0])
    assert tables == {}   # every request finished: the check holds nothing for it


def _feed(check, reader, drop=lambda e: False):
    """Give a trace's events to a ContentCheck; returns its results, and the
    most steps it held at once."""
    results, held = [], 0
    for e in reader:
        if drop(e):
            continue
        if isinstance(e, ev.Arrival):
            check.arrival(e)
        elif isinstance(e, ev.Step):
            results += check.step(e, reader.last_line)
        elif isinstance(e, ev.Output):
            check.output(e)
        elif isinstance(e, ev.Abort):
            check.abort(e.reqs)
        held = max(held, len(check._held))
    return results + check.flush(), held


def test_a_missing_output_holds_the_check_back_only_so_far():
    """An output that never comes (an engine error path) must not hold every
    later step back: past MAX_HELD steps the oldest goes on without it."""
    path = TRACES / "async-preemption.jsonl.gz"
    with TraceReader(path) as reader:
        steps = sum(isinstance(e, ev.Step) for e in reader)
    with TraceReader(path) as reader:
        check = ContentCheck(reader.header.config, "cpu", async_scheduling=True)
        results, held = _feed(check, reader, lambda e: isinstance(e, ev.Output) and e.step == 5)
    assert held == ContentCheck.MAX_HELD < steps
    assert len(results) == steps
    with TraceReader(path) as reader:   # with every output, a step or two at most
        _, held = _feed(ContentCheck(reader.header.config, "cpu", async_scheduling=True), reader)
    assert held <= 2


I1_ASYNC = "I1: c <= T + output placeholders of the steps in flight after schedule()"


def test_each_sampling_step_in_flight_allows_one_placeholder_and_no_more(tmp_path):
    """I1 under async scheduling: each step in flight that samples for a
    request holds an output placeholder, and a step may compute up to the
    request's tokens and those placeholders: c <= T + placeholders. Find a
    state the recording puts exactly at that bound with one placeholder held,
    then push it one past."""
    path = TRACES / "async-preemption.jsonl.gz"
    records = load_records(path)
    at = None   # the last state at the bound: the counts must also come down as outputs come
    for i, held in _placeholders(records):
        for k, st in enumerate(records[i]["states"]):
            allowed = held.get(st["req"], 0)
            if allowed >= 1 and st["num_computed_tokens"] == st["num_tokens"] + allowed:
                at = (i, k, records[i]["step"], st["req"])
    assert at is not None, "the recording should reach the bound with a placeholder held"
    i, k, step, req = at
    records[i]["states"][k]["num_computed_tokens"] += 1
    divs = replay_file(save_records(records, tmp_path / "over.jsonl"), device=None).divergences
    assert [(d.step, d.req) for d in divs if d.rule == I1_ASYNC] == [(step, req)]


def test_a_prefill_chunk_in_flight_holds_no_placeholder(tmp_path):
    """A step whose chunk stops short of the request's tokens samples nothing,
    so it gives the steps after it no room past T. Find a request scheduled
    while only such a step of its own is in flight, and push that state one
    past T: an I1 divergence, where counting every step in flight would allow it."""
    path = TRACES / "async-preemption.jsonl.gz"
    records = load_records(path)
    at = None
    for (i, held), (_, scheduling) in zip(_placeholders(records), _in_flight(records)):
        for k, st in enumerate(records[i]["states"]):
            q = st["req"]
            if (scheduling.get(q, 0) >= 2 and held.get(q, 0) == 0
                    and st["num_computed_tokens"] == st["num_tokens"]):
                at = (i, k, records[i]["step"], q)
    assert at is not None, "the recording should schedule a request behind its own prefill chunk"
    i, k, step, req = at
    records[i]["states"][k]["num_computed_tokens"] += 1
    divs = replay_file(save_records(records, tmp_path / "over.jsonl"), device=None).divergences
    assert [(d.step, d.req) for d in divs if d.rule == I1_ASYNC] == [(step, req)]


def test_an_abort_while_its_step_is_in_flight_leaves_that_step_s_writes(tmp_path):
    """Request a is aborted while its prefill chunk is in flight; b, admitted
    after the abort, hits the blocks that chunk fills (they were cached when
    allocated, 4.3). The engine runs a's step before b's, so the KV b reads is
    right, and the content check must take the abort only after a's step."""
    from dataclasses import replace

    from kvtrace.engine import record_workload
    from kvtrace.engine.workloads import PlannedAbort, PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    shared = tuple(range(10, 42))   # 8 blocks of 4
    cfg = SchedulerConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                          max_model_len=128, async_scheduling=True)
    wl = Workload("abort-in-flight", cfg,
                  arrivals=(PlannedArrival(0, "a", shared + (100, 101, 102), 4),
                            PlannedArrival(0, "b", shared + (200, 201, 202), 4)),
                  aborts=(PlannedAbort(1, "a"),), vocab_size=1000)
    path = tmp_path / "t.jsonl"
    record_workload(path, wl)
    records = load_records(path)
    # From the recording: the abort comes while a step that wrote a's blocks has
    # no output yet, and b is later admitted on a hit into those blocks.
    at = next(i for i, r in enumerate(records) if r["kind"] == "abort")
    outputs_before = {r["step"] for r in records[:at] if r["kind"] == "output"}
    in_flight = [r for r in records[:at] if r["kind"] == "step" and r["step"] not in outputs_before
                 and any(s["req"] == "a" for s in _scheduled(r))]
    assert in_flight
    a_blocks = {b for r in records[:at] if r["kind"] == "step"
                for s in r["new"] + r["running"] if s["req"] == "a"
                for b in s.get("block_ids", s.get("new_block_ids", []))}
    written = {b for s in in_flight[-1]["running"] + in_flight[-1]["new"] if s["req"] == "a"
               for b in s.get("block_ids", s.get("new_block_ids", []))}
    admitted = [s for r in records[at:] if r["kind"] == "step" for s in r["new"] if s["req"] == "b"]
    assert admitted and admitted[0]["num_computed_tokens"] > 0
    assert written & set(admitted[0]["block_ids"]) and written <= a_blocks
    for worker in (0, 1):
        res = replay_file(path, device="cpu", worker=worker)
        assert res.divergences == [] and res.slots_checked > 0
    # the same workload, synchronous, as a control
    sync = tmp_path / "sync.jsonl"
    record_workload(sync, replace(wl, config=replace(cfg, async_scheduling=False)))
    assert replay_file(sync, device="cpu").divergences == []


def test_an_id_reused_right_after_its_last_output_is_a_new_request(tmp_path):
    """A's finishing output is held (the step after it is still in flight) when
    a new request arrives with the same id: the check must take the output, and
    forget the first A, before the arrival."""
    from kvtrace.engine import record_workload
    from kvtrace.engine.workloads import PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    cfg = SchedulerConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                          max_model_len=128, async_scheduling=True)
    wl = Workload("reuse", cfg, (PlannedArrival(0, "A", tuple(range(1000, 1006)), 1),
                                 PlannedArrival(2, "A", tuple(range(2000, 2006)), 2)),
                  vocab_size=3000)
    path = tmp_path / "t.jsonl"
    record_workload(path, wl)
    records = load_records(path)
    kinds = [(r["kind"], r.get("req")) for r in records]
    second = [i for i, k in enumerate(kinds) if k == ("arrival", "A")][1]
    finished = [i for i, r in enumerate(records) if r["kind"] == "output" and "A" in r.get("finished", {})]
    assert finished and finished[0] < second   # A finished, then A arrives again
    for worker in (0, 1):
        res = replay_file(path, device="cpu", worker=worker)
        assert res.divergences == [] and res.slots_checked > 0


def test_the_worker_counts_the_slots_checked_as_one_process_does(tmp_path):
    """Cut where the last step still has work in flight: the steps the check
    held until the end count the same either way."""
    records = load_records(TRACES / "async-preemption.jsonl.gz")
    steps = [i for i, r in enumerate(records) if r["kind"] == "step" and _scheduled(r)]
    cut = save_records(records[: steps[len(steps) * 3 // 4] + 1], tmp_path / "cut.jsonl")
    one, two = (replay_file(cut, device="cpu", worker=w) for w in (0, 1))
    assert one.truncation is not None and one.slots_checked > 0
    assert (two.slots_checked, two.divergences) == (one.slots_checked, one.divergences)


def test_the_summary_names_the_step_where_the_fault_is_not_an_output_read_after_it(tmp_path):
    """Under async scheduling the output of step N follows the record of step
    N+1 and shows the states step N+1 left, so a fault at step N+1 (here a
    preemption that keeps the request's computed tokens) shows in an output
    numbered lower. Every view names step N+1's divergence first, not the
    output's lower step: the replay of this trace alone, and of it beside
    another."""
    import os
    import subprocess
    import sys

    from kvtrace.findings import gather

    path = TRACES / "faults" / "async-stale-computed-on-preempt.jsonl.gz"
    res = replay_file(path, device=None)
    head = gather(res.divergences).headline
    # The divergences numbered with an earlier step are in records read after the headline's.
    lower = [d for d in res.divergences if d.step is not None and d.step < head.step]
    assert lower and all(d.seq > head.seq for d in lower)
    # The headline's step is the one that preempted its request.
    step = next(r for r in load_records(path) if r["kind"] == "step" and r["step"] == head.step)
    assert head.req in step["preempted"]
    said = f"first at step {head.step}, request {head.req}, field {head.field}"
    env = {**os.environ, "COLUMNS": "400"}
    for args in ([str(path)], [str(TRACES / "preemption.jsonl.gz"), str(path)]):
        out = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--no-kv-check", *args],
                             capture_output=True, text=True, env=env).stdout
        assert said in out, (args, out[-2000:])
        assert f"first at step {min(d.step for d in lower)}," not in out


def test_a_step_in_flight_for_a_request_that_stopped_leaves_nothing_behind(tmp_path):
    """A request that stops on a sampled token (EOS) has its next step already
    scheduled: when that step is checked the request is gone, and the check
    keeps no table for it (memory follows the live requests)."""
    from kvtrace.engine import record_workload
    from kvtrace.engine.workloads import PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    cfg = SchedulerConfig(block_size=4, num_blocks=128, max_num_batched_tokens=64, max_num_seqs=8,
                          max_model_len=128, async_scheduling=True)
    arrivals = tuple(PlannedArrival(i, f"r{i}", tuple(range(100 * i + 10, 100 * i + 30)), 40)
                     for i in range(8))
    path = tmp_path / "t.jsonl"
    record_workload(path, Workload("eos", cfg, arrivals, vocab_size=1000, eos_probability=0.2))
    records = load_records(path)
    stopped = {}   # request -> line of the output that stopped it
    for line, r in enumerate(records, 1):
        if r["kind"] == "output":
            for req, why in r.get("finished", {}).items():
                if why == "stop":
                    stopped[req] = (line, r["step"])
    # a step after the stopping one, recorded before that output, scheduled it
    ahead = [req for line, r in enumerate(records, 1) if r["kind"] == "step"
             for req in (s["req"] for s in _scheduled(r))
             if req in stopped and r["step"] > stopped[req][1] and line < stopped[req][0]]
    assert ahead
    with TraceReader(path) as reader:
        check = ContentCheck(reader.header.config, "cpu", async_scheduling=True)
        results, _ = _feed(check, reader)
    assert [d for _, ds in results for d in ds] == [] and check.slots_checked > 0
    assert check.tables == {}


def test_a_failed_block_of_a_request_gone_before_the_worker_runs(tmp_path):
    """Under async scheduling the embedded store's worker runs a step after the
    load was planned; a request aborted meanwhile no longer holds the block that
    was to fail (found by the differential test: it used to raise IndexError)."""
    from kvtrace.engine import record_workload
    from kvtrace.engine.kv_store import StoreSettings
    from kvtrace.engine.workloads import PlannedAbort, PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    cfg = SchedulerConfig(block_size=1, num_blocks=6, max_num_batched_tokens=8, max_num_seqs=1,
                          max_model_len=5, enable_prefix_caching=False, policy="priority",
                          load_failure_policy="recompute", async_scheduling=True)
    arrivals = (PlannedArrival(0, "q0", (4,), 1, 2), PlannedArrival(0, "q1", (15, 10, 8, 14), 1, 1),
                PlannedArrival(4, "q2", (6, 14, 8), 1, 0), PlannedArrival(6, "q3", (15, 10, 8, 14), 1, 1),
                PlannedArrival(7, "q4", (6, 14, 9, 18), 1, 1))
    store = StoreSettings(capacity_tokens=2112, preload=((15, 10, 8, 14), (6, 14)), min_hit_tokens=1,
                          async_delay_steps=2, failed_recving_fraction=0.4,
                          invalid_blocks_fraction=0.5, late_failure_fraction=0.5,
                          kv_role="kv_producer")
    wl = Workload("random-436", cfg, arrivals, (PlannedAbort(1, "q1"),), store, 19)
    path = tmp_path / "t.jsonl"
    record_workload(path, wl, seed=0)
    assert replay_file(path, device="cpu").divergences == []


# --------------------------------------------------------------------------- vLLM's own bug

BUG = TRACES / "vllm-bugs" / "async-recompute-placeholders.jsonl.gz"


def test_vllm_bug_recompute_under_async_scheduling_is_flagged_where_it_bites():
    """vLLM 0.32's AsyncScheduler, unchanged, with a KV connector whose sync load
    fails at block level under the "recompute" policy (upstream issues 45138 and
    49250). The failure truncates the request's num_computed_tokens but keeps
    the output placeholders of its steps in flight, one of which the failure
    discards: the next step that schedules it computes a position that no
    token will ever fill, and the engine then fails on it. Where that happens
    is worked out here from the records alone: after the output that reports
    the failed block, the first step scheduling the request that held it leaves
    num_computed_tokens above num_tokens + its output placeholders."""
    records = load_records(BUG)
    end = records[-1]
    assert end["kind"] == "end" and end["status"] == "interrupted" and "IndexError" in end["error"]

    failed_at = next(i for i, r in enumerate(records) if r["kind"] == "output"
                     and r["connector"] and r["connector"]["invalid_block_ids"])
    bad = set(records[failed_at]["connector"]["invalid_block_ids"])
    holder = next(st["req"] for r in reversed(records[:failed_at]) if r["kind"] == "step"
                  for st in r["states"] if bad & set(st["block_ids"]))
    where = None
    for i, held in _placeholders(records):
        rec = records[i]
        if i > failed_at and holder in (s["req"] for s in _scheduled(rec)):
            st = next(s for s in rec["states"] if s["req"] == holder)
            assert st["num_computed_tokens"] > st["num_tokens"] + held.get(holder, 0)
            where = rec["step"]
            break
    assert where is not None

    res = replay_file(BUG, device="cpu", worker=0)
    assert [(d.step, d.req, d.field, d.kind) for d in res.divergences] == [
        (where, holder, "state.num_computed_tokens", "invariant")]
    assert res.divergences[0].rule.startswith("I1")


STALE = TRACES / "vllm-bugs" / "async-failed-load-stale-token.jsonl.gz"


def test_vllm_bug_a_token_sampled_from_unloaded_kv_is_kept_and_flagged():
    """vLLM 0.32's AsyncScheduler, unchanged (upstream issues 45138 and 49250):
    a sync load fails at block level, reported by the output of the step that
    admitted the request, while the next step, which samples the request's
    first token from that unloaded KV, is in flight. vLLM truncates the count
    but keeps that token: a silently wrong output, and the run goes on. Worked
    out here from the records alone: the steps scheduled before the failure
    was reported and whose output came after it, and the tokens those outputs
    kept for the request that held the failed block."""
    records = load_records(STALE)
    assert records[-1]["status"] == "complete"
    failed_at = next(i for i, r in enumerate(records) if r["kind"] == "output"
                     and r["connector"] and r["connector"]["invalid_block_ids"])
    bad = set(records[failed_at]["connector"]["invalid_block_ids"])
    holder = next(st["req"] for st in records[failed_at]["states"] if bad & set(st["block_ids"]))
    before = {r["step"] for r in records[:failed_at] if r["kind"] == "step"
              and holder in (s["req"] for s in _scheduled(r))}
    answered = {r["step"] for r in records[:failed_at] if r["kind"] == "output"}
    in_flight = before - answered - {records[failed_at]["step"]}
    tokens = {}   # the holder's token count as each record leaves it
    kept = []
    for r in records:
        st = next((s for s in r.get("states", ()) if s["req"] == holder), None)
        if st is None:
            continue
        if (r["kind"] == "output" and r["step"] in in_flight and r["sampled"].get(holder)
                and st["num_tokens"] > tokens[holder]):
            kept.append((r["step"], st["num_tokens"], tokens[holder]))
        tokens[holder] = st["num_tokens"]
    assert len(kept) == 1

    res = replay_file(STALE, device="cpu", worker=0)
    assert [(d.step, d.req, d.field, d.recorded, d.expected, d.kind) for d in res.divergences] == [
        (step, holder, "num_tokens", n, was, "invariant") for step, n, was in kept]

