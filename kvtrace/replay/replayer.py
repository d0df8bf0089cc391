"""Replay: feed a trace's inputs through the reference scheduler, in the recorded
call order, and compare every recorded output with the reference's.

Inputs taken from the trace: arrivals, aborts, prefix-cache resets, the
connector's answers, when grammars finished compiling, sampled tokens (and the
grammar's refusals of them), drafts and the connector output. Everything else
is recomputed.
"""

from __future__ import annotations

import os
from collections import Counter
from itertools import chain

import msgspec

from kvtrace import bridge
from kvtrace.findings import Divergence, Stop
from kvtrace.reference import Request, RequestOutput, Scheduler, SchedulerAssertion, SchedulerOutput, Status
from kvtrace.reference.profiles import Profile
from kvtrace.results import ReplayResult
from kvtrace.trace import TraceError, TraceReader, TraceWriter
from kvtrace.trace import events as ev

from . import checks, derive
from .connector import RecordedConnector
from .data_path import DataPath
from .data_path import summary as data_path_summary
from .failed_step import failed_record, run_failed_step
from .liveness import ProgressWatch
from .plan import ReplayedTrace, check_supported, choose_profile, plan

PROGRESS_EVERY = 4096   # events between progress calls
# Async scheduling: a step whose output has not come this many steps later never will.
_OUTPUT_WINDOW = 64


