"""Liveness: a scheduler that holds a ready request but schedules nothing, step
after step, is stuck, whatever its counters say.

A running request that is not scheduled, step after step, while nothing else
is either and the scheduler is not paused for all requests, is stuck as well:
with no step in flight, it waits for a token nothing will bring (vLLM 0.32
after a failed load under async scheduling: an output placeholder that no
output will take back). That is reported the same way, after the same number of steps,
when no waiting request is ready.

A request is ready when it waits in a waiting queue and is not waiting for an
async KV load that is still in flight, for a grammar still compiling nor, as a
streaming-input session, for its next chunk; none is while sessions waiting for input hold the slots of
``max_num_seqs`` that running requests leave (they hold them by design).
After ``STALL_STEPS`` consecutive steps with nothing scheduled and a ready
request waiting, replay reports one ``progress`` divergence (per stall).
Engines that wait on in-flight loads, or that are simply idle, are not flagged.

A request that is looked up and loaded again and again without ever running
is stuck too, whatever the reason: after ``RELOAD_LIMIT`` KV loads since it
was last scheduled, replay reports a ``progress`` divergence for it, with its
loop: the steps of its loads, the tokens each loaded, and which of them failed
(``failed_recving``, or an ``invalid_block_ids`` block in its table). Retrying
a failed load is right; retrying it without end is not. (vLLM 0.32 loops this
way on a one-token prompt with a full async hit: the full-hit rule takes it
back to ``num_computed_tokens`` 0 when its load completes, S:3171-3172, which
starts another lookup and another load. Under the ``recompute`` policy it
loops on a connector that offers the same failing hit at each lookup: the
failed load takes the request back to ``num_computed_tokens`` 0, S:3352, and
the next lookup takes the hit again.)

A request preempted again and again without producing a token may be stuck as
well: once it has been preempted ``PREEMPT_LIMIT`` times since its last sampled
token (or its arrival), replay reports a ``progress`` divergence for it, at the
step of that preemption, unless it samples a token later. Under memory pressure
a request can be preempted that often and still get through (vLLM 0.32 on a
random workload: 16 preemptions, then its tokens), which is thrashing, not a
loop: such a report is taken back when the request samples a token
(``take_back``, which replay applies at the end of the trace). (vLLM 0.32 loops for ever this way with
``scheduler_reserve_full_isl`` off, priority scheduling and chunked long
prefills: docs/findings.md.)

A request the scheduler holds, unfinished, waits in one of its queues (running,
waiting, or waiting with its blocks): nothing else is ever scheduled. An output
puts a request back into a queue in one case, a streaming-input session whose
turn ends, so after each output replay checks that every request whose turn
ended in it, and that has not finished, is in a queue. (vLLM 0.32 under async
scheduling loses a session whose turn ends after it was preempted in the step
scheduled meanwhile: it puts the session back in the waiting queue, then takes
it out with the preempted requests that stopped, S:2296-2300. The engine,
which counts only its queues, goes idle with the session unfinished:
docs/findings.md.)
"""

from __future__ import annotations

from kvtrace.findings import Divergence
from kvtrace.reference import Scheduler, SchedulerOutput, Status

STALL_STEPS = 64
RELOAD_LIMIT = 8
PREEMPT_LIMIT = 16


