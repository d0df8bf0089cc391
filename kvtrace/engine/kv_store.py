"""A simulated external KV store, seen by the scheduler as a connector.

Scheduler side (the Connector protocol of kvtrace.reference.interface):

* ``get_num_new_matched_tokens(request, num_local)`` answers how many tokens
  beyond the local hit the store holds as a prefix of the request's tokens, and
  whether they load asynchronously. A sync hit leaves at least one token to
  compute; an async hit may cover them all, but on a model with state groups
  (``keeps_last_token``): the scheduler computes a whole prompt's last token
  again, and a state group then needs the state before that token, which a
  connector that loaded the whole prompt does not hold (vLLM's Mooncake
  connector answers one token short on such a model,
  ``mooncake_connector.py:946-953``).
* ``update_state_after_alloc`` plans the load of an admitted hit:
  positions [num_local, num_local + E).
* ``request_finished`` saves the request's computed prefix and never delays
  freeing its blocks.

The engine's scheduler also calls ``save_computed`` when it preempts a request,
so a resumed request can find more of itself in the store than before.

Worker side: ``worker_step`` runs once per step after schedule(). Sync loads
complete within the step; async loads are reported in ``finished_recving``
``async_delay_steps`` steps later. Injected failures are reported as
``failed_recving`` (a whole async load, listed in ``finished_recving`` too, as
vLLM requires) or as ``invalid_block_ids`` (a block of a sync load, in the
engine's block numbering), either in the load's step or one step late.
Only a request's first load can fail, so every request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.reference import ModelOutput, Request, Scheduler, Status
from kvtrace.reference.kv_manager import cdiv
from kvtrace.trace.events import KVLoad

from .chance import below, unit
from .fault_log import FaultLog
from .prefix_store import PrefixStore


@dataclass(frozen=True, slots=True)
class StoreSettings:
    capacity_tokens: int
    preload: tuple[tuple[int, ...], ...] = ()   # sequences held from the start
    min_hit_tokens: int = 1                     # smaller hits are answered as 0
    async_fraction: float = 0.0                 # share of requests whose loads are async
    async_delay_steps: int = 1                  # steps until an async load is reported done
    failed_recving_fraction: float = 0.0        # share of first async loads that fail whole
    invalid_blocks_fraction: float = 0.0        # share of first sync loads with a failed block
    late_failure_fraction: float = 0.0          # share of block failures reported a step late
    # The connector's role as vLLM names it. It only decides two scheduler rules
    # under async scheduling: a consumer's frees wait for the steps in flight, a
    # producer's preempted requests drop their output in flight.
    kv_role: str = "kv_both"


@dataclass(slots=True)
class _Lookup:
    local: int
    ext: int
    load_async: bool
    entry: tuple[int, ...] | None


@dataclass(slots=True)
class _Load:
    req: str
    start: int
    end: int
    load_async: bool
    first: bool          # the request's first load: the only one that may fail


@dataclass(slots=True)
class _Report:
    due: int             # the step whose output carries it
    req: str
    kind: str            # "recv", "failed_recv" or "invalid_block"
    block_index: int = -1
    block_id: int = -1


class ExternalKVStore:
    def __init__(self, settings: StoreSettings, block_size: int, seed: int,
                 fault_log: FaultLog | None = None, skip_reload_after_preempt: bool = False,
                 keeps_last_token: bool = False):
        self.settings = settings
        self.keeps_last_token = keeps_last_token   # no hit covers a request's last token
        self.block_size = block_size
        self.seed = seed
        self.contents = PrefixStore(settings.capacity_tokens)
        for tokens in settings.preload:
            self.contents.save(tokens)
        self.fault_log = fault_log
        # Fault no-reload-after-preempt: plan no load for a resumed request.
        self.skip_reload_after_preempt = skip_reload_after_preempt
        self._last_lookup: dict[str, _Lookup] = {}
        self._num_loads: dict[str, int] = {}
        self._plan: list[KVLoad] = []          # what this step's schedule() planned
        self._started: list[_Load] = []        # handed to the worker side this step
        self._reports: list[_Report] = []

    # ------------------------------------------------------------ scheduler side

    def load_is_async(self, req_id: str) -> bool:
        return unit(self.seed, "async", req_id) < self.settings.async_fraction

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        held, entry = self.contents.longest_prefix(request.all_token_ids)
        load_async = self.load_is_async(request.request_id)
        limit = request.num_tokens - num_computed_tokens - (
            0 if load_async and not self.keeps_last_token else 1)
        ext = max(0, min(held - num_computed_tokens, limit))
        if ext < self.settings.min_hit_tokens:
            ext = 0
        load_async = load_async and ext > 0
        self._last_lookup[request.request_id] = _Lookup(num_computed_tokens, ext, load_async, entry)
        return ext, load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        lk = self._last_lookup[request.request_id]
        assert lk.ext == num_external_tokens, "allocation does not follow the last lookup"
        if lk.entry is not None:
            self.contents.touch(lk.entry)
        n = self._num_loads.get(request.request_id, 0) + 1
        self._num_loads[request.request_id] = n
        load = _Load(request.request_id, lk.local, lk.local + lk.ext, lk.load_async, first=n == 1)
        if self.skip_reload_after_preempt and request.num_preemptions > 0:
            self.fault_log.note(request.request_id,
                                f"no load planned for resumed hit [{load.start}, {load.end})")
            if load.load_async:   # still report it done, or the request would wait forever;
                # due < 0: the worker dates it when it next runs
                self._reports.append(_Report(-1, load.req, "recv"))
            return
        self._plan.append(KVLoad(load.req, load.start, load.end))
        self._started.append(load)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self.save_computed(request)
        return False

    def save_computed(self, request: Request) -> None:
        """Save the prefix whose KV the request has computed (on finish and on preemption)."""
        self.contents.save(request.all_token_ids[: request.num_computed_tokens])

    def take_loads(self) -> list[KVLoad]:
        """The load plan of the step just scheduled."""
        out, self._plan = self._plan, []
        return out

    # ------------------------------------------------------------ worker side

    def worker_step(self, step: int, sched: Scheduler, model: ModelOutput) -> None:
        """Run this step's loads and put what finished or failed into ``model``."""
        s = self.settings
        for report in self._reports:
            if report.due < 0:
                report.due = step + s.async_delay_steps
        for load in self._started:
            if load.load_async:
                fails = load.first and unit(self.seed, "fail-request", load.req) < s.failed_recving_fraction
                self._reports.append(_Report(step + s.async_delay_steps, load.req,
                                             "failed_recv" if fails else "recv"))
            elif load.first and unit(self.seed, "fail-blocks", load.req) < s.invalid_blocks_fraction:
                report = self._block_failure(step, load, sched)
                if report is not None:
                    self._reports.append(report)
        self._started = []

        due = [r for r in self._reports if r.due == step]
        self._reports = [r for r in self._reports if r.due != step]
        for r in due:
            if r.kind == "recv":
                model.finished_recving.add(r.req)
            elif r.kind == "failed_recv":
                model.failed_recving.add(r.req)
                model.finished_recving.add(r.req)
            elif self._still_holds(sched, r):
                model.invalid_block_ids.add(r.block_id)

    def _block_failure(self, step: int, load: _Load, sched: Scheduler) -> _Report | None:
        """One block of a sync load fails; sometimes the worker learns it a step late.
        None when the request no longer holds the block: under async scheduling the
        worker runs a step after the load was planned, and the request may have
        been freed or preempted meanwhile."""
        table = sched.kv.get_block_ids(load.req)
        first, last = load.start // self.block_size, cdiv(load.end, self.block_size)
        late = unit(self.seed, "fail-late", load.req) < self.settings.late_failure_fraction
        # A late report names the load's first block, so it cuts back every
        # token computed since: the case where legacy counters went negative.
        idx = first if late else first + below(last - first, self.seed, "fail-block", load.req)
        if idx >= len(table):
            return None
        return _Report(step + (1 if late else 0), load.req, "invalid_block", idx, table[idx])

    @staticmethod
    def _still_holds(sched: Scheduler, r: _Report) -> bool:
        req = sched.requests.get(r.req)
        if req is None or req.status != Status.RUNNING:
            return False
        table = sched.kv.get_block_ids(r.req)
        return r.block_index < len(table) and table[r.block_index] == r.block_id

    def has_pending(self) -> bool:
        return bool(self._reports or self._started)
