"""The embedded engine's scheduler: the reference scheduler, plus the hook the
simulated store needs (save a request's computed prefix when it is
preempted), and a pool of a fault's own kind for the KV cache. The faults
subclass this."""

from __future__ import annotations

from kvtrace.reference import (ModelOutput, Request, RequestOutput, Scheduler, SchedulerConfig,
                               SchedulerOutput)
from kvtrace.reference.block_pool import BlockPool

from .fault_log import FaultLog
from .kv_store import ExternalKVStore


class EngineScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, connector=None,
                 store: ExternalKVStore | None = None, fault_log: FaultLog | None = None):
        super().__init__(config, connector)
        self.store = store
        self.fault_log = fault_log if fault_log is not None else FaultLog()

    def use_pool(self, pool: BlockPool) -> None:
        """The KV cache draws its blocks from ``pool``, a fault's own kind of
        pool, made as the one it replaces; before any request arrives."""
        self.kv.pool = pool
        for g in getattr(self.kv, "groups", ()):
            g.pool = pool

    def _preempt_request(self, r: Request, drop_stale_output: bool = False,
                         listed: bool = True) -> None:
        if self.store is not None:
            self.store.save_computed(r)
        super()._preempt_request(r, drop_stale_output, listed)

    def update_from_output(self, out: SchedulerOutput, model: ModelOutput) -> list[RequestOutput]:
        requests = {rid: self.requests[rid] for rid in out.num_scheduled_tokens if rid in self.requests}
        results = super().update_from_output(out, model)
        for res in results:
            if res.legacy_counters is not None and res.req_id in requests:
                self._on_counters_emitted(requests[res.req_id], *res.legacy_counters)
        return results

    def _on_counters_emitted(self, r: Request, num_cached: int, num_external: int) -> None:
        """A request's first output carried its legacy counters."""
