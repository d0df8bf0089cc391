"""The reference scheduler: vLLM V1's ``Scheduler`` in the baseline profile of
the semantics doc (full-attention, sliding-window and state KV-cache groups,
no pipeline parallelism, no encoder inputs), and its ``AsyncScheduler`` when
the config says ``async_scheduling``.

One ``schedule()`` call is two passes (semantics doc 2):

1. the running pass gives every running request its next chunk, preempting
   from the back of ``running`` (or the lowest priority) when blocks run out;
2. the waiting pass, skipped in a step that preempted, admits requests from the
   waiting queues: a fresh prefix lookup (local, then the connector), then an
   allocation, then either RUNNING or, for an async load, WAITING_FOR_REMOTE_KVS.

``update_from_output()`` applies load failures, appends sampled tokens, stops
and frees finished requests, and records finished transfers (semantics doc 3).

The waiting pass's admissions (admission.py) and what an output does to each
request (output.py) are a call away, and so is each feature: speculative
decoding (speculative.py), KV transfer (kv_transfer.py), async scheduling's
output placeholders (async_output.py) and streaming-input sessions
(sessions.py), each a class the Scheduler builds on (feature.py). The rules
that differ between releases are switches of the config's profile (profiles.py).
docs/design/reference.md tells the whole story.

Methods whose names start with ``_`` and are listed under "rules" are the
places where engines have had bugs; the embedded engine's faults override them.
"""

from __future__ import annotations

from collections import deque

from mypy_extensions import mypyc_attr

from .admission import Admission, Skipped
from .block_pool import Block
from .cache_stats import ConnectorCacheStats
from .cadence import PrefillCadence
from .config import SchedulerConfig
from .interface import (Connector, ModelOutput, RequestOutput, ScheduledRequest, SchedulerAssertion,
                        SchedulerOutput)
from .kv_groups import GroupedKVCacheManager
from .kv_manager import Blocks, KVCacheManager
from .output import Stopped
from .queues import make_queue
from .request import Request, Status
from .state_groups import StateSplit
from .step import StepPlan

__all__ = ["Scheduler", "SchedulerAssertion"]


