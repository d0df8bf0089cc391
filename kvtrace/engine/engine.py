"""The embedded engine's loop: the reference scheduler driven by a workload, the
token sampler and the simulated KV store, written down as a trace.

One step is what vLLM's engine core does in one iteration:

    add the arrivals and aborts due now
    out = schedule()                      -> a Step event (with lookups and loads)
    run the model and the store's worker  -> sampled tokens, connector output
    update_from_output(out, model)        -> an Output event, PromptStats events

update_from_output runs after every schedule(), also when nothing was scheduled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import kvtrace
from kvtrace import bridge
from kvtrace.reference import ModelOutput, Status
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceWriter

from .fault_log import FaultEvent, FaultLog
from .faults import STORE_FAULTS, scheduler_class
from .kv_store import ExternalKVStore
from .lookups import LookupRecorder
from .sampler import EOS_TOKEN_ID, Sampler
from .workloads import Workload, build_workload

ENGINE_NAME = "kvtrace-embedded"
CONNECTOR_NAME = "kvtrace-simulated-store"
MAX_STEPS = 2_000_000
# Steps with nothing scheduled (and no transfer in flight) after which the engine
# gives up: the scheduler is stuck, as vLLM 0.32's is in some load-failure cases
# (docs/findings.md).
STALL_STEPS = 256
# Preemptions of one request without a sampled token in between after which the
# engine gives up: it is in a preemption loop, as vLLM 0.32 can be without
# full-sequence reservation (docs/findings.md).
LOOP_PREEMPTIONS = 256


class EngineStalled(RuntimeError):
    """The run could not finish. The trace is written, and ends as 'interrupted'."""

    exit_code = 1
COUNTERS = ("both", "legacy", "prefill_stats")


@dataclass
class RecordResult:
    path: Path
    steps: int = 0
    requests: int = 0
    preemptions: int = 0
    fault_log: list[FaultEvent] = field(default_factory=list)


def record_embedded(out_path: str | os.PathLike, workload: str = "shared-prefix",
                    fault: str | None = None, seed: int = 0, counters: str = "both") -> RecordResult:
    """Run a built-in workload on the embedded engine and write its trace.

    ``counters`` says which prompt accounting the PromptStats events carry:
    "both" (vLLM 0.32's PrefillStats and the legacy pair), "legacy" or
    "prefill_stats". Raises EngineStalled (after writing the trace) when the
    scheduler gets stuck.
    """
    return record_workload(out_path, build_workload(workload, seed), fault, seed, counters)


def record_workload(out_path: str | os.PathLike, wl: Workload, fault: str | None = None,
                    seed: int = 0, counters: str = "both") -> RecordResult:
    """``record_embedded`` for a Workload built by the caller."""
    if counters not in COUNTERS:
        raise ValueError(f"unknown counters {counters!r}; choose one of {', '.join(COUNTERS)}")
    workload = wl.name
    engine = _Engine(wl, fault, seed)
    header = ev.Header(
        engine=ENGINE_NAME,
        engine_version=kvtrace.__version__,
        config=bridge.header_config(wl.config, CONNECTOR_NAME if wl.store else None),
        counters="prefill_stats" if counters == "prefill_stats" else "legacy",
        features=bridge.header_features(wl.config),
        meta={"workload": workload, "fault": fault, "seed": seed},
    )
    result = RecordResult(Path(out_path), requests=len(wl.arrivals))
    try:
        with TraceWriter(out_path, header) as writer:
            engine.run(writer, counters, result)
    except EngineStalled as stall:
        stall.result = result          # the trace and the fault log up to the stall
        raise
    finally:
        result.fault_log = list(engine.fault_log)
    return result


class _Engine:
    def __init__(self, wl: Workload, fault: str | None, seed: int):
        self.wl = wl
        self.fault_log = FaultLog()
        self.store = None
        self.lookups = None
        if wl.store is not None:
            self.store = ExternalKVStore(wl.store, wl.config.block_size, seed, self.fault_log,
                                         skip_reload_after_preempt=fault in STORE_FAULTS)
            self.lookups = LookupRecorder(self.store)
        elif fault in STORE_FAULTS:
            raise ValueError(f"fault {fault!r} needs a workload with an external store")
        self.sched = scheduler_class(fault)(wl.config, self.lookups, self.store, self.fault_log)
        self.sampler = Sampler(seed, wl.vocab_size, wl.eos_probability)

    def run(self, writer: TraceWriter, counters: str, result: RecordResult) -> None:
        wl, sched = self.wl, self.sched
        arrivals = sorted(wl.arrivals, key=lambda a: a.step)
        aborts = sorted(wl.aborts, key=lambda a: a.step)
        ai = bi = idle = 0
        preempted: dict[str, int] = {}   # request -> preemptions since its last sampled token
        for step in range(MAX_STEPS):
            self.fault_log.step = step
            while ai < len(arrivals) and arrivals[ai].step <= step:
                self._arrive(writer, arrivals[ai])
                ai += 1
            due = []
            while bi < len(aborts) and aborts[bi].step <= step:
                due.append(aborts[bi].req)
                bi += 1
            self._abort(writer, due)

            out = sched.schedule()
            lookups = self.lookups.take() if self.lookups else []
            loads = self.store.take_loads() if self.store else None
            writer.write(bridge.step_event(writer.next_seq(), step, out, sched, lookups, loads))
            result.preemptions += len(out.preempted_req_ids)

            model = ModelOutput(sampled_token_ids=self.sampler.sample(sched, out))
            for req in out.preempted_req_ids:
                preempted[req] = preempted.get(req, 0) + 1
            for req in model.sampled_token_ids:
                preempted.pop(req, None)
            if self.store is not None:
                self.store.worker_step(step, sched, model)
            touched = bridge.touched_by_output(sched, out, model)
            results = sched.update_from_output(out, model)
            for event in bridge.output_events(writer.next_seq, step, model, results, sched, touched):
                writer.write(_keep_counters(event, counters))

            result.steps = step + 1
            if (ai == len(arrivals) and bi == len(aborts) and not sched.requests
                    and not (self.store and self.store.has_pending())):
                return
            looping = [req for req, n in preempted.items() if n >= LOOP_PREEMPTIONS]
            if looping:
                raise EngineStalled(
                    f"the engine is in a preemption loop: {looping[0]} was preempted "
                    f"{LOOP_PREEMPTIONS} times without producing a token (up to step {step}); "
                    f"the trace up to there is in {writer.path}")
            for req in out.finished_req_ids:
                preempted.pop(req, None)
            idle = 0 if out.num_scheduled_tokens else idle + 1
            if idle >= STALL_STEPS and not (self.store and self.store.has_pending()):
                raise EngineStalled(
                    f"the engine stalled: nothing scheduled for {idle} steps (up to step {step}) "
                    f"while {len(sched.requests)} requests wait; the trace up to there is in "
                    f"{writer.path}")
        raise EngineStalled(f"workload {wl.name!r} did not finish within {MAX_STEPS} steps; "
                            f"the trace up to there is in {writer.path}")

    def _arrive(self, writer: TraceWriter, a) -> None:
        arrival = ev.Arrival(seq=writer.next_seq(), req=a.req, prompt_token_ids=list(a.prompt),
                             max_tokens=a.max_tokens, arrival_time=float(a.step), priority=a.priority,
                             eos_token_id=EOS_TOKEN_ID if self.wl.eos_probability else None)
        writer.write(arrival)
        self.sched.add_request(bridge.request_from_arrival(arrival, self.wl.config.block_size))

    def _abort(self, writer: TraceWriter, req_ids: list[str]) -> None:
        live = [r for r in req_ids
                if r in self.sched.requests and not self.sched.requests[r].is_finished]
        if not live:
            return
        writer.write(ev.Abort(seq=writer.next_seq(), reqs=live))
        self.sched.finish_requests(live, Status.FINISHED_ABORTED)


def _keep_counters(event, counters: str):
    if isinstance(event, ev.PromptStats):
        if counters == "legacy":
            event.prefill_stats = None
        elif counters == "prefill_stats":
            event.legacy = None
    return event
