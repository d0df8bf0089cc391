"""The reference scheduler: vLLM V1's ``Scheduler`` in the baseline profile of
the semantics doc (one full-attention group, no pipeline parallelism, no
encoder inputs), and its ``AsyncScheduler`` when the config says
``async_scheduling``.

One ``schedule()`` call is two passes (semantics doc 2):

1. the running pass gives every running request its next chunk, preempting
   from the back of ``running`` (or the lowest priority) when blocks run out;
2. the waiting pass, skipped in a step that preempted, admits requests from the
   waiting queues: a fresh prefix lookup (local, then the connector), then an
   allocation, then either RUNNING or, for an async load, WAITING_FOR_REMOTE_KVS.

``update_from_output()`` applies load failures, appends sampled tokens, stops
and frees finished requests, and records finished transfers (semantics doc 3).

The features around these passes (sessions, async scheduling, speculative
decoding, structured outputs, pooling) are described in docs/design/reference.md.

Methods whose names start with ``_`` and are listed under "rules" are the
places where engines have had bugs; the embedded engine's faults override them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import Block
from .cadence import PrefillCadence
from .config import SchedulerConfig
from .interface import Connector, ModelOutput, RequestOutput, ScheduledRequest, SchedulerOutput
from .kv_manager import KVCacheManager
from .queues import make_queue
from .request import FINISH_REASONS, Request, Status, StreamingUpdate, check_stop


class SchedulerAssertion(AssertionError):
    """The engine itself would have failed an assertion here (for example a sync
    external hit that covers the whole prompt, S:1170)."""

    def __init__(self, req_id: str, rule: str):
        self.req_id, self.rule = req_id, rule
        super().__init__(f"{req_id}: {rule}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, connector: Connector | None = None):
        self.config = config
        # defer_block_free: non-empty steps scheduled and processed so far, and
        # the tables freed meanwhile, each with the step it waits for (S:411-417).
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list[Block]]] = deque()
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.kv = KVCacheManager(config)
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
        self.cadence = PrefillCadence(
            config.prefill_schedule_interval,
            local=config.profile.local_prefill_interval and config.data_parallel_size == 1)

    # ------------------------------------------------------------------ inputs

    def add_request(self, request: Request) -> None:
        """A new request, or a live session's next chunk (or the end of its input),
        which it takes at once if it is waiting for one, else after its turn (S:2616-2628)."""
        session = self.requests.get(request.request_id)
        if session is None:
            if request.resumable:
                request.streaming_queue = deque()
            self._enqueue_waiting(request)
            self.requests[request.request_id] = request
            return
        assert session.streaming_queue is not None, "duplicate request id"
        update = StreamingUpdate.from_request(request)
        if session.status != Status.WAITING_FOR_STREAMING_REQ:
            session.streaming_queue.append(update)
        elif update is not None:
            self._update_request_as_session(session, update)
        else:
            self.finish_requests([request.request_id], Status.FINISHED_ABORTED)

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

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """The drafts the model proposed after an output: each live request keeps
        them for its next step, but a request still prefilling drops them (S:2550-2569)."""
        for req_id, ids in drafts.items():
            r = self.requests.get(req_id)
            if r is None or r.is_finished:
                continue
            r.spec_token_ids = [] if r.is_prefill_chunk else list(ids)

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
        step = _Step(0 if paused_all else self.config.token_budget,
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

    def _schedule_running(self, step: "_Step") -> None:
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
            if n <= 0:
                i += 1
                continue
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

    def _schedule_waiting(self, step: "_Step") -> None:
        """Admit waiting requests, those holding blocks first (and only those while
        paused for new requests), until one does not fit (S:899-1401). Each admission is a fresh lookup (local prefix cache, then the
        connector) unless the request's async load has completed; an async load
        moves the request to WAITING_FOR_REMOTE_KVS instead of RUNNING. Requests
        skipped on the way go back to the head of their queue, in order."""
        max_active = self.config.max_num_active_seqs or self.config.max_num_seqs
        max_loras = self.config.max_loras
        # The LoRA adapters this step runs so far (S:889-897); under the 0.33
        # profile those of every running request, scheduled or not (S:1038-1047).
        holders = self.running if self.config.profile.lora_slots_of_all_running else step.running
        loras = {r.lora[0] for r in holders if r.lora} if max_loras else set()
        skipped_waiting: deque[Request] = deque()
        skipped_holding: deque[Request] = deque()

        def skip(queue) -> None:
            r = queue.pop_request()
            self.deferred_waiting.add(r)
            holds = (r.num_computed_tokens > 0 or r.status == Status.WAITING_FOR_REMOTE_KVS
                     or self.config.profile.waiting_queues == "skipped")   # legacy: all skipped
            (skipped_holding if holds else skipped_waiting).appendleft(r)

        while step.token_budget > 0:
            queue = self._queue_to_admit_from()
            num_active = len(self.running)
            if self.config.profile.sessions_hold_slots:
                num_active += self.num_waiting_for_streaming_input
            if not queue or step.input_budget <= step.draft_slots or num_active >= max_active:
                break
            r = queue.peek()
            if not self._ready_to_schedule(r) or (r.num_stale_output_tokens
                                                  and not r.drop_stale_output):
                skip(queue)     # a load still running, or stale output still to deliver
                continue
            if max_loras and r.lora and len(loras) == max_loras and r.lora[0] not in loras:
                skip(queue)     # its adapter would exceed max_loras (S:941-952)
                continue

            hits: list[Block] = []
            num_local = num_external = 0
            load_async = False
            if r.num_computed_tokens == 0:
                # A fresh lookup: first admission, a retry, or a resume after preemption.
                if r.resumable and r.hash_lookahead:
                    r.rehash()   # a turn's dropped token may linger in a lookahead hash (S:1111-1115)
                hits, num_local = self._local_prefix_hit(r)
                if self.connector is not None:
                    ext, load_async = self.connector.get_num_new_matched_tokens(r, num_local)
                    if r.skip_reading_prefix_cache and self.config.profile.skip_reading_skips_connector:
                        ext, load_async = 0, False
                    if ext is None:             # the connector cannot tell yet
                        skip(queue)
                        continue
                    num_external = ext
                num_computed = num_local + num_external
                if num_computed > r.num_tokens:
                    raise SchedulerAssertion(r.request_id, "S:1048 local + external hit exceeds num_tokens")
                self._record_lookup(r, num_local, num_external, load_async)
            else:
                # An async load that has completed: its blocks are already in place.
                num_computed = r.num_computed_tokens

            n = 0
            reserved = 0
            padded = False   # a one-token decode padded with -1 drafts
            if load_async:
                # Keep the blocks that in-flight prefills still need, and with
                # speculative decoding the blocks of one whole decode step (S:1241-1251).
                if self.config.profile.async_loads_reserve_blocks:
                    reserved = (sum(self.kv.remaining_blocks(x) for x in self.inflight_prefills)
                                + self.spec_decode_step_blocks())
            elif step.defer_prefills and num_computed < r.num_tokens - 1:
                break   # prefills are held back this step (S:1113)
            else:
                want = r.num_tokens - num_computed
                padded = want == 1 and self._pads_with_drafts(step, num_computed)
                if padded:
                    if 1 + self.config.num_spec_tokens > step.room():
                        break   # rather not scheduled than scheduled unpadded (S:1146-1148)
                    want = 1 + self.config.num_spec_tokens
                want = step.capped(want)
                if not self.config.enable_chunked_prefill and want > step.room():
                    break   # chunked prefill off: the request waits whole (S:1160-1167)
                n = min(want, step.room())
                if n <= 0:
                    raise SchedulerAssertion(
                        r.request_id, "S:1170 an admission must leave a token to compute (a sync "
                                      "external hit over the whole prompt, or a count past its tokens)")
            blocks = self.kv.allocate_slots(
                r, n, num_local, hits, num_external,
                delay_cache_blocks=load_async, reserved_blocks=reserved,
                has_scheduled_reqs=bool(self.running),
                full_sequence_must_fit=self.config.reserve_full_isl,
                num_lookahead_tokens=self._admission_lookahead(r, load_async))
            if blocks is None:
                break   # head-of-line: the whole waiting pass stops

            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    r, self.kv.get_block_ids(r.request_id), num_external)

            if load_async:
                r.status = Status.WAITING_FOR_REMOTE_KVS
                r.num_computed_tokens = num_computed
                self.inflight_prefills.add(r)
                skip(queue)
                continue

            queue.pop_request()
            self.deferred_waiting.discard(r)
            self.running.append(r)
            (step.new if r.status == Status.WAITING else step.resumed).append(r)
            if max_loras and r.lora:
                loras.add(r.lora[0])
            step.take(r, n)
            if padded:
                if n != 1 + self.config.num_spec_tokens:
                    raise SchedulerAssertion(
                        r.request_id, "S:1372 a padded decode lost its padding to the "
                                      "long-prefill threshold")
                step.spec[r.request_id] = [-1] * self.config.num_spec_tokens
            r.status = Status.RUNNING
            r.num_computed_tokens = num_computed
            step.prefill_admitted |= num_computed < r.num_tokens - 1
            self._on_admitted(r)
            if num_computed + n < r.num_tokens:
                self.inflight_prefills.add(r)

        if skipped_holding:
            self.kv_holding_waiting.prepend_all(skipped_holding)
        if skipped_waiting:
            self.waiting.prepend_all(skipped_waiting)

    def _queue_to_admit_from(self):
        """The waiting queue the pass takes its next request from: those that
        hold blocks first, and only those while paused for new requests
        (S:914-917). Under the legacy profile, the queue of skipped and
        blocked requests first, or by priority the better of the two heads
        (0.18's _select_waiting_queue_for_scheduling)."""
        holding, waiting = self.kv_holding_waiting, self.waiting
        if self.config.profile.waiting_queues == "skipped":
            if self.config.policy == "priority" and holding and waiting:
                return waiting if waiting.peek() < holding.peek() else holding
            return holding or waiting
        if holding or self.pause_state != "UNPAUSED":
            return holding
        return waiting

    def _finish_step(self, step: "_Step") -> SchedulerOutput:
        """Build the output (pre-step counts), then advance num_computed_tokens:
        it counts a step's tokens when the step is scheduled, not when it completes."""
        def entry(r: Request, block_ids: list[int]) -> ScheduledRequest:
            return ScheduledRequest(r.request_id, r.num_computed_tokens,
                                    step.num_scheduled[r.request_id], block_ids)

        out = SchedulerOutput(
            new=[entry(r, self.kv.get_block_ids(r.request_id)) for r in step.new],
            resumed=[entry(r, self.kv.get_block_ids(r.request_id)) for r in step.resumed],
            running=[entry(r, [b.block_id for b in step.new_blocks[r.request_id]])
                     for r in step.running],
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
            if not r.is_prefill_chunk:
                # This step samples a token (S:1634, AS:33-47).
                self.inflight_prefills.discard(r)
                if self.config.async_scheduling:
                    # A placeholder for the token it samples (none for a pooling
                    # model) and for each draft it verifies; the next step's
                    # drafts are placeholders too, filled in by the model runner,
                    # never seen here (AS:25-53).
                    r.num_output_placeholders += (self.config.num_sampled_tokens_per_step
                                                  + len(step.spec.get(req_id, ())))
                    if self.config.num_spec_tokens:
                        r.spec_token_ids = [-1] * drafts_asked
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        return out

    def _reached_max_tokens(self, r: Request) -> bool:
        """Async scheduling: the steps in flight already sample the request's
        last token, so another one would be wasted (S:664-678)."""
        return (r.num_output_placeholders > 0
                and r.num_computed_tokens + 2 - r.num_output_placeholders
                >= r.num_prompt_tokens + r.max_tokens)

    def _schedule_drafts(self, r: Request, n: int, step: "_Step") -> None:
        """The drafts among a running request's ``n`` tokens are those past its
        last token; the rest of its drafts are dropped (S:861-876)."""
        k = n + r.num_computed_tokens - r.num_tokens - r.num_output_placeholders
        if k > 0:
            step.spec[r.request_id] = r.spec_token_ids[:k]
        r.spec_token_ids = []

    def _drafts_asked(self, num_requests: int) -> int:
        """The drafts a step that schedules ``num_requests`` requests asks the
        drafter for: num_spec_tokens, or with dynamic speculative decoding the
        table's entry for that batch size (S:1485-1490)."""
        table = self.config.spec_tokens_by_batch_size
        if table is None or not num_requests:
            return self.config.num_spec_tokens
        return table[min(num_requests, len(table) - 1)]

    def spec_decode_step_blocks(self) -> int:
        """Blocks of one decode step with every draft and the drafter's
        lookahead: 1 + num_spec_tokens + num_lookahead_tokens slots (S:348-357)."""
        k = self.config.num_spec_tokens
        return -(-(1 + k + self.config.num_lookahead_tokens) // self.block_size) if k else 0

    def _admission_lookahead(self, r: Request, load_async: bool) -> int:
        """The drafter's lookahead slots an admission allocates. An async load
        runs no model step: its slots come with its first chunk (S:1221-1226).
        Under the legacy profile only an admission that follows a load gets
        them, not one from a fresh lookup (its ``effective_lookahead_tokens``)."""
        if load_async or (r.num_computed_tokens == 0
                          and not self.config.profile.lookahead_at_lookup_admission):
            return 0
        return self.config.num_lookahead_tokens

    def _pads_with_drafts(self, step: "_Step", num_computed: int) -> bool:
        """A waiting request with one token to compute is padded to a whole
        decode of 1 + num_spec_tokens, when no prefill runs in the step, a
        decode does or the request has KV already, and the padding and the
        token it samples fit in max_model_len (S:1131-1153). Not with dynamic
        speculative decoding (S:1135)."""
        k = self.config.num_spec_tokens
        return (k > 0 and self.config.spec_tokens_by_batch_size is None
                and self.config.profile.pads_one_token_admissions
                and not step.prefill_scheduled
                and bool(step.running or num_computed > 0)
                and num_computed + 1 + k + 1 <= self.max_model_len)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _ready_to_schedule(self, r: Request) -> bool:
        """A request waiting for an async load is ready once the load finished
        (S:3175), and one waiting for its grammar once it has compiled; a
        grammar that failed is noted, for the next output to finish its request
        (S:3191-3200). A session waiting for its next chunk is not (S:3202)."""
        if r.status == Status.WAITING_FOR_STREAMING_REQ:
            return False
        if r.status == Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            if r.grammar == "error":
                self.grammar_compile_error_ids.add(r.request_id)
            if r.grammar != "ready":
                return False
            r.status = Status.WAITING
            return True
        if r.status != Status.WAITING_FOR_REMOTE_KVS:
            return True
        if r.request_id not in self.finished_recving_ids:
            return False
        self._finish_remote_kv_load(r)
        self.finished_recving_ids.discard(r.request_id)
        r.status = Status.PREEMPTED if r.num_preemptions else Status.WAITING
        return True

    # ------------------------------------------------------------------ rules

    def _local_prefix_hit(self, r: Request) -> tuple[list[Block], int]:
        """A fresh local lookup against the live prefix cache."""
        return self.kv.get_computed_blocks(r)

    def _record_lookup(self, r: Request, num_local: int, num_external: int, load_async: bool) -> None:
        """Prompt accounting at S:1074-1081: the stats describe the first scheduled
        prefill, so lookups after a preemption leave them alone."""
        r.lookup_history.append((self.num_steps, num_local, num_external, load_async))
        if r.prefill_stats is not None and r.num_preemptions <= 0:
            r.prefill_stats.set(r.num_prompt_tokens, num_local, num_external)
            r.legacy_num_external_computed_tokens = num_external
        elif self.config.profile.legacy_counters:
            r.legacy_num_external_computed_tokens = num_external   # legacy: every lookup

    def _on_admitted(self, r: Request) -> None:
        """A request became RUNNING. The legacy count is set once (−1 sentinel)."""
        if r.legacy_num_cached_tokens < 0:
            r.legacy_num_cached_tokens = r.num_computed_tokens

    def _finish_remote_kv_load(self, r: Request) -> None:
        """An async load completed: its blocks become hash-visible, and a load that
        covered every token gives one back, to be recomputed (S:3123-3173)."""
        failed = r.request_id in self.failed_recving_ids
        if failed:
            if r.num_computed_tokens:
                self.kv.cache_blocks(r, r.num_computed_tokens)
            else:
                self.kv.free(r)   # nothing valid; the retry may hit locally
            self.failed_recving_ids.discard(r.request_id)
        else:
            self.kv.cache_blocks(r, r.num_computed_tokens)
        legacy = self.config.profile.legacy_counters
        if r.num_computed_tokens == r.num_tokens and not (failed and legacy):
            r.num_computed_tokens = r.num_tokens - 1
        if legacy and not failed and r.legacy_num_cached_tokens < 0:
            r.legacy_num_cached_tokens = r.num_computed_tokens   # 0.18: set once the load is in

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

    def _truncate_for_invalid_block(self, r: Request, block_index: int, pre: int) -> None:
        """A block of r failed to load: r is computed only up to that block (S:3315).
        A legacy engine takes the tokens it lost off num_external_computed_tokens
        too, local ones included (upstream issue 36533)."""
        r.num_computed_tokens = block_index * self.block_size
        r.invalid_block_hits += 1
        if self.config.profile.legacy_counters:
            r.legacy_num_external_computed_tokens -= pre - r.num_computed_tokens

    # ------------------------------------------------------------------ update

    def update_from_output(self, out: SchedulerOutput, model: ModelOutput) -> list[RequestOutput]:
        if self.config.defer_block_free and out.num_scheduled_tokens:
            self.processed_step_seq += 1   # every write of this step and those before is done
            self._drain_deferred_frees()
        failed: set[str] = set()
        if model.failed_recving:
            failed |= self._handle_failed_recving(model.failed_recving)
        if model.invalid_block_ids:
            failed |= self._handle_invalid_blocks(model.invalid_block_ids, out.num_scheduled_tokens)

        outputs: list[RequestOutput] = []
        spec = out.spec   # drafts scheduled (speculative decoding)
        stopped_running: set[Request] = set()
        stopped_waiting: set[Request] = set()
        continuing: list[Request] = []   # sessions whose turn ended, queued after the removal
        requeue_later = self.config.profile.session_requeued_after_stop
        for req_id, n in out.num_scheduled_tokens.items():
            r = self.requests.get(req_id)
            stale = False
            if r is not None:
                r.num_in_flight_tokens -= n
                if r.num_stale_output_tokens > 0:    # preempted since it was scheduled
                    stale = True
                    r.num_stale_output_tokens -= n
            if req_id in failed or r is None or r.is_finished:
                continue
            if stale and r.drop_stale_output:
                continue
            new_tokens = list(model.sampled_token_ids.get(req_id, ()))
            if spec and req_id in spec and new_tokens and not stale:
                self._reject_drafts(r, len(spec[req_id]), len(new_tokens))
            stopped = False
            status_before = r.status
            num_given, had_placeholders = len(new_tokens), r.num_output_placeholders > 0
            for k, token in enumerate(new_tokens):
                r.append_output_token(token)
                if check_stop(r, self.max_model_len,
                              self.config.profile.min_tokens_before_any_stop):
                    stopped = True
                    del new_tokens[k + 1:]
                    break
            if not new_tokens and r.pooling and req_id in model.pooled:
                r.status = Status.FINISHED_STOPPED   # its pooler output came (S:2170-2173)
                stopped = True
            if new_tokens and req_id in model.grammar_rejected:
                r.status = Status.FINISHED_ERROR   # its grammar refused them (S:2186-2197)
                r.resumable = False
                stopped = True
            if new_tokens:
                self._take_placeholders(r, num_given, len(new_tokens), stale)
                self._cache_output_blocks(r, stale, status_before, had_placeholders)
            if not (new_tokens or stopped):
                continue
            stats = r.take_prefill_stats()
            legacy = None
            if stats is not None:
                stats.finalize(self.kv.estimate_cached_tokens(req_id))
                legacy = (r.legacy_num_cached_tokens, r.legacy_num_external_computed_tokens)
            reason = None
            if stopped:
                reason = FINISH_REASONS[r.status]
                if self._handle_stopped_request(r):
                    self._free_request(r)
                elif requeue_later:
                    continuing.append(r)
                else:
                    self._enqueue_waiting(r)   # at once; the removal below can undo it (S:2490)
                (stopped_running if status_before == Status.RUNNING else stopped_waiting).add(r)
            outputs.append(RequestOutput(req_id, new_tokens, reason, stats, legacy))

        if stopped_running:
            self.running = [r for r in self.running if r not in stopped_running]
        if stopped_waiting:
            self.waiting.remove_all(stopped_waiting)
            self.kv_holding_waiting.remove_all(stopped_waiting)
            self.deferred_waiting -= stopped_waiting
        for r in continuing:   # 0.33: sessions whose turn ended, after the removal (S:2541-2550)
            self._enqueue_waiting(r)

        # Grammars that failed to compile, and failed loads under the "fail"
        # policy, finish their requests with an error (S:2302-2326).
        errors = self.grammar_compile_error_ids
        self.grammar_compile_error_ids = set()
        if failed and self.config.load_failure_policy == "fail":
            errors |= failed
        if errors:
            for r in self.finish_requests(sorted(errors), Status.FINISHED_ERROR):
                outputs.append(RequestOutput(r.request_id, [], FINISH_REASONS[r.status]))

        # vLLM goes through these sets in its own process's order, which a trace
        # does not hold; in sorted order, as the trace lists them, replay says
        # the same in every process.
        for req_id in sorted(model.finished_recving):
            r = self.requests[req_id]
            if r.status == Status.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_ids.add(req_id)
            else:
                self._free_blocks(r, "S:3230 a finished load for a request that neither waits "
                                     "for it nor has finished")
        for req_id in sorted(model.finished_sending):
            self._free_blocks(self.requests[req_id], "S:2747 a finished send for a request "
                                                     "that has not finished")
        return outputs

    def _reject_drafts(self, r: Request, num_drafts: int, num_sampled: int) -> None:
        """The sampled tokens are the drafts accepted and one more; the KV of the
        rejected drafts is not the request's, so it is computed again (S:2110-2128)."""
        num_rejected = num_drafts - max(num_sampled - 1, 0)
        if r.num_computed_tokens > 0:
            r.num_computed_tokens -= num_rejected
        if r.num_output_placeholders > 0:
            r.num_output_placeholders -= num_rejected

    def _take_placeholders(self, r: Request, num_given: int, num_kept: int, stale: bool) -> None:
        """The sampled tokens replace their placeholders (async scheduling; a
        stale output's were zeroed at preemption): those kept (AS:59-71), or
        under the 0.33 profile every token given, and a stop that trimmed some
        takes them back from num_computed_tokens as well (S:2756-2770)."""
        if stale:
            return
        if self.config.profile.stop_trims_computed:
            r.num_computed_tokens -= num_given - num_kept
            taken = num_given if r.num_output_placeholders > 0 else 0
        else:
            taken = num_kept if self.config.async_scheduling else 0
        r.num_output_placeholders -= taken
        if r.num_output_placeholders < 0:
            raise SchedulerAssertion(r.request_id, "AS:70 more sampled tokens than placeholders")

    def _cache_output_blocks(self, r: Request, stale: bool, status_before: Status,
                             had_placeholders: bool) -> None:
        """The blocks the output's tokens complete become hash-visible: under
        async scheduling up to the tokens not in flight (AS:73-77), and under
        the 0.33 profile also when decoding speculatively, never for a stale
        output (S:2406-2415)."""
        if status_before != Status.RUNNING:
            return
        if self.config.profile.cache_blocks_at_output:
            if not stale and (had_placeholders or self.config.num_spec_tokens > 0):
                self.kv.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
        elif self.config.async_scheduling:
            self.kv.cache_blocks(r, r.num_computed_tokens - r.num_output_placeholders)

    def _handle_stopped_request(self, r: Request) -> bool:
        """Whether a request that stopped has finished. A session's turn ends
        instead: it is rewound to the tokens whose KV is written (its output in
        flight is dropped), takes its next chunk if one came meanwhile, else
        waits for one, and goes back to waiting with its blocks (S:2465-2491)."""
        if not r.resumable:
            return True
        r.num_computed_tokens -= r.num_output_placeholders
        r.spec_token_ids = []
        r.drop_stale_output = True
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        if r.streaming_queue:
            update = r.streaming_queue.popleft()
            if update is None:   # the end of its input
                return True
            self._update_request_as_session(r, update)
        else:
            r.status = Status.WAITING_FOR_STREAMING_REQ
            self.num_waiting_for_streaming_input += 1
        return False

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

    def _update_request_as_session(self, r: Request, update: StreamingUpdate) -> None:
        """A session takes its next chunk and waits to be scheduled (S:1650-1691).
        It keeps its outputs up to those computed, or under the 0.33 profile up
        to its last sampled token (S:1879-1900)."""
        keep = r.num_computed_tokens
        if self.config.profile.session_keeps_sampled_outputs:
            keep = r.num_tokens - 1
            if keep < r.num_computed_tokens:
                raise SchedulerAssertion(r.request_id, "S:1888 a turn ends with tokens computed "
                                                       "past its last sampled one")
        r.start_next_turn(update, keep, self.config.profile.session_truncates_hashes)
        if r.status == Status.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
        r.status = Status.WAITING

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

    def _blocks_can_be_freed(self, r: Request) -> bool:
        """No step that may still write the request's blocks is in flight."""
        return not self.config.defer_block_free or r.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, r: Request) -> None:
        """Free the request's blocks now, or once the steps writing them are done."""
        if self._blocks_can_be_freed(r):
            self.kv.free(r)
            return
        table = self.kv.pop_blocks(r)
        if table:
            self.deferred_frees.append((self.sched_step_seq, table))

    def _drain_deferred_frees(self) -> None:
        """Tables whose last writing step is processed go back, in the order freed."""
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            self.kv.free_blocks(self.deferred_frees.popleft()[1])

    # ------------------------------------------------------------------ load failures

    def _handle_failed_recving(self, req_ids: set[str]) -> set[str]:
        """Whole async loads that failed (S:3341)."""
        affected = set()
        for req_id in req_ids:
            r = self.requests.get(req_id)
            if r is not None and r.status == Status.WAITING_FOR_REMOTE_KVS:
                affected.add(req_id)
                if self.config.load_failure_policy == "recompute":
                    r.num_computed_tokens = 0
                    self.failed_recving_ids.add(req_id)
        return set() if self.config.load_failure_policy == "recompute" else affected

    def _handle_invalid_blocks(self, invalid: set[int], num_scheduled: dict[str, int]) -> set[str]:
        """Blocks that failed to load: async loads first, then running requests
        (S:3356). Each pass claims shared blocks afresh (S:3274): a block an async load
        claimed is claimed again by the first running request that holds it."""
        loading = [r for r in self.kv_holding_waiting if r.status == Status.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._truncate_requests(loading, invalid, num_scheduled)
        sync_failed, to_evict = self._truncate_requests(self.running, invalid, num_scheduled)
        if not (async_failed or sync_failed):
            return set()
        if self.config.load_failure_policy == "fail":
            self.kv.evict_blocks(to_evict)
            return async_failed | sync_failed
        self.failed_recving_ids |= async_failed
        return sync_failed

    def _truncate_requests(self, requests, invalid: set[int],
                           num_scheduled: dict[str, int]) -> tuple[set[str], set[int]]:
        """Cut each request back to its first failed block (S:3237-3339). A block
        another request already claimed in this call is shared: the claimer
        recomputes it, and this request keeps its pre-step count."""
        affected: set[str] = set()
        to_evict: set[int] = set()
        claimed: set[int] = set()
        for r in requests:
            table = self.kv.get_block_ids(r.request_id)
            if (self.config.profile.invalid_block_base == "cached"
                    and r.status != Status.WAITING_FOR_REMOTE_KVS):
                pre = r.legacy_num_cached_tokens   # legacy: the count at its first admission
            else:
                pre = r.num_computed_tokens - num_scheduled.get(r.request_id, 0)
            hit = truncated = False
            for idx, block_id in enumerate(table[: -(-pre // self.block_size)]):
                if block_id not in invalid:
                    continue
                hit = True
                if block_id in claimed:
                    continue
                claimed.add(block_id)
                if truncated:
                    continue
                truncated = True
                self._truncate_for_invalid_block(r, idx, pre)
                to_evict.update(table[idx:])
            if hit:
                if not truncated:
                    r.num_computed_tokens = pre
                affected.add(r.request_id)
        return affected, to_evict


@dataclass(slots=True)
class _Step:
    """What one schedule() call has decided so far, and the budget left."""

    token_budget: int
    input_budget: int
    threshold: int                      # long_prefill_token_threshold in force, 0 = none
    draft_slots: int = 0                # input slots each scheduled request takes for drafting
    running: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_blocks: dict[str, list[Block]] = field(default_factory=dict)   # running requests only
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec: dict[str, list[int]] = field(default_factory=dict)   # drafts scheduled
    prefill_scheduled: bool = False     # the running pass scheduled a prefill chunk
    prefill_admitted: bool = False      # the waiting pass admitted a prompt to compute
    defer_prefills: bool = False        # prefills are held back this step (cadence.py)

    def has_budget(self) -> bool:
        """Room for one more token, and in the input budget for its request's
        drafting slots too (S:659-662)."""
        return self.token_budget > 0 and self.input_budget > self.draft_slots

    def capped(self, remaining: int) -> int:
        """``remaining`` capped by the long-prefill threshold."""
        return self.threshold if 0 < self.threshold < remaining else remaining

    def room(self) -> int:
        """Tokens this step can still take: the smaller of its two budgets, the
        input budget less the next request's drafting slots (S:711, S:1118)."""
        return min(self.token_budget, self.input_budget - self.draft_slots)

    def chunk(self, remaining: int) -> int:
        """How much of ``remaining`` fits: capped by the threshold and both budgets."""
        return min(self.capped(remaining), self.room())

    def take(self, r: Request, n: int) -> None:
        self.num_scheduled[r.request_id] = n
        self.token_budget -= n
        self.input_budget -= n + self.draft_slots

    def undo(self, r: Request) -> None:
        """A priority victim already scheduled in this step gives its budget back."""
        self.running.remove(r)
        n = self.num_scheduled.pop(r.request_id)
        self.token_budget += n
        self.input_budget += n + self.draft_slots
        self.new_blocks.pop(r.request_id)
        self.spec.pop(r.request_id, None)