# The embedded engine's faults and tests subclass it, overriding its rules.
@mypyc_attr(allow_interpreted_subclasses=True)
class Scheduler(Admission):
    """vLLM V1's scheduler: ``schedule()`` and ``update_from_output()`` over
    requests, a KV cache manager and an optional connector."""

    def __init__(self, config: SchedulerConfig, connector: Connector | None = None):
        self.config = config
        # defer_block_free: non-empty steps scheduled and processed so far, and
        # the tables freed meanwhile, each with the step it waits for (S:411-417).
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list[Block]]] = deque()
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.kv_groups = bool(config.kv_groups)
        self.kv = GroupedKVCacheManager(config) if self.kv_groups else KVCacheManager(config)
        # With state groups in align mode, prefill chunks end on block boundaries.
        self.state_split = StateSplit.of(config)
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.kv_holding_waiting = make_queue(config.policy)  # requests that hold blocks
        self.running: list[Request] = []
        # Reported in the next SchedulerOutput, then cleared.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        # Async loads the worker reported finished / failed, applied at next schedule().
        self.finished_recving_ids: set[str] = set()
        self.failed_recving_ids: set[str] = set()
        # Requests still prefilling: async loads count their remaining blocks as reserved.
        self.inflight_prefills: set[Request] = set()
        # "UNPAUSED", "PAUSED_NEW" (admit only requests that hold blocks) or
        # "PAUSED_ALL" (schedule nothing), as set_pause_state leaves it (S:2755).
        self.pause_state = "UNPAUSED"
        # Sessions waiting for their next chunk: not running, but each holds a slot (S:920-924).
        self.num_waiting_for_streaming_input = 0
        # Requests the waiting pass found with a failed grammar, finished by the next output.
        self.grammar_compile_error_ids: set[str] = set()
        # Waiting requests skipped by a waiting pass, or queued while blocked,
        # since they last ran: a step that leaves more waiting than these was
        # bound by capacity (S:906, S:1344, S:2459).
        self.deferred_waiting: set[Request] = set()
        self.num_steps = 0   # schedule() calls so far
        # The connector's prefix-cache stats since the last output took them.
        self.connector_cache = ConnectorCacheStats()
        self.cadence = PrefillCadence(
            config.prefill_schedule_interval,
            local=config.profile.local_prefill_interval and config.data_parallel_size == 1)

    # ------------------------------------------------------------------ inputs

    def add_request(self, request: Request) -> None:
        """A new request, or a live session's next chunk (or the end of its input),
        which it takes at once if it is waiting for one, else after its turn (S:2616-2628)."""
        session = self.requests.get(request.request_id)
        if session is not None:
            self._add_to_session(session, request)
            return
        if request.resumable:
            request.streaming_queue = deque()
        self._enqueue_waiting(request)
        self.requests[request.request_id] = request

    def finish_requests(self, req_ids, status: Status) -> list[Request]:
        """Finish requests from outside (an abort), or with an error (S:2649-2712)."""
        finished = []
        for req_id in req_ids:
            r = self.requests.get(req_id)
            if r is None or r.is_finished:
                continue
            finished.append(r)
        running = {r for r in finished if r.status == Status.RUNNING}
        waiting = {r for r in finished if r.status != Status.RUNNING}
        if running:
            self.running = [r for r in self.running if r not in running]
        if waiting:
            self.waiting.remove_all(waiting)
            self.kv_holding_waiting.remove_all(waiting)
            self.deferred_waiting -= waiting
        self.num_waiting_for_streaming_input -= sum(
            1 for r in finished if r.status == Status.WAITING_FOR_STREAMING_REQ)
        for r in finished:
            delay_free = False
            if r.status == Status.WAITING_FOR_REMOTE_KVS:
                # Its blocks are still being written by the load: free them on finished_recving.
                delay_free = r.request_id not in self.finished_recving_ids
                self.finished_recving_ids.discard(r.request_id)
                self.failed_recving_ids.discard(r.request_id)
            r.status = status
            self._free_request(r, delay_free)
        return finished

    def grammar_compiled(self, outcomes: dict[str, str]) -> None:
        """The grammars that the engine's next ``schedule()`` finds compiled
        ("ready") or failed ("error"). They compile beside the scheduler, so
        only the engine can say when; a trace records the step that first saw each."""
        for req_id, outcome in outcomes.items():
            r = self.requests.get(req_id)
            if r is not None and r.grammar == "compiling":
                r.grammar = outcome

    def set_pause_state(self, state: str) -> None:
        if state not in ("UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"):
            raise ValueError(f"unknown pause state {state!r}")
        self.pause_state = state

    # ------------------------------------------------------------------ schedule

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """One step. ``throttle_prefills``: the engine core asks this step to hold
        prefills back (a data-parallel engine off its cadence, cadence.py)."""
        paused_all = self.pause_state == "PAUSED_ALL"   # no token budget at all (S:615-617)
        self.kv.new_step_starts()
        step = StepPlan(0 if paused_all else self.config.token_budget,
                        self.config.max_num_batched_tokens, self._long_prefill_threshold(),
                        self.config.num_draft_slots)
        step.defer_prefills = self.cadence.defers(
            throttle_prefills, any(not r.is_prefill_chunk for r in self.running))
        self._schedule_running(step)
        # No admissions in a step that preempted (S:900); under the legacy
        # profile none either while paused for new requests.
        admits = not paused_all and (self.pause_state == "UNPAUSED"
                                     or self.config.profile.paused_new_admits_holding)
        if not step.preempted and admits:
            self._schedule_waiting(step)
            if not step.defer_prefills:
                self.cadence.released(len(self.waiting) + len(self.kv_holding_waiting),
                                      len(self.deferred_waiting))
        self.cadence.step_done(bool(step.num_scheduled),
                               step.prefill_scheduled or step.prefill_admitted)
        self.num_steps += 1
        return self._finish_step(step)

    def _long_prefill_threshold(self) -> int:
        """The chunk cap only matters when someone else could use the budget (S:643-655)."""
        cfg = self.config
        num_eligible = len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
        alone = num_eligible <= 1 and cfg.profile.long_prefill_cap_needs_company
        threshold = 0 if alone else cfg.long_prefill_token_threshold
        if threshold and cfg.adaptive_long_prefill_threshold and num_eligible:
            threshold = max(threshold, cfg.max_num_batched_tokens // num_eligible)
        return threshold

    def _schedule_running(self, step: StepPlan) -> None:
        """Give every running request its next chunk, in order. When blocks run out,
        preempt from the back (FCFS) or the lowest priority, possibly the request
        itself, and stop at the first request that cannot be given room (S:657-888)."""
        i = 0
        while i < len(self.running) and step.has_budget():
            r = self.running[i]
            if self._reached_max_tokens(r) or (step.defer_prefills and r.is_prefill_chunk):
                i += 1   # its last token is in flight, or its prefill is held back (S:822-826)
                continue
            # Its tokens and drafts (num_tokens_with_spec), and its placeholders.
            n = min(step.chunk(r.num_tokens + len(r.spec_token_ids) + r.num_output_placeholders
                               - r.num_computed_tokens),
                    self.max_model_len - r.num_computed_tokens
                    - self.config.num_sampled_tokens_per_step)
            if self.state_split is not None and n > 0:
                n = self.state_split.chunk(r, r.num_computed_tokens, n)   # S:723-727
            if n <= 0:
                i += 1   # nothing to schedule, or no block-aligned chunk fits (S:753-776)
                continue
            blocks, i = self._allocate_preempting(r, n, i, step)
            if blocks is None:
                if (self.config.profile.self_preemption_continues
                        and self.config.policy == "priority" and r.status == Status.PREEMPTED):
                    continue   # 0.33: it preempted itself; i is the next request (S:983-992)
                break
            step.running.append(r)
            step.new_blocks[r.request_id] = blocks
            if r.is_prefill_chunk:
                step.prefill_scheduled = True
            step.take(r, n)
            if r.spec_token_ids:
                self._schedule_drafts(r, n, step)
            i += 1

    def _allocate_preempting(self, r: Request, n: int, i: int,
                             step: StepPlan) -> tuple[Blocks | None, int]:
        """Blocks for ``n`` more tokens of ``r``, the i-th running request,
        preempting victims until they fit or ``r`` is the victim; and where the
        running pass goes on (a victim before ``r`` moves it back)."""
        lookahead = self.config.num_lookahead_tokens
        blocks = self.kv.allocate_slots(r, n, num_lookahead_tokens=lookahead)
        while blocks is None:
            victim = self._pick_victim()
            if not self._blocks_can_be_freed(victim):
                break   # its blocks would not come back now (S:804-806)
            if self.config.policy == "priority":
                at = self.running.index(victim)
                del self.running[at]
                if at < i:
                    i -= 1
                if victim in step.running:
                    step.undo(victim)
            else:
                self.running.pop()
            self._preempt_request(victim, self.config.requires_kv_delivery)
            step.preempted.append(victim)
            if victim is r:
                break
            blocks = self.kv.allocate_slots(r, n, num_lookahead_tokens=lookahead)
        return blocks, i

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admit waiting requests, those holding blocks first (and only those while
        paused for new requests), until one does not fit (S:899-1401). Each
        admission is a fresh lookup (local prefix cache, then the connector)
        unless the request's async load has completed; an async load moves the
        request to WAITING_FOR_REMOTE_KVS instead of RUNNING. Requests skipped
        on the way go back to the head of their queue, in order."""
        loras = self._loras_in_step(step)
        skipped = Skipped()
        while step.token_budget > 0:
            queue = self._queue_to_admit_from()
            if not queue or not self._has_seat(step):
                break
            r = queue.peek()
            if not self._may_admit(r, loras):
                self._skip(queue, skipped)
                continue
            lookup = self._lookup(r)
            if lookup is None:   # the connector cannot tell yet
                self._skip(queue, skipped)
                continue
            n, padded = self._admission_tokens(r, lookup, step)
            if n is None or not self._allocate_admission(r, n, lookup):
                break   # head-of-line: the whole waiting pass stops
            if lookup.load_async:
                r.status = Status.WAITING_FOR_REMOTE_KVS
                r.num_computed_tokens = lookup.num_computed
                self.inflight_prefills.add(r)
                self._skip(queue, skipped)
                continue
            queue.pop_request()
            self._admit(r, n, padded, lookup.num_computed, step, loras)
        if skipped.holding:
            self.kv_holding_waiting.prepend_all(skipped.holding)
        if skipped.waiting:
            self.waiting.prepend_all(skipped.waiting)

    def _finish_step(self, step: StepPlan) -> SchedulerOutput:
        """Build the output (pre-step counts), then advance num_computed_tokens:
        it counts a step's tokens when the step is scheduled, not when it completes."""
        def entry(r: Request, block_ids: list[int], more=None) -> ScheduledRequest:
            return ScheduledRequest(r.request_id, r.num_computed_tokens,
                                    step.num_scheduled[r.request_id], block_ids, more)

        kv = self.kv
        if isinstance(kv, GroupedKVCacheManager):   # several KV-cache groups: the others' tables too
            running = [entry(r, *kv.split_ids(step.new_blocks[r.request_id])) for r in step.running]
        else:
            running = [entry(r, [b.block_id for b in step.new_blocks[r.request_id]])
                       for r in step.running]
        out = SchedulerOutput(
            new=[entry(r, kv.get_block_ids(r.request_id), kv.more_ids(r.request_id))
                 for r in step.new],
            resumed=[entry(r, kv.get_block_ids(r.request_id), kv.more_ids(r.request_id))
                     for r in step.resumed],
            running=running,
            num_scheduled_tokens=step.num_scheduled,
            preempted_req_ids=self.preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            spec=step.spec,
        )
        defer = self.config.defer_block_free and bool(step.num_scheduled)
        drafts_asked = self._drafts_asked(len(step.num_scheduled))
        if defer:
            self.sched_step_seq += 1
        for req_id, n in step.num_scheduled.items():
            r = self.requests[req_id]
            r.num_computed_tokens += n
            r.num_in_flight_tokens += n
            if defer:
                r.last_sched_seq = self.sched_step_seq
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens + r.num_output_placeholders
            if not r.is_prefill_chunk:   # this step samples a token (S:1634, AS:33-47)
                self.inflight_prefills.discard(r)
                if self.config.async_scheduling:
                    self._hold_placeholders(r, len(step.spec.get(req_id, ())), drafts_asked)
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        return out

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    # ------------------------------------------------------------------ rules

    def _local_prefix_hit(self, r: Request) -> tuple[Blocks, int]:
        """A fresh local lookup against the live prefix cache."""
        return self.kv.get_computed_blocks(r)

    def _record_lookup(self, r: Request, num_local: int, num_external: int, load_async: bool) -> None:
        """Prompt accounting at S:1074-1081: the stats describe the first scheduled
        prefill, so lookups after a preemption leave them alone."""
        r.lookup_history.append((self.num_steps, num_local, num_external, load_async))
        if r.prefill_stats is not None and r.num_preemptions <= 0:
            r.prefill_stats.set(r.num_prompt_tokens, num_local, num_external)
            r.set_legacy_external(num_external)
        elif self.config.profile.legacy_counters:
            r.set_legacy_external(num_external)   # legacy: every lookup (0.18 scheduler.py:622)

    def _count_connector_query(self, r: Request, num_local: int, num_external: int) -> None:
        """The connector's prefix-cache stats, at an admission that looked it
        up (S:1294-1311): the tokens past the local hit were queried, the
        external hit hit, counted when any were queried. A request that reads
        no prefix cache queries nothing: its answer is discarded (S:983-984),
        and the local cache's stats leave it out likewise (KM
        record_prefix_cache_stats). vLLM 0.32 counts it, every token a miss
        (vllm#57596): replay flags that."""
        queries = r.num_tokens - num_local
        if r.skip_reading_prefix_cache:
            self.connector_cache.unread.append(r.request_id)
        elif queries:
            self.connector_cache.record(queries, num_external, r.num_preemptions > 0)

    def take_connector_cache(self) -> ConnectorCacheStats:
        """The connector's prefix-cache stats since the last call (an output's
        ``make_stats``), which start again at zero."""
        stats, self.connector_cache = self.connector_cache, ConnectorCacheStats()
        return stats

    def _on_admitted(self, r: Request) -> None:
        """A request became RUNNING. The legacy count is set once (−1 sentinel,
        0.18 scheduler.py:806-807)."""
        if r.legacy_num_cached_tokens < 0:
            r.legacy_num_cached_tokens = r.num_computed_tokens
            r.legacy_cached_from = len(r.lookup_history) - 1
        r.note_legacy_admission()

    def _preempt_request(self, r: Request, drop_stale_output: bool = False,
                         listed: bool = True) -> None:
        """Free every block and send the request to the head of the waiting
        queue (S:1571); ``listed``: in the next output's preempted ids."""
        assert r.status == Status.RUNNING
        self._free_request_blocks(r)
        self.inflight_prefills.discard(r)
        r.status = Status.PREEMPTED
        r.num_computed_tokens = 0
        r.spec_token_ids = []
        # Output still in flight becomes stale (S:1596-1607); a stale share not yet
        # drained that was to be dropped stays dropped.
        r.drop_stale_output = drop_stale_output or (r.drop_stale_output
                                                    and r.num_stale_output_tokens > 0)
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        r.num_preemptions += 1
        self.waiting.prepend(r)
        if listed:
            self.preempted_req_ids.add(r.request_id)

    # ------------------------------------------------------------------ update

    def update_from_output(self, out: SchedulerOutput, model: ModelOutput) -> list[RequestOutput]:
        if self.config.defer_block_free and out.num_scheduled_tokens:
            self._step_processed()
        failed = self._load_failures(model, out.num_scheduled_tokens)
        outputs: list[RequestOutput] = []
        stopped = Stopped()
        for req_id, n in out.num_scheduled_tokens.items():
            result = self._request_output(req_id, n, out.spec, model, failed, stopped)
            if result is not None:
                outputs.append(result)
        self._remove_stopped(stopped)
        outputs += self._finish_with_errors(failed, model.error_order)
        self._transfers_finished(model)
        return outputs

    def _enqueue_waiting(self, r: Request) -> None:
        """Into the waiting queue, or the queue of those that hold blocks
        (S:2445-2463); under the legacy profile, a blocked request into the
        queue of skipped ones (0.18's _enqueue_waiting_request)."""
        blocked = r.status in (Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
                               Status.WAITING_FOR_REMOTE_KVS, Status.WAITING_FOR_STREAMING_REQ)
        if blocked:
            self.deferred_waiting.add(r)
        if self.config.profile.waiting_queues == "skipped":
            second = blocked
        else:
            second = r.num_computed_tokens > 0 or r.status == Status.WAITING_FOR_REMOTE_KVS
        (self.kv_holding_waiting if second else self.waiting).add(r)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (S:2840-2880), as RLHF weight updates do.
        With ``reset_running_requests`` every running request is preempted
        first, the last one first, and its output in flight is dropped; the reset
        succeeds only when no block is in use. (When it fails even so, vLLM
        raises to its caller, after the preemptions; the engine goes on.)"""
        if reset_running_requests:
            # A legacy engine lists only a step's own preemptions in its output.
            listed = self.config.profile.reset_preemptions_listed
            while self.running:
                self._preempt_request(self.running.pop(), drop_stale_output=True, listed=listed)
        return self.kv.reset_prefix_cache()

    def _free_request(self, r: Request, delay_free: bool = False) -> None:
        assert r.is_finished
        self.inflight_prefills.discard(r)
        if self.connector is not None:
            self.kv.remove_skipped_blocks(r)   # what is before a window is not handed off (S:3023)
            delay_free |= bool(self.connector.request_finished(r, self.kv.get_block_ids(r.request_id)))
        self.finished_req_ids.add(r.request_id)
        if not delay_free:
            self._free_blocks(r)

    def _free_blocks(self, r: Request, rule: str = "S:2747 freeing the blocks of a request "
                                                    "that has not finished") -> None:
        if not r.is_finished:   # the engine asserts it
            raise SchedulerAssertion(r.request_id, rule)
        self._free_request_blocks(r)
        del self.requests[r.request_id]
