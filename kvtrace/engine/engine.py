"""The embedded engine's loop: the reference scheduler driven by a workload, the
token sampler and the simulated KV store, written down as a trace.

One step is what vLLM's engine core does in one iteration:

    add the arrivals and aborts due now
    out = schedule()                      -> a Step event (with lookups and loads)
    run the model and the store's worker  -> sampled tokens, connector output
    update_from_output(out, model)        -> an Output event, PromptStats events

update_from_output runs after every schedule(), also when nothing was scheduled.
Under async scheduling (the workload's config says so) the update for step N
comes after schedule() for step N+1, as in vLLM's engine core.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import kvtrace
from kvtrace import bridge
from kvtrace.reference import ModelOutput, Status
from kvtrace.reference.profiles import DEFAULT, PROFILES
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceWriter

from .fault_log import FaultEvent, FaultLog
from .faults import STORE_FAULTS, scheduler_class
from .kv_store import ExternalKVStore
from .lookups import LookupRecorder
from .sampler import EOS_TOKEN_ID, Sampler
from .workloads import PlannedPause, Workload, build_workload, under_async_scheduling

ENGINE_NAME = "kvtrace-embedded"
CONNECTOR_NAME = "kvtrace-simulated-store"
MAX_STEPS = 2_000_000
PROGRESS_EVERY = 256   # steps between progress calls
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
                    fault: str | None = None, seed: int = 0, counters: str = "both",
                    async_scheduling: bool = False,
                    progress: Callable[[int], None] | None = None,
                    profile: str = DEFAULT.name, open_writer: Callable = TraceWriter) -> RecordResult:
    """Run a built-in workload on the embedded engine and write its trace.

    ``counters`` says which prompt accounting the PromptStats events carry:
    "both" (vLLM 0.32's PrefillStats and the legacy pair), "legacy" or
    "prefill_stats". ``async_scheduling`` runs the engine as vLLM's
    AsyncScheduler and batch queue do. ``profile`` names the vLLM release
    whose rules the engine's scheduler follows (kvtrace.reference.profiles),
    written in the header. Raises EngineStalled (after writing the
    trace) when the scheduler gets stuck. ``progress``, if given, is called now
    and then with the number of steps run so far. ``open_writer``: as
    ``record_workload``'s.
    """
    wl = build_workload(workload, seed)
    if async_scheduling:
        wl = under_async_scheduling(wl)
    if profile != DEFAULT.name:
        chosen = PROFILES[profile]
        if async_scheduling and not chosen.async_scheduling_modelled:
            raise ValueError(f"the {profile} profile does not model async scheduling")
        # A release without whole-sequence admission runs without it.
        reserve = wl.config.reserve_full_isl and chosen.has_full_sequence_admission
        wl = replace(wl, config=replace(wl.config, profile=chosen, reserve_full_isl=reserve))
    return record_workload(out_path, wl, fault, seed, counters, progress, open_writer)


def record_workload(out_path: str | os.PathLike, wl: Workload, fault: str | None = None,
                    seed: int = 0, counters: str = "both",
                    progress: Callable[[int], None] | None = None,
                    open_writer: Callable = TraceWriter,
                    scheduler_cls: type | None = None) -> RecordResult:
    """``record_embedded`` for a Workload built by the caller. ``open_writer``
    makes the writer from the path and the header: ``TraceWriter``, or one
    with its calls that hands each completed step on (``end_step``) where a
    kill cannot reach it (``kvtrace.record.step_writer``, which ``kvtrace
    record`` uses). ``scheduler_cls`` runs instead of ``fault``'s scheduler
    (a fault of content_faults.py), named in the header as its fault."""
    if scheduler_cls is not None:
        from .content_faults import FAULTS as CONTENT_FAULTS

        fault = next((k for k, v in CONTENT_FAULTS.items() if v is scheduler_cls),
                     scheduler_cls.__name__)
    if counters not in COUNTERS:
        raise ValueError(f"unknown counters {counters!r}; choose one of {', '.join(COUNTERS)}")
    if wl.store is not None:
        defer, delivery = bridge.connector_rules(wl.store.kv_role, wl.config.async_scheduling,
                                                 wl.config.profile)
        wl = replace(wl, config=replace(wl.config, defer_block_free=defer,
                                        requires_kv_delivery=delivery))
    workload = wl.name
    engine = _Engine(wl, fault, seed, scheduler_cls)
    engine.progress = progress
    header = ev.Header(
        engine=ENGINE_NAME,
        engine_version=kvtrace.__version__,
        config=bridge.header_config(wl.config, CONNECTOR_NAME if wl.store else None),
        counters="prefill_stats" if counters == "prefill_stats" else "legacy",
        features={**bridge.header_features(wl.config),
                  **({"kv_role": wl.store.kv_role} if wl.store else {}),
                  "profile": wl.config.profile.name},
        meta={"workload": workload, "fault": fault, "seed": seed},
    )
    result = RecordResult(Path(out_path), requests=len(wl.arrivals))
    try:
        with open_writer(out_path, header) as writer:
            engine.run(writer, counters, result)
    except EngineStalled as stall:
        stall.result = result          # the trace and the fault log up to the stall
        raise
    finally:
        result.fault_log = list(engine.fault_log)
    return result


class _Engine:
    def __init__(self, wl: Workload, fault: str | None, seed: int,
                 scheduler_cls: type | None = None):
        self.wl = wl
        self.fault_log = FaultLog()
        self.store = None
        self.lookups = None
        if wl.store is not None:
            states = any(g.state is not None for g in wl.config.kv_groups)
            self.store = ExternalKVStore(wl.store, wl.config.block_size, seed, self.fault_log,
                                         skip_reload_after_preempt=fault in STORE_FAULTS,
                                         keeps_last_token=states)
            self.lookups = LookupRecorder(self.store)
        elif fault in STORE_FAULTS:
            raise ValueError(f"fault {fault!r} needs a workload with an external store")
        cls = scheduler_cls or scheduler_class(fault)
        self.sched = cls(wl.config, self.lookups, self.store, self.fault_log)
        self.sampler = Sampler(seed, wl.vocab_size, wl.eos_probability)
        self.progress: Callable[[int], None] | None = None   # told the steps run, now and then

    def run(self, writer: TraceWriter, counters: str, result: RecordResult) -> None:
        """Synchronous engine steps: each schedule() is followed by its update."""
        if self.wl.config.async_scheduling:
            return self._run_async(writer, counters, result)
        self._plan()
        for step in range(MAX_STEPS):
            self.fault_log.step = step
            self._arrivals_due(writer, step)
            self._aborts_due(writer, step)
            self._calls_due(writer, step)
            out, model = self._schedule(writer, step, result)
            self._update(writer, step, out, model, counters)
            writer.end_step()
            result.steps = step + 1
            if self.progress is not None and step % PROGRESS_EVERY == 0:
                self.progress(step + 1)
            if self._finished():
                return
            self._check_progress(writer, step, out)
        raise self._too_long(writer)

    def _run_async(self, writer: TraceWriter, counters: str, result: RecordResult) -> None:
        """Async scheduling, as vLLM's engine core runs its batch queue of two
        (EC:698-790): schedule() for step N+1 comes before the update for step
        N, whose aborts are applied just before it."""
        self._plan()
        in_flight: deque = deque()   # (step, out, model), oldest first
        for step in range(MAX_STEPS):
            self.fault_log.step = step
            self._arrivals_due(writer, step)
            self._calls_due(writer, step)
            out, model = self._schedule(writer, step, result)
            in_flight.append((step, out, model))
            result.steps = step + 1
            if self.progress is not None and step % PROGRESS_EVERY == 0:
                self.progress(step + 1)
            if len(in_flight) < 2 and (out.num_scheduled_tokens or self.sched.requests):
                continue   # the queue is not full: schedule the next step first
            self._aborts_due(writer, step)
            done_step, done_out, done_model = in_flight.popleft()
            self._update(writer, done_step, done_out, done_model, counters)
            writer.end_step()
            if self._finished():
                while in_flight:   # no request left: the queue is drained (EC:761-768)
                    self._update(writer, *in_flight.popleft(), counters)
                    writer.end_step()
                return
            self._check_progress(writer, step, done_out)
        raise self._too_long(writer)

    # -- one engine step, in parts -------------------------------------------------

    def _plan(self) -> None:
        """The workload's timed inputs in order, each with a cursor."""
        self._arrivals = sorted(self.wl.arrivals, key=lambda a: a.step)
        self._aborts = sorted(self.wl.aborts, key=lambda a: a.step)
        # Scheduler-wide calls: at one step, resets before pause states.
        self._calls = sorted(self.wl.resets + self.wl.pauses,
                             key=lambda c: (c.step, isinstance(c, PlannedPause)))
        self._ai = self._bi = self._ci = self._idle = 0
        self._preempted: dict[str, int] = {}   # request -> preemptions since its last token

    def _arrivals_due(self, writer: TraceWriter, step: int) -> None:
        arrivals = self._arrivals
        while self._ai < len(arrivals) and arrivals[self._ai].step <= step:
            self._arrive(writer, arrivals[self._ai])
            self._ai += 1

    def _calls_due(self, writer: TraceWriter, step: int) -> None:
        """Prefix-cache resets and pause states planned up to this step."""
        calls = self._calls
        while self._ci < len(calls) and calls[self._ci].step <= step:
            c = calls[self._ci]
            if isinstance(c, PlannedPause):
                self.sched.set_pause_state(c.state)
                writer.write(ev.PauseState(writer.next_seq(), c.state))
            else:
                ok = self.sched.reset_prefix_cache(c.reset_running_requests)
                writer.write(ev.ResetPrefixCache(writer.next_seq(), c.reset_running_requests, ok))
            self._ci += 1

    def _aborts_due(self, writer: TraceWriter, step: int) -> None:
        aborts, due = self._aborts, []
        while self._bi < len(aborts) and aborts[self._bi].step <= step:
            due.append(aborts[self._bi].req)
            self._bi += 1
        self._abort(writer, due)

    def _schedule(self, writer: TraceWriter, step: int, result: RecordResult):
        """schedule(), its step record, and what the model samples for it."""
        sched = self.sched
        out = sched.schedule()
        lookups = self.lookups.take() if self.lookups else []
        loads = self.store.take_loads() if self.store else None
        writer.write(bridge.step_event(writer.next_seq(), step, out, sched, lookups, loads))
        result.preemptions += len(out.preempted_req_ids)
        return out, ModelOutput(sampled_token_ids=self.sampler.sample(sched, out))

    def _update(self, writer: TraceWriter, step: int, out, model: ModelOutput, counters: str) -> None:
        """The store's worker for the step, then update_from_output and its records."""
        sched, preempted = self.sched, self._preempted
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

    def _finished(self) -> bool:
        # Resets planned after the last request has finished are not made.
        return (self._ai == len(self._arrivals) and self._bi == len(self._aborts)
                and not self.sched.requests
                and not (self.store and self.store.has_pending()))

    def _check_progress(self, writer: TraceWriter, step: int, out) -> None:
        """Give up on a preemption loop or a stall (the trace so far is kept)."""
        looping = [req for req, n in self._preempted.items() if n >= LOOP_PREEMPTIONS]
        if looping:
            raise EngineStalled(
                f"the engine is in a preemption loop: {looping[0]} was preempted "
                f"{LOOP_PREEMPTIONS} times without producing a token (up to step {step}); "
                f"the trace up to there is in {writer.path}")
        for req in out.finished_req_ids:
            self._preempted.pop(req, None)
        self._idle = 0 if out.num_scheduled_tokens else self._idle + 1
        if self._idle >= STALL_STEPS and not (self.store and self.store.has_pending()):
            raise EngineStalled(
                f"the engine stalled: nothing scheduled for {self._idle} steps (up to step {step}) "
                f"while {len(self.sched.requests)} requests wait; the trace up to there is in "
                f"{writer.path}")

    def _too_long(self, writer: TraceWriter) -> EngineStalled:
        return EngineStalled(f"workload {self.wl.name!r} did not finish within {MAX_STEPS} steps; "
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
