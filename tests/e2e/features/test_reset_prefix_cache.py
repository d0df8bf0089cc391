"""``reset_prefix_cache``: a record of its own (trace format 3.2a), replayed by
the reference and compared by diff. The embedded engine plans resets; what
each test expects is read from the recording, or worked out by hand."""

from __future__ import annotations

import random

from kvtrace.diff import diff_files
from kvtrace.engine import record_workload
from kvtrace.engine.kv_store import StoreSettings
from kvtrace.engine.workloads import PlannedAbort, PlannedArrival, PlannedReset, Workload
from kvtrace.reference import SchedulerConfig
from kvtrace.replay import replay_file

from tests.mini_traces import load_records, save_records

RULE = "4.5: the prefix cache is reset only when no block is in use"


def _workload(resets, store=None, async_scheduling=True) -> Workload:
    cfg = SchedulerConfig(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4,
                          max_model_len=128, async_scheduling=async_scheduling)
    rng = random.Random(1)
    shared = tuple(rng.randrange(10, 1000) for _ in range(12))
    arrivals = tuple(PlannedArrival(i, f"q{i}", shared + tuple(rng.randrange(10, 1000) for _ in range(5)),
                                    12) for i in range(5))
    return Workload("resets", cfg, arrivals, (PlannedAbort(6, "q1"),), store, 1000, resets=resets)


def _resets(records):
    return [(i, r) for i, r in enumerate(records) if r["kind"] == "reset_prefix_cache"]


def test_a_reset_that_fails_with_every_running_request_preempted(tmp_path):
    """With a consumer connector under async scheduling, a preempted request's
    blocks wait for its steps in flight (defer_block_free): the reset preempts
    the running requests and still fails (vLLM raises to its caller after the
    preemptions; the engine goes on)."""
    store = StoreSettings(capacity_tokens=500, async_fraction=0.5, kv_role="kv_both")
    path = tmp_path / "t.jsonl"
    record_workload(path, _workload((PlannedReset(3, True),), store))
    records = load_records(path)
    [(at, reset)] = _resets(records)
    status = {}   # each request's last recorded status before the reset
    for r in records[:at]:
        for st in r.get("states", ()):
            status[st["req"]] = st["status"]
    running = {q for q, s in status.items() if s == "RUNNING"}
    last_step = max(r["step"] for r in records[:at] if r["kind"] == "step")
    in_flight = not any(r["kind"] == "output" and r["step"] == last_step for r in records[:at])
    assert records[0]["features"]["defer_block_free"] is True and in_flight
    assert running and reset["reset_running_requests"] is True
    assert reset["succeeded"] is False and records[-1]["status"] == "complete"
    after = next(r for r in records[at:] if r["kind"] == "step")
    assert set(after["preempted"]) == running
    assert replay_file(path, device="cpu").divergences == []

    # The recording claims success: the reference, whose deferred frees still
    # hold the blocks, says otherwise, at the reset's line.
    records[at]["succeeded"] = True
    divs = replay_file(save_records(records, tmp_path / "claims.jsonl"), device=None).divergences
    [d] = [d for d in divs if d.field == "reset_prefix_cache.succeeded"]
    assert (d.recorded, d.expected, d.rule, d.line) == (True, False, RULE, at + 1)
    # With the connector's cache reset too, a recorded failure may be the
    # connector's own answer: not a divergence; a recorded success still is.
    records[at]["reset_connector"] = True
    divs = replay_file(save_records(records, tmp_path / "c1.jsonl"), device=None).divergences
    assert [d.field for d in divs if d.field == "reset_prefix_cache.succeeded"] == \
        ["reset_prefix_cache.succeeded"]
    records[at]["succeeded"] = False
    divs = replay_file(save_records(records, tmp_path / "c2.jsonl"), device=None).divergences
    assert divs == []


def test_a_reset_with_nothing_in_use_empties_the_cache(tmp_path):
    """Worked by hand: five prompts share 12 tokens (three blocks of 4). A reset
    while nothing runs succeeds, and the request after it finds no hit."""
    cfg = SchedulerConfig(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4,
                          max_model_len=128)
    shared = tuple(range(100, 112))
    arrivals = (PlannedArrival(0, "a", shared + (1, 2), 2), PlannedArrival(10, "b", shared + (3, 4), 2),
                PlannedArrival(20, "c", shared + (5, 6), 2))
    path = tmp_path / "t.jsonl"
    record_workload(path, Workload("r", cfg, arrivals, resets=(PlannedReset(15),), vocab_size=1000))
    records = load_records(path)
    [(at, reset)] = _resets(records)
    assert reset["succeeded"] is True
    admitted = {s["req"]: s["num_computed_tokens"] for r in records if r["kind"] == "step"
                for s in r["new"]}
    assert admitted == {"a": 0, "b": 12, "c": 0}   # b hits a's three blocks; c hits nothing
    assert replay_file(path, device="cpu").divergences == []
    # Without the reset record the reference expects c's hit.
    cut = save_records(records[:at] + records[at + 1:], tmp_path / "cut.jsonl")
    divs = replay_file(cut, device=None).divergences
    assert divs and divs[0].req == "c"


def test_diff_compares_the_resets_of_two_traces(tmp_path):
    path = tmp_path / "a.jsonl"
    record_workload(path, _workload((PlannedReset(3, True), PlannedReset(9, False)),
                                    async_scheduling=False))
    records = load_records(path)
    resets = _resets(records)
    assert len(resets) == 2
    assert diff_files(path, path).divergences == []
    at, second = resets[1]
    flipped = [dict(r) for r in records]
    flipped[at]["reset_running_requests"] = not second["reset_running_requests"]
    b = save_records(flipped, tmp_path / "b.jsonl")
    [d] = [d for d in diff_files(b, path).divergences if d.field == "reset_prefix_cache"]
    assert d.rule == "diff: 2nd prefix-cache reset differs" and d.line == at + 1
    assert d.recorded["reset_running_requests"] != d.expected["reset_running_requests"]
    # a reset one trace does not have
    c = save_records(records[:at] + records[at + 1:], tmp_path / "c.jsonl")
    [d] = [d for d in diff_files(path, c).divergences if d.field == "reset_prefix_cache"]
    assert d.rule == "diff: 2nd prefix-cache reset differs" and d.expected is None
