"""The waiting pass's admissions: which queue it takes from, whether a request
may be admitted, its lookup (local prefix cache, then the connector), the
tokens it is scheduled, its blocks, and what admitting it changes
(semantics doc 2.2, S:899-1401)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from .interface import SchedulerAssertion, failing_for
from .kv_groups import GroupedKVCacheManager
from .kv_manager import Blocks
from .output import Outputs
from .request import Request, Status
from .step import StepPlan


@dataclass(slots=True)
class Lookup:
    """What an admission starts from: the local hit's blocks and length, the
    connector's hit, whether it loads asynchronously, and the tokens computed."""

    hits: Blocks
    num_local: int
    num_external: int
    load_async: bool
    num_computed: int
    looked: bool = True   # False: the request had tokens computed, and nothing was looked up


@dataclass(slots=True)
class Skipped:
    """Requests a waiting pass skipped, to go back to the head of their queue in order."""

    holding: deque[Request] = field(default_factory=deque)
    waiting: deque[Request] = field(default_factory=deque)

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self) -> None:
        self.holding, self.waiting = deque(), deque()


@mypyc_attr(allow_interpreted_subclasses=True)
class Admission(Outputs):
    """A part of the Scheduler (feature.py): its config, queues and KV manager are ``self``'s."""

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

    def _has_seat(self, step: StepPlan) -> bool:
        """Room for one more request: in the input budget, with its drafting
        slots, and under max_num_seqs (sessions waiting for input hold seats)."""
        num_active = len(self.running)
        if self.config.profile.sessions_hold_slots:
            num_active += self.num_waiting_for_streaming_input
        max_active = self.config.max_num_active_seqs or self.config.max_num_seqs
        return step.input_budget > step.draft_slots and num_active < max_active

    def _loras_in_step(self, step: StepPlan) -> set[int]:
        """The LoRA adapters this step runs so far (S:889-897); under the 0.33
        profile those of every running request, scheduled or not (S:1038-1047)."""
        if not self.config.max_loras:
            return set()
        holders = self.running if self.config.profile.lora_slots_of_all_running else step.running
        return {r.lora[0] for r in holders if r.lora}

    def _may_admit(self, r: Request, loras: set[int]) -> bool:
        """Not while its load runs or its stale output is still to deliver
        (S:934), nor when its adapter would exceed max_loras (S:941-952)."""
        if not self._ready_to_schedule(r) or (r.num_stale_output_tokens
                                              and not r.drop_stale_output):
            return False
        max_loras = self.config.max_loras
        return not (max_loras and r.lora and len(loras) == max_loras and r.lora[0] not in loras)

    def _skip(self, queue, skipped: Skipped) -> None:
        """Take the head of ``queue`` out of this pass: it goes back afterwards,
        to the queue of those holding blocks if it holds some (S:1398-1401)."""
        r = queue.pop_request()
        self.deferred_waiting.add(r)
        holds = (r.num_computed_tokens > 0 or r.status == Status.WAITING_FOR_REMOTE_KVS
                 or self.config.profile.waiting_queues == "skipped")   # legacy: all skipped
        (skipped.holding if holds else skipped.waiting).appendleft(r)

    def _lookup(self, r: Request) -> Lookup | None:
        """A fresh lookup (first admission, a retry, a resume after preemption):
        the local prefix cache, then the connector; or, for an async load that
        has completed, the blocks already in place. None when the connector
        cannot tell yet."""
        if r.num_computed_tokens > 0:
            return Lookup([], 0, 0, False, r.num_computed_tokens, looked=False)
        if r.resumable and r.hash_lookahead:
            r.rehash()   # a turn's dropped token may linger in a lookahead hash (S:1111-1115)
        lags = False
        hits: Blocks
        if (self.config.connector_restores_states and self.connector is not None
                and isinstance(self.kv, GroupedKVCacheManager)):
            # Full attention's own hit, a state group's lagging state to come
            # with the external hit (S:558-568).
            hits, num_local, lags = self.kv.get_computed_blocks_for_connector(r)
        else:
            hits, num_local = self._local_prefix_hit(r)
        num_external, load_async = self._external_hit(r, num_local)
        if num_external is None:
            return None
        if lags and not num_external:
            # No external hit brings the lagging state: the hit every group
            # holds (S:1029-1037).
            hits, num_local = self.kv.get_computed_blocks(r)
        num_computed = num_local + num_external
        if num_computed > r.num_tokens:
            raise SchedulerAssertion(r.request_id, "S:1048 local + external hit exceeds num_tokens")
        self._record_lookup(r, num_local, num_external, load_async)
        return Lookup(hits, num_local, num_external, load_async, num_computed)

    def _admission_tokens(self, r: Request, lookup: Lookup,
                          step: StepPlan) -> tuple[int | None, bool]:
        """The tokens an admission schedules (0 for an async load), and whether
        it is a one-token decode padded with -1 drafts; None when it does not
        fit this step, which stops the waiting pass."""
        if lookup.load_async:
            return 0, False
        num_computed = lookup.num_computed
        if step.defer_prefills and num_computed < r.num_tokens - 1:
            return None, False   # prefills are held back this step (S:1113)
        k = self.config.num_spec_tokens
        want = r.num_tokens - num_computed
        padded = want == 1 and self._pads_with_drafts(step, num_computed)
        if padded:
            if 1 + k > step.room():
                return None, False   # rather not scheduled than scheduled unpadded (S:1146-1148)
            want = 1 + k
        want = step.capped(want)
        if not self.config.enable_chunked_prefill and want > step.room():
            return None, False   # chunked prefill off: the request waits whole (S:1160-1167)
        n = min(want, step.room())
        if n <= 0:
            raise SchedulerAssertion(
                r.request_id, "S:1170 an admission must leave a token to compute (a sync "
                              "external hit over the whole prompt, or a count past its tokens)")
        if self.state_split is not None:
            n = self.state_split.chunk(r, num_computed, n)   # S:1172-1190
            if n == 0:
                return None, False   # no block-aligned chunk fits
            if padded and n != 1 + self.config.num_spec_tokens:
                n, padded = 1, False   # the split clipped the padding: it is dropped
        return n, padded

    def _allocate_admission(self, r: Request, n: int, lookup: Lookup) -> bool:
        """Blocks for the hit and ``n`` new tokens; the connector is told what it
        loads into them. False when they do not fit."""
        with failing_for(r.request_id):
            blocks = self.kv.allocate_slots(
                r, n, lookup.num_local, lookup.hits, lookup.num_external,
                delay_cache_blocks=lookup.load_async,
                reserved_blocks=self._blocks_reserved_for_loads() if lookup.load_async else 0,
                has_scheduled_reqs=bool(self.running),
                full_sequence_must_fit=self.config.reserve_full_isl,
                num_lookahead_tokens=self._admission_lookahead(r, lookup.load_async))
        if blocks is None:
            return False
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                r, self.kv.get_block_ids(r.request_id), lookup.num_external)
            if lookup.looked:
                self._count_connector_query(r, lookup.num_local, lookup.num_external)
        return True

    def _admit(self, r: Request, n: int, padded: bool, num_computed: int, step: StepPlan,
               loras: set[int]) -> None:
        """``r`` runs from this step on, with ``n`` tokens scheduled."""
        self.deferred_waiting.discard(r)
        self.running.append(r)
        (step.new if r.status == Status.WAITING else step.resumed).append(r)
        if self.config.max_loras and r.lora:
            loras.add(r.lora[0])
        step.take(r, n)
        if padded:
            k = self.config.num_spec_tokens
            if n != 1 + k:
                raise SchedulerAssertion(
                    r.request_id, "S:1372 a padded decode lost its padding to the "
                                  "long-prefill threshold")
            step.spec[r.request_id] = [-1] * k
        r.status = Status.RUNNING
        r.num_computed_tokens = num_computed
        step.prefill_admitted |= num_computed < r.num_tokens - 1
        self._on_admitted(r)
        if num_computed + n < r.num_tokens:
            self.inflight_prefills.add(r)
