"""Liveness: a scheduler that holds a ready request but schedules nothing, step
after step, is stuck, whatever its counters say.

A request is ready when it waits in a waiting queue and is not waiting for an
async KV load that is still in flight. After ``STALL_STEPS`` consecutive steps
with nothing scheduled and a ready request waiting, replay reports one
``progress`` divergence (per stall). Engines that wait on in-flight loads, or
that are simply idle, are not flagged.
"""

from __future__ import annotations

from kvtrace.findings import Divergence
from kvtrace.reference import Scheduler, SchedulerOutput, Status

STALL_STEPS = 64


class ProgressWatch:
    def __init__(self, limit: int = STALL_STEPS):
        self.limit = limit
        self.idle = 0          # consecutive steps with a ready request and nothing scheduled
        self.since: int | None = None

    def after_schedule(self, step: int, out: SchedulerOutput, sched: Scheduler,
                       seq: int | None, line: int | None) -> list[Divergence]:
        head = None if out.num_scheduled_tokens else _ready_head(sched)
        if head is None:
            self.idle, self.since = 0, None
            return []
        if self.since is None:
            self.since = step
        self.idle += 1
        if self.idle != self.limit:
            return []
        free = sched.kv.pool.num_free_blocks
        reserved = sum(sched.kv.remaining_blocks(r) for r in sched.inflight_prefills)
        return [Divergence(
            step, head.request_id, "progress",
            f"nothing scheduled for {self.limit} steps since step {self.since}",
            "a ready request is admitted or the engine has no room",
            f"liveness: {head.request_id} is ready at the head of the waiting queue with "
            f"{free} free blocks ({reserved} reserved for in-flight prefills"
            f"{', itself included' if head in sched.inflight_prefills else ''})",
            "invariant", seq, line)]


def _ready_head(sched: Scheduler):
    """The request the waiting pass would try first, if one is ready."""
    for queue in (sched.kv_holding_waiting, sched.waiting):
        for r in queue:
            if r.status != Status.WAITING_FOR_REMOTE_KVS or r.request_id in sched.finished_recving_ids:
                return r
    return None