class Replayer:
    """Event-at-a-time replay. ``feed`` takes the events of one trace in order."""

    def __init__(self, header: ev.Header, path: str = "<trace>", out: TraceWriter | None = None,
                 device: str | None = "auto", content_worker: bool = False,
                 shared: tuple[int, int] | None = None,
                 gate: bool = False, profile: Profile | None = None):
        self.header = header
        self.path = path
        self.cfg = header.config
        self.connector = RecordedConnector()
        self.sched = Scheduler(bridge.config_from_header(header, profile),
                               self.connector if header.config.connector else None)
        keeps = self.sched.config.profile.session_keeps_sampled_outputs
        self.out = out
        # The shadow-KV content check; device None turns it off. With
        # ``content_worker`` it runs in a second process that reads ``path`` itself
        # (through ``shared``, from this process's reader of it, when given), and
        # with ``gate`` runs the checks across records too (kv_content/worker.py).
        self.content = None
        if device and content_worker:
            from .kv_content.worker import ContentWorker

            self.content = ContentWorker(path, device, shared, validate=gate,
                                         session_keeps_sampled=keeps)
        elif device:
            from .kv_content.check import ContentCheck   # imports torch; only when the check runs

            self.content = ContentCheck(header.config, device,
                                        header.features.async_scheduling is True,
                                        session_keeps_sampled=keeps,
                                        groups=header.features.kv_cache_groups)
        self.divergences: list[Divergence] = []
        self._last_out = None   # the reference's previous step, for derivations
        self.data_path = DataPath()   # the KV audit's records, checked (rules D1-D3)
        self._kv_placed = 0   # content-check divergences placed in the list so far
        self.steps = 0
        self.steps_in_trace = 0   # counted past a stop too: the reader reads on
        self.stopped: str | None = None
        self.stop: Stop | None = None   # a stop before the trace's end record
        self._outputs: dict[int, SchedulerOutput] = {}         # step -> output awaiting update
        self._spec: dict[int, dict[str, list[int]]] = {}      # step -> drafts it scheduled, likewise
        self._expected_stats: dict[str, RequestOutput] = {}   # req -> first output, awaiting stats
        self._finished_refs: dict[str, Request] = {}          # finished requests, for their stats
        self._preemptions: dict[str, int] = {}
        # Per KV-cache group: where it may hold the null block (a sliding window's
        # tables; a state group's tables and new blocks).
        self._windowed = checks.null_blocks(header.features)
        self._progress = ProgressWatch()
        # Async scheduling: the ids each recorded step samples a token for, for
        # the steps with no recorded output yet (the I1 check's allowance for
        # output placeholders).
        self._in_flight: dict[int, list[str]] | None = \
            {} if self.sched.config.async_scheduling else None
        # Async scheduling: per step in flight, the requests whose token it samples
        # was computed on KV a failed load left unloaded (dropped with the step's
        # entry in _in_flight).
        self._stale: dict[int, set[str]] = {}

    def feed(self, e, line: int | None = None) -> None:
        if type(e) is ev.Step and e.step >= self.steps_in_trace:
            self.steps_in_trace = e.step + 1
        if self.stopped:
            return
        try:
            kind = type(e)
            if kind is ev.Step:
                self._step(e, line)
            elif kind is ev.Output:
                self._output(e, line)
            elif kind is ev.Arrival:
                self._arrival(e, line)
            elif kind is ev.PromptStats:
                self._prompt_stats(e, line)
            elif kind is ev.Abort:
                self._abort(e)
            elif kind is ev.RequestFinished:
                self.connector.finished_answer(e)
                self._write(ev.RequestFinished(self._seq(), e.req, e.delay_free,
                                               e.kv_transfer_params))
            elif kind is ev.ResetPrefixCache:
                self._reset(e, line)
            elif kind is ev.PauseState:
                self.sched.set_pause_state(e.state)
                self._write(ev.PauseState(self._seq(), e.state))
            elif kind is ev.Drafts:
                self.sched.update_draft_token_ids(e.drafts)
                self._write(ev.Drafts(self._seq(), e.step, e.drafts))
            elif kind is ev.KVAudit:
                self.divergences.extend(self.data_path.feed(e, line))
            elif kind is ev.StepFailed or (kind is ev.End and e.status == "interrupted"):
                self._next_schedule(e, line)
        except SchedulerAssertion as a:
            step = getattr(e, "step", self.steps)
            # At the end of an interrupted trace: the engine's own error.
            did = (e.error or "stopped") if kind is ev.End else "scheduled"
            self.divergences.append(Divergence(step, a.req_id, "assertion", did, "engine assertion",
                                               a.rule, "invariant", e.seq, line))
            self.stopped = f"the engine would have failed an assertion at step {step}: {a.rule}"
            if kind is not ev.End:   # at the end record, nothing is left unchecked
                who = f"; request {a.req_id}" if a.req_id is not None else ""
                self.stop = Stop(step, line, f"the engine would have failed an assertion here "
                                             f"({a.rule}{who}), and the reference cannot "
                                             "schedule past it")
            stop_after = getattr(self.content, "stop_after", None)   # a content worker
            if stop_after is not None:
                stop_after()

    def finish(self) -> None:
        """The end of the trace: the content check's queued steps are checked,
        and the preemption-loop reports of requests that got through after all
        are taken back (only now: the content check's placing counts every
        divergence before it)."""
        if self.content:
            self._place(self.content.flush())
        back = {id(d) for d in self._progress.take_back()}
        if back:
            self.divergences = [d for d in self.divergences if id(d) not in back]

    def taken_back(self) -> list[Divergence]:
        """The preemption-loop reports ``finish`` will take back so far (those
        of requests that got through after all), left in place."""
        return list(self._progress.got_through)

    def close(self) -> None:
        """Stop a content worker that is still running (replay ended early)."""
        if self.content is not None:
            self.content.close()

    def _place(self, ready: list) -> None:
        """The content check reports its steps in batches, in step order: each
        step's divergences go where they would have gone had it been checked at
        once. A step is tagged with how many other divergences came before it;
        the content divergences of earlier steps, placed already, come before it
        too."""
        for before, divs in ready:
            at = before + self._kv_placed
            self.divergences[at:at] = divs
            self._kv_placed += len(divs)

    # -- events ------------------------------------------------------------------

    def _arrival(self, a: ev.Arrival, line) -> None:
        live = self.sched.requests.get(a.req)
        if live is not None and live.streaming_queue is None:   # not a session's next chunk
            raise TraceError(self.path, line, f"request '{a.req}' arrives twice")
        self.sched.add_request(bridge.request_from_arrival(
            a, self.cfg.block_size, self.sched.config.num_hash_lookahead_tokens))
        if self.content:
            self.content.arrival(a)
        self._write(msgspec.structs.replace(a, seq=self._seq()))

    def _abort(self, e: ev.Abort) -> None:
        self.sched.finish_requests(e.reqs, Status[e.status])
        if self.content:
            self.content.abort(e.reqs)
        self._write(ev.Abort(self._seq(), e.reqs, e.status))

    def _reset(self, e: ev.ResetPrefixCache, line) -> None:
        unlisted = ([r.request_id for r in self.sched.running] if e.reset_running_requests
                    and not self.sched.config.profile.reset_preemptions_listed else [])
        ok = self.sched.reset_prefix_cache(e.reset_running_requests)
        for req in unlisted:   # preempted, and no output will list it (I6)
            self._preemptions[req] = self._preemptions.get(req, 0) + 1
        # With the connector's cache reset too, a recorded failure may be the
        # connector's: only a recorded success says what the pool did.
        connector_too = e.reset_connector and self.cfg.connector is not None
        if ok != e.succeeded and not (connector_too and not e.succeeded):
            self.divergences.append(Divergence(
                None, None, "reset_prefix_cache.succeeded", e.succeeded, ok,
                "4.5: the prefix cache is reset only when no block is in use", "block", e.seq, line))
        self._write(ev.ResetPrefixCache(self._seq(), e.reset_running_requests,
                                        e.succeeded if connector_too else ok, e.reset_connector))

    def _placeholders(self, rec: ev.Step) -> Counter:
        """Async scheduling: per request, the output placeholders it held when
        ``rec``'s step was scheduled, one for each step in flight (no output
        recorded yet) that samples a token for it. A step samples for a request
        unless its chunk ends short of the request's tokens and those
        placeholders: a prefill chunk holds none (AS:33-34, S:1634-1636). A
        preemption zeroes them (AS:62-63). With speculative decoding a step
        that samples holds one more for each draft it verifies (AS:41-47).
        Records this step's own."""
        for old in [k for k in self._in_flight if k < rec.step - _OUTPUT_WINDOW]:
            del self._in_flight[old]   # an output that never came (an engine error path)
            self._stale.pop(old, None)
        if rec.preempted:
            gone = set(rec.preempted)
            for k, ids in self._in_flight.items():
                self._in_flight[k] = [r for r in ids if r not in gone]
        held = Counter(chain.from_iterable(self._in_flight.values()))
        states = {st.req: st for st in rec.states}
        sampling = []
        spec = rec.spec or {}
        for s in (*rec.new, *rec.resumed, *rec.running):
            st = states.get(s.req)
            if st is None or st.num_computed_tokens >= st.num_tokens + held[s.req]:
                sampling += [s.req] * (1 + len(spec.get(s.req, ())))
        if sampling:
            self._in_flight[rec.step] = sampling
        return held

    def _mark_stale(self, rec: ev.Output) -> None:
        """Async scheduling: a failed load (a failed async load, or blocks
        reported invalid) in ``rec`` leaves the requests it hit with KV that was
        never loaded. Each step still in flight that samples for one of them
        read that KV: the token it samples must be discarded (``stale_tokens``)."""
        c = rec.connector
        if not (c.invalid_block_ids or c.failed_recving):
            return
        invalid = set(c.invalid_block_ids)
        hit = {st.req for st in rec.states if invalid.intersection(st.block_ids)}
        hit.update(c.failed_recving)
        for step, ids in self._in_flight.items():
            read = hit.intersection(ids) if step > rec.step else None
            if read:
                self._stale.setdefault(step, set()).update(read)

    def _reads_no_cache(self, req: str) -> bool:
        r = self.sched.requests.get(req)
        return r is not None and r.skip_reading_prefix_cache

    def _step(self, rec: ev.Step, line) -> None:
        if rec.step < self.steps:
            raise TraceError(self.path, line, f"step {rec.step} does not follow step {self.steps - 1}")
        self.steps = rec.step + 1
        in_flight = None   # per request, the output placeholders held before this step
        if self._in_flight is not None:
            in_flight = self._placeholders(rec)
        broken = checks.step_invariants(rec, self.cfg, self._preemptions, line, in_flight,
                                        self._reads_no_cache, self._windowed)
        self.divergences.extend(broken)
        self.connector.start_step(rec.step, rec.lookups)
        if rec.grammar:
            self.sched.grammar_compiled(rec.grammar)
        out = self.sched.schedule(rec.throttle_prefills)
        self.connector.end_step()
        for d in self.connector.divergences:   # the step's record is where they show
            d.seq, d.line = rec.seq, line
        self.divergences.extend(self.connector.divergences)
        self.connector.divergences = []
        found = checks.compare_step(rec, out, self.sched, line)
        if found or broken:
            derive.annotate_step([*broken, *found], out, self._last_out, self.sched)
            self.divergences.extend(found)
        self._last_out = out
        self.divergences.extend(self._progress.after_schedule(rec.step, out, self.sched, rec.seq, line,
                                                              self.connector.loads))
        if self.content:
            self._place(self.content.step(rec, line, len(self.divergences) - self._kv_placed))
        self._outputs[rec.step] = out
        if rec.spec:
            self._spec[rec.step] = rec.spec
        if self.out:
            loads = self.connector.loads if self.cfg.connector else None
            self._write(bridge.step_event(self._seq(), rec.step, out, self.sched,
                                          self.connector.made, loads, rec.grammar))

    def _output(self, rec: ev.Output, line) -> None:
        out = self._outputs.pop(rec.step, None)
        if out is None:
            raise TraceError(self.path, line, f"output for step {rec.step}, which was not scheduled "
                                              "or already had its output")
        stale = None
        if self._in_flight is not None:
            self._in_flight.pop(rec.step, None)
            stale = self._stale.pop(rec.step, None)
            # A streaming-input session's turn end zeroes its placeholders, as a
            # preemption does (S:2478): the steps in flight sample for it no more.
            turn_ends = rec.turn_ends()
            if turn_ends:
                for k, ids in self._in_flight.items():
                    self._in_flight[k] = [r for r in ids if r not in turn_ends]
        self._unmatched_stats()
        spec = self._spec.pop(rec.step, None)
        if spec:
            self.divergences.extend(checks.accepted_drafts(rec, spec, line,
                                                           self._in_flight is not None))
        model = bridge.model_output_from_event(rec)
        for req in [*sorted(model.finished_recving), *sorted(model.finished_sending)]:
            if req not in self.sched.requests:
                self.divergences.append(Divergence(
                    rec.step, req, "connector", "finished transfer", "no such live request",
                    "3.5: transfers finish only for requests that hold blocks", "counter", rec.seq, line))
        model.finished_recving &= self.sched.requests.keys()
        model.finished_sending &= self.sched.requests.keys()
        touched = bridge.touched_by_output(self.sched, out, model)
        self._progress.after_output(model.failed_recving, model.invalid_block_ids,
                                    model.sampled_token_ids)
        before = {r.request_id: r.num_tokens for r in touched if stale and r.request_id in stale}
        results = self.sched.update_from_output(out, model)
        self.divergences.extend(checks.compare_output(rec, results, self.sched, touched, line))
        counted = self.sched.take_connector_cache()   # what this output's make_stats took
        if rec.connector_cache is not None:
            self.divergences.extend(checks.connector_cache(rec, counted, line))
        self.divergences.extend(self._progress.after_update(rec.step, results, self.sched,
                                                            rec.seq, line))
        if before:
            self.divergences.extend(checks.stale_tokens(rec, before, line))
        if self._in_flight is not None and rec.connector is not None:
            self._mark_stale(rec)
        if self.content:
            self.content.output(rec)
        for r in results:
            if r.prefill_stats is not None:
                self._expected_stats[r.req_id] = r
        for r in touched:
            if r.is_finished:
                self._finished_refs[r.request_id] = r
                self._preemptions.pop(r.request_id, None)   # memory follows live requests
        if self.out:
            for e in bridge.output_events(self._seq, rec.step, model, results, self.sched, touched):
                self._write(e)

    def _prompt_stats(self, rec: ev.PromptStats, line) -> None:
        expected = self._expected_stats.pop(rec.req, None)
        ref = self.sched.requests.get(rec.req) or self._finished_refs.get(rec.req)
        found = checks.compare_prompt_stats(rec, expected, ref, line)
        if found and ref is not None:
            derive.annotate_stats(found, ref)
        self.divergences.extend(found)

    def _unmatched_stats(self) -> None:
        """Stats the reference emitted that the engine's trace never carried."""
        for req, r in self._expected_stats.items():
            self.divergences.append(Divergence(
                None, req, "prompt_stats", None, "emitted with the first output",
                "1.2: the first output carries the request's prompt stats", "stats"))
        self._expected_stats.clear()
        self._finished_refs.clear()

    def put_into(self, result: ReplayResult, truncation: str | None) -> None:
        """Put what this replay found and checked into ``result``; a trace
        that ends whole also checks its last prompt stats."""
        if truncation is None:
            self._unmatched_stats()
        result.divergences = self.divergences
        result.steps = self.steps
        result.truncation = truncation
        result.stopped = self.stopped
        result.steps_in_trace = max(self.steps_in_trace, self.steps)
        result.stopped_at = self.stop
        result.audit = data_path_summary(self.data_path.checked, self.header)
        if self.content:
            result.device = self.content.device
            result.assumed_loads = self.content.assumed_loads
            result.slots_checked = self.content.slots_checked
            result.states_checked = self.content.states_checked

    # -- helpers -----------------------------------------------------------------

    def _next_schedule(self, e: ev.StepFailed | ev.End, line) -> None:
        """The engine stopped on an error. A ``step_failed`` record is a
        ``schedule()`` that raised: the reference runs that step with the
        connector's answers it had, and the failure is reported whether the
        reference fails there too or not (failed_step.py); replay stops there.
        A trace without one (recorded before the recorder wrote it, or an error
        outside ``schedule()``) ends ``interrupted``: the reference schedules
        the next step, and if that fails one of the engine's assertions, the
        engine met it there (the reference raises SchedulerAssertion, which
        ``feed`` reports). Nothing is written."""
        if type(e) is ev.StepFailed:
            self.steps = e.step + 1
            found, failed = run_failed_step(self.sched, self.connector, e, line)
            self.divergences.extend(found)
            if failed is not None and self.out:
                self._write(failed_record(self._seq(), e, failed, self.connector))
            self.stopped = f"the engine failed in schedule() at step {e.step}: {e.error}"
            stop_after = getattr(self.content, "stop_after", None)   # a content worker
            if stop_after is not None:
                stop_after()
            return
        out, self.out = self.out, None
        try:
            self.sched.schedule()
        finally:
            self.out = out

    def _seq(self) -> int:
        return self.out.next_seq() if self.out else 0

    def _write(self, e) -> None:
        if self.out:
            self.out.write(e)


