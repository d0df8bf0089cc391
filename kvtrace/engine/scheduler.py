"""The embedded engine's scheduler: the reference scheduler, plus the one hook
the simulated store needs (save a request's computed prefix when it is
preempted). The faults subclass this."""

from __future__ import annotations

from kvtrace.reference import Request, Scheduler, SchedulerConfig

from .fault_log import FaultLog
from .kv_store import ExternalKVStore


class EngineScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, connector=None,
                 store: ExternalKVStore | None = None, fault_log: FaultLog | None = None):
        super().__init__(config, connector)
        self.store = store
        self.fault_log = fault_log if fault_log is not None else FaultLog()

    def _preempt_request(self, r: Request) -> None:
        if self.store is not None:
            self.store.save_computed(r)
        super()._preempt_request(r)