class ProgressWatch:
    def __init__(self, limit: int = STALL_STEPS, reload_limit: int = RELOAD_LIMIT,
                 preempt_limit: int = PREEMPT_LIMIT):
        self.limit = limit
        self.reload_limit = reload_limit
        self.preempt_limit = preempt_limit
        self.preempted: dict[str, int] = {}   # request -> preemptions since its last sampled token
        # Requests past the preemption limit, with the divergence reported for
        # each; and the reports of those that then sampled a token.
        self.looping: dict[str, Divergence] = {}
        self.got_through: list[Divergence] = []
        self.idle = 0          # consecutive steps with a ready request and nothing scheduled
        self.since: int | None = None
        # request -> its KV loads since it last ran, each [step, start, end, how it failed]
        self.loads: dict[str, list[list]] = {}
        self._sched: Scheduler | None = None

    def after_schedule(self, step: int, out: SchedulerOutput, sched: Scheduler,
                       seq: int | None, line: int | None,
                       loads: list | None = None) -> list[Divergence]:
        """The divergences this step shows; ``loads`` are the KV loads the
        reference's admissions made in it (``KVLoad``)."""
        self._sched = sched
        return (self._reloads(step, out, sched, seq, line, loads or ())
                + self._preemptions(step, out, seq, line)
                + self._stall(step, out, sched, seq, line))

    def after_output(self, failed_recving: set[str], invalid_block_ids: set[int],
                     sampled: dict[str, list[int]] | None = None) -> None:
        """A failed load is noted in its request's loop: a whole load named
        in ``failed_recving``, or a load whose request's table holds one of
        the ``invalid_block_ids``. A sampled token is progress: it starts the
        request's count of preemptions again."""
        for req in failed_recving:
            if self.loads.get(req):
                self.loads[req][-1][3] = "failed_recving"
        if invalid_block_ids and self._sched is not None:
            for req, loads in self.loads.items():
                if loads and not invalid_block_ids.isdisjoint(self._sched.kv.get_block_ids(req)):
                    loads[-1][3] = loads[-1][3] or "invalid blocks"
        for req, tokens in (sampled or {}).items():
            if tokens:
                self.preempted.pop(req, None)
                if req in self.looping:   # it got through: thrashing, not a loop
                    self.got_through.append(self.looping.pop(req))

    def after_update(self, step: int, results: list, sched: Scheduler, seq: int | None,
                     line: int | None) -> list[Divergence]:
        """The requests whose turn ended in this output (``results``, the
        reference's) and that the scheduler still holds, in none of its queues."""
        found = []
        for res in results:
            r = sched.requests.get(res.req_id) if res.finish_reason is not None else None
            if r is None or r.is_finished or _queued(sched, r):
                continue
            found.append(Divergence(
                step, r.request_id, "progress", f"{r.status.name}, in no queue",
                "a request the scheduler holds waits in one of its queues until it finishes",
                f"liveness: the turn of {r.request_id} ended, and no queue holds it (running, "
                "waiting, waiting with its blocks): nothing will schedule it again, and an "
                "engine that counts only its queues goes idle with it unfinished",
                "invariant", seq, line))
        return found

    def take_back(self) -> list[Divergence]:
        """The preemption-loop reports whose request sampled a token after all
        (each once)."""
        found, self.got_through = self.got_through, []
        return found

    def _preemptions(self, step, out, seq, line) -> list[Divergence]:
        found = []
        for req in sorted(out.preempted_req_ids):
            n = self.preempted[req] = self.preempted.get(req, 0) + 1
            if n == self.preempt_limit:
                found.append(Divergence(
                    step, req, "progress", f"preempted {n} times since its last sampled token",
                    "a preempted request makes progress once it is scheduled again",
                    f"liveness: {req} is admitted and preempted again and again without "
                    "producing a token", "invariant", seq, line))
                self.looping[req] = found[-1]
        for req in out.finished_req_ids:   # finished (aborted) without a token: it stands
            self.preempted.pop(req, None)
            self.looping.pop(req, None)
        return found

    def _reloads(self, step, out, sched, seq, line, loads) -> list[Divergence]:
        found = []
        for load in loads:
            mine = self.loads.setdefault(load.req, [])
            if len(mine) >= self.reload_limit:
                continue   # reported once: the loop is what it was
            mine.append([step, load.start, load.end, None])
            if len(mine) < self.reload_limit:
                continue
            n, r = len(mine), sched.requests.get(load.req)
            why = (" (a one-token prompt: each completed full hit takes it back to "
                   "num_computed_tokens 0, S:3171-3172)" if r is not None and r.num_tokens == 1 else "")
            failed = [x for x in mine if x[3]]
            if not failed:
                found.append(Divergence(
                    step, load.req, "progress", f"{n} KV loads since it was last scheduled, none failed",
                    "a request whose KV load completed is scheduled, not loaded again",
                    f"liveness: {load.req} is looked up and loaded again each time its load "
                    f"completes, and never runs{why}", "invariant", seq, line))
                continue
            found.append(Divergence(
                step, load.req, "progress",
                f"{n} KV loads since it was last scheduled, {len(failed)} failed",
                f"the request runs within {n} attempts",
                f"liveness: {load.req} makes no progress over {n} attempts, each a lookup and a "
                f"KV load: {_loop(mine)}{why}", "invariant", seq, line))
        for req in out.num_scheduled_tokens:
            self.loads.pop(req, None)
        for req in out.finished_req_ids:
            self.loads.pop(req, None)
        return found

    def _stall(self, step, out, sched, seq, line) -> list[Divergence]:
        head = stuck = None
        if not out.num_scheduled_tokens:
            head = _ready_head(sched)
            stuck = _stuck_running(sched) if head is None else None
        if head is None and stuck is None:
            self.idle, self.since = 0, None
            return []
        if self.since is None:
            self.since = step
        self.idle += 1
        if self.idle != self.limit:
            return []
        if stuck is not None:
            return [Divergence(
                step, stuck.request_id, "progress",
                f"nothing scheduled for {self.limit} steps since step {self.since}",
                "a running request is scheduled until it finishes",
                f"liveness: {stuck.request_id} is running, yet nothing is scheduled "
                f"(num_computed_tokens {stuck.num_computed_tokens} of {stuck.num_tokens} tokens, "
                f"{stuck.num_output_placeholders} output placeholders)", "invariant", seq, line)]
        assert head is not None
        free = sched.kv.pool.num_free_blocks
        reserved = sum(sched.kv.remaining_blocks(r) for r in sched.inflight_prefills)
        drafts = sched.spec_decode_step_blocks()
        also = f"; an async load keeps {drafts} more for a decode step with drafts" if drafts else ""
        return [Divergence(
            step, head.request_id, "progress",
            f"nothing scheduled for {self.limit} steps since step {self.since}",
            "a ready request is admitted or the engine has no room",
            f"liveness: {head.request_id} is ready at the head of the waiting queue with "
            f"{free} free blocks ({reserved} reserved for in-flight prefills"
            f"{', itself included' if head in sched.inflight_prefills else ''}{also})",
            "invariant", seq, line)]