def replay_file(path: str | os.PathLike, out: str | os.PathLike | None = None,
                device: str | None = "auto", progress=None,
                worker: bool | int | None = None, profile: str | None = None) -> ReplayResult:
    """Replay one trace file. Raises TraceError for unusable input.

    ``device`` is where the shadow-KV check runs ("auto", "cpu", "cuda", or a
    backend named in kv_content.device.BACKENDS), or None to skip it.
    ``progress``, if given, is called now and then with the number of steps
    replayed so far. ``worker`` runs part of the work in worker processes that
    read the same file (plan.py); None decides by the file's size and the
    machine's cores. The result is the same either way. ``profile`` names the
    version profile to follow (the header's release's when None)."""
    reader = TraceReader(path)
    header = reader.header
    chosen, note = choose_profile(header, profile)
    out_file = rp = record_worker = None
    failed = None   # why replay stopped before the end of the trace
    try:
        check_supported(header, path, chosen)
        p = plan(reader, path, device, worker)
        out_file = ReplayedTrace(out, header, path) if out is not None else None
        rp = Replayer(header, str(path), out_file and out_file.writer, p.device,
                      content_worker=p.content_worker,
                      shared=reader.share() if p.content_worker else None,
                      gate=p.gate, profile=chosen)
        result = ReplayResult(path=str(path), header=header, profile=chosen.name,
                              content_unchecked=p.unchecked, profile_note=note)
        events, record_worker = p.events(reader, rp)
        with p.no_autograd():
            for e in events:
                result.events += 1
                rp.feed(e, reader.last_line)
                if isinstance(e, ev.End):
                    result.end = e
                elif progress is not None and not result.events % PROGRESS_EVERY:
                    progress(rp.steps)
            rp.finish()
    except BaseException as e:
        failed = e
        raise
    finally:
        reader.close()
        for part in (rp, record_worker):
            if part is not None:
                part.close()
        if out_file is not None:
            out_file.close(failed, rp, reader.truncation)
    rp.put_into(result, reader.truncation)
    return result
