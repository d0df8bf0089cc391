"""A step's work does not grow with the waiting queue: counted in lines of Python
run (sys.settrace), not timed. Requests wait from their arrival until a step
schedules them, and a trace whose arrivals outrun the engine holds thousands."""

from __future__ import annotations

import sys

from kvtrace.reference import Request, Scheduler, SchedulerConfig, Status
from kvtrace.replay.kv_content.device import open_shadow

B = 4


def _lines_run(work) -> int:
    """How many lines of Python ``work()`` runs."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(None)
    return count


def _shadow_serving(idle: int) -> int:
    """The shadow cache serving 40 requests two at a time (prefill, six decodes,
    drop), with ``idle`` requests added before and never scheduled: the lines
    run by the serving alone."""
    s = open_shadow(64, B, "numpy")
    for i in range(idle):
        s.add_request(f"idle-{i}", list(range(100, 108)), most=20)

    def serve():
        step, block = 0, 0
        for pair in range(20):
            reqs = [f"r{2 * pair}", f"r{2 * pair + 1}"]
            tables = {}
            for r in reqs:
                s.add_request(r, [7 + pair] * 8, most=14)
                tables[r] = [block % 64, (block + 1) % 64, (block + 2) % 64, (block + 3) % 64]
                block += 4
            s.queue(step, [], [(r, 0, 8, tables[r]) for r in reqs])
            for d in range(6):
                step += 1
                for r in reqs:
                    s.append_tokens(r, [50 + d])
                s.queue(step, [], [(r, 8 + d, 1, tables[r]) for r in reqs])
            for r in reqs:
                s.append_tokens(r, [60])
                s.drop_request(r)
            step += 1
        assert all(not divs for _, divs in s.flush())

    return _lines_run(serve)


def test_the_shadow_checks_a_step_in_the_same_work_whatever_waits():
    # Waiting requests get their room in the arena, and their fingerprints, when
    # a step first uses them; until then no batch, compaction or fingerprint
    # pass goes through them.
    assert _shadow_serving(idle=2000) == _shadow_serving(idle=0)


def _abort_one_waiting(queue_length: int) -> int:
    config = SchedulerConfig(block_size=B, num_blocks=16, max_num_batched_tokens=64,
                             max_num_seqs=8, max_model_len=128)
    s = Scheduler(config)
    for i in range(queue_length):
        s.add_request(Request(f"w{i}", [1, 2, 3, 4, 5], max_tokens=4, block_size=B))
    victim = f"w{queue_length - 1}"
    lines = _lines_run(lambda: s.finish_requests([victim], Status.FINISHED_ABORTED))
    assert victim not in s.requests and len(s.waiting) == queue_length - 1
    return lines


def test_an_abort_of_a_waiting_request_costs_the_same_whatever_waits():
    assert _abort_one_waiting(2000) == _abort_one_waiting(10)


def test_the_waiting_queue_keeps_fcfs_order_through_prepends_and_removals():
    from kvtrace.reference.queues import FCFSQueue

    rs = [Request(f"q{i}", [1], max_tokens=1, block_size=B) for i in range(7)]
    q = FCFSQueue()
    for r in rs[:4]:
        q.add(r)
    q.prepend(rs[4])
    q.prepend_all([rs[5], rs[6]])          # as deque.extendleft: the last ends up first
    assert [r.request_id for r in q] == ["q6", "q5", "q4", "q0", "q1", "q2", "q3"]
    q.remove_all({rs[0], rs[5]})
    assert q.peek() is rs[6] and q.pop_request() is rs[6]
    assert [r.request_id for r in q] == ["q4", "q1", "q2", "q3"] and len(q) == 4 and q
    while q:
        q.pop_request()
    assert not q and len(q) == 0