def _loop(loads: list[list]) -> str:
    """A request's loads, in words: their steps, the tokens they loaded, and
    which failed and how."""
    steps = [x[0] for x in loads]
    shown = ", ".join(map(str, steps)) if len(steps) <= 6 else \
        f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}"
    spans = {(x[1], x[2]) for x in loads}
    tokens = (f"each of tokens [{loads[0][1]}, {loads[0][2]})" if len(spans) == 1
              else "of tokens " + ", ".join(f"[{a}, {b})" for a, b in sorted(spans)))
    before = loads[:-1]   # the last is still under way
    failed = [x[3] for x in before if x[3]]
    how = ", ".join(dict.fromkeys(failed))
    said = (f"all {len(before)} before the last failed ({how})" if len(failed) == len(before)
            else f"{len(failed)} of the {len(before)} before the last failed ({how})")
    same = "; each lookup took the same hit again" if len(spans) == 1 else ""
    return f"loads at steps {shown}, {tokens}; {said}{same}"


def _queued(sched: Scheduler, r) -> bool:
    return any(q is r for queue in (sched.running, sched.waiting, sched.kv_holding_waiting)
               for q in queue)


def _stuck_running(sched: Scheduler):
    """A running request, when nothing is scheduled and the scheduler is not
    paused for all: it waits for a token no step in flight will bring."""
    if sched.pause_state == "PAUSED_ALL" or not sched.running:
        return None
    return sched.running[0]


def _ready_head(sched: Scheduler):
    """The request the waiting pass would try first, if one is ready."""
    cfg = sched.config
    slots = cfg.max_num_active_seqs or cfg.max_num_seqs
    if len(sched.running) < slots <= len(sched.running) + sched.num_waiting_for_streaming_input:
        return None   # sessions waiting for input hold the free slots
    for queue in (sched.kv_holding_waiting, sched.waiting):
        for r in queue:
            if r.status == Status.WAITING_FOR_STREAMING_REQ:
                continue
            if r.status == Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and r.grammar != "ready":
                continue
            if r.status != Status.WAITING_FOR_REMOTE_KVS or r.request_id in sched.finished_recving_ids:
                return r
    return None
