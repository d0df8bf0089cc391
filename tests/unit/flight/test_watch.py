"""The invariants a flight recorder checks on each record with no reference
(``kvtrace.flight.watch``): silent on every correct run, stored or embedded,
and each finding one the whole replay makes too; firing on faulty runs and
on a block handed out twice or counted free while held."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvtrace.engine import record_embedded
from kvtrace.engine.workloads import WORKLOADS
from kvtrace.flight.watch import Watch, broken_at
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

TRACES = Path(__file__).resolve().parents[3] / "traces"
STORED = sorted(TRACES.rglob("*.jsonl*"))


def watched(path: Path) -> list:
    with TraceReader(path) as r:
        w = Watch(r.header)
        found = []
        for e in r:
            found += w.feed(e)
    return found


def _agree_with_the_replay(path: Path, found: list) -> None:
    """Each finding is one the whole replay makes: same step, same request."""
    replayed = {(d.step, d.req) for d in replay_file(path, device=None).divergences}
    assert [broken_at(d) for d in found if (d.step, d.req) not in replayed] == []


def test_on_every_stored_trace_the_watch_finds_only_what_the_replay_finds():
    fired = {}
    for path in STORED:
        found = watched(path)
        if found:
            fired[path.relative_to(TRACES).as_posix()] = found
    # The traces of engine bugs whose counts show them by themselves.
    assert {"vllm-bugs/async-recompute-placeholders.jsonl.gz",
            "faults/stale-computed-on-preempt.jsonl.gz",
            "data-path/negative-external-hit.jsonl.gz"} <= set(fired)
    for name, found in fired.items():
        _agree_with_the_replay(TRACES / name, found)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_a_correct_embedded_run_breaks_no_invariant(workload, tmp_path):
    path = tmp_path / "run.jsonl"
    record_embedded(path, workload, None, seed=1)
    assert [broken_at(d) for d in watched(path)] == []


@pytest.mark.parametrize("workload, fault, rule", [
    ("kv-pressure", "stale-computed-after-failed-schedule", "4.5"),
    ("load-failures", "negative-external-on-invalid-blocks", "L2"),
    ("offload", "no-reload-after-preempt", "I9"),
])
def test_a_faulty_embedded_run_breaks_one_and_the_replay_agrees(workload, fault, rule, tmp_path):
    path = tmp_path / "run.jsonl"
    record_embedded(path, workload, fault, seed=0)
    found = watched(path)
    assert any(d.rule.startswith(rule) for d in found)
    _agree_with_the_replay(path, found)


def _step_with_two_tables(events):
    """A step record where two requests hold blocks, and its index."""
    for i, e in enumerate(events):
        if type(e) is ev.Step:
            held = [s for s in e.states if len(s.block_ids) >= 2]
            if len(held) >= 2:
                return i, held
    raise AssertionError("no step with two tables")


def _watch_changed(change) -> list:
    with TraceReader(TRACES / "preemption.jsonl.gz") as r:
        header, events = r.header, list(r)
    i, held = _step_with_two_tables(events)
    events[i] = copy.deepcopy(events[i])
    change(events[i])
    w = Watch(header)
    found = []
    for e in events[:i + 1]:
        found += w.feed(e)
    return found


def test_a_block_at_two_positions_is_handed_out_twice():
    def twice(rec):
        a, b = [s for s in rec.states if len(s.block_ids) >= 2][:2]
        b.block_ids[1] = a.block_ids[0]   # position 0 in a, 1 in b

    found = _watch_changed(twice)
    assert [d.rule.split(":")[0] for d in found] == ["4.5"]
    assert "holds it at position 0" in found[0].expected


def test_a_block_past_a_requests_tokens_is_shared_by_no_hit():
    def shared_tail(rec):
        # a's last block, partly filled (its tokens end inside it), at the same
        # position in b's table: where only a hit could share it, and no hit can.
        states = [s for s in rec.states if len(s.block_ids) >= 2]
        a, b = next((a, b) for a in states for b in states
                    if a is not b and len(b.block_ids) >= len(a.block_ids)
                    and a.num_tokens < len(a.block_ids) * 32)
        b.block_ids[len(a.block_ids) - 1] = a.block_ids[-1]

    found = _watch_changed(shared_tail)
    assert found and found[0].rule.startswith("4.5")
    assert "past" in found[0].expected


def test_more_blocks_held_and_free_than_the_pool_holds():
    def free_too_many(rec):   # every block but the null one free, while blocks are held
        rec.num_free_blocks = 15

    assert _watch_changed(lambda rec: None) == []
    found = _watch_changed(free_too_many)
    assert [d.rule.split(":")[0] for d in found] == ["B5"]
