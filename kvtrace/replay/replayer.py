"""Replay: feed a trace's inputs through the reference scheduler, in the recorded
call order, and compare every recorded output with the reference's.

Inputs taken from the trace: arrivals, aborts, prefix-cache resets, the
connector's answers, when grammars finished compiling, sampled tokens (and the
grammar's refusals of them), drafts and the connector output. Everything else
is recomputed.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from itertools import chain

import msgspec

from kvtrace import baseline, bridge
from kvtrace._text import count, path_text
from kvtrace.findings import Divergence, Stop
from kvtrace.outputs import Output
from kvtrace.reference import Request, RequestOutput, Scheduler, SchedulerAssertion, SchedulerOutput, Status
from kvtrace.reference.profiles import PROFILES, Profile
from kvtrace.results import ReplayResult
from kvtrace.trace import TraceError, TraceReader, TraceWriter
from kvtrace.trace import events as ev
from kvtrace.workers import wanted

from . import checks, derive
from .connector import RecordedConnector
from .data_path import DataPath
from .failed_step import failed_record, run_failed_step
from .kv_content.device import pick_backend
from .liveness import ProgressWatch

PROGRESS_EVERY = 4096   # events between progress calls
# Async scheduling: a step whose output has not come this many steps later never will.
_OUTPUT_WINDOW = 64


# ShadowKV's tensors per KV slot (fingerprint, writer, step, position, loaded,
# first write), in bytes; kept here so that the main process need not import torch.
SHADOW_BYTES_PER_SLOT = 8 + 4 + 4 + 4 + 1 + 8


def _check_fits(header: ev.Header, path, block_size: int) -> None:
    """The shadow-KV check holds a few tensors the size of the KV cache
    (``block_size`` slots a block): a header whose cache cannot fit in this
    machine's memory is refused at once, not after filling it."""
    cfg = header.config
    need = SHADOW_BYTES_PER_SLOT * (cfg.num_blocks + 1) * block_size
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > have // 2:
        raise TraceError(path, 1, "the shadow-KV check of this KV cache "
                                  f"({count(cfg.num_blocks, 'block')} of {count(block_size, 'slot')}) "
                                  f"needs {need / 2**30:.1f} GiB, more than half of this machine's "
                                  f"{have / 2**30:.1f} GiB: replay it with --no-kv-check")


def _check_supported(header: ev.Header, path, profile: Profile) -> None:
    why = baseline.refusal(header.features, header.config.block_size,
                           "the reference models the baseline profile only (full-attention, "
                           "sliding-window and state KV-cache groups, no pipeline parallelism)",
                           header.config.enable_prefix_caching)
    if why is None:
        why = _profile_refusal(header, profile)
    if why is not None:
        raise TraceError(path, 1, why)


def _profile_refusal(header: ev.Header, profile: Profile) -> str | None:
    """Why the trace cannot be replayed under ``profile``, or None: what the
    reference refuses under it (``baseline.REFUSED``), and block hashes that
    cannot be reproduced. vLLM 0.33 hashes each EAGLE block with the token
    after it, by default, where prefix caching is on and no connector is
    (config/vllm.py:678-692); a 0.33 trace must say whether it did
    (``num_hash_lookahead_tokens``, written by this kvtrace's recorder)."""
    f = header.features
    why = baseline.profile_refusal(f, header.config.block_size, profile)
    if why is not None:
        return why
    if (f.num_hash_lookahead_tokens is None and profile.name == "0.33" and f.use_eagle
            and header.config.enable_prefix_caching and header.config.connector is None):
        return ("this vLLM 0.33 trace of EAGLE with prefix caching does not say whether its "
                "block hashes cover the token after each block (num_hash_lookahead_tokens): "
                "record it again with this kvtrace")
    return None


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
    backend named in kv_content.device.BACKENDS), or None to skip it. ``progress``, if given, is called now and then with the number of
    steps replayed so far. ``worker`` runs part of the work in worker processes
    that read the same file: with 1 (or True), the content check when it is on
    (kv_content/worker.py), the record checks when it is off (record_worker.py);
    with 2, the record checks as well beside the content check; None decides by
    the file's size and the machine's cores (workers.py). The result is the same
    either way. ``profile`` names the version profile to follow (the header's
    release's when None)."""
    reader = TraceReader(path)
    header = reader.header
    if profile is None:
        chosen, note = bridge.header_profile(header)
    else:
        chosen, note = PROFILES[profile], None
    writer = dest = rp = record_worker = None
    failed = None   # why replay stopped before the end of the trace
    unusable = False   # the trace was found unusable: the output is not put in place
    try:
        _check_supported(header, path, chosen)
        from .kv_content.check import unchecked as content_unchecked, shadow_block_size

        unchecked = content_unchecked(header) if device else None
        if unchecked is not None:
            device = None
        if device:
            slots = shadow_block_size(header.config, header.features.kv_cache_groups)
            _check_fits(header, path, slots)
            device = pick_backend(device, path, header.config.num_blocks, slots)
        if out is not None:
            replayed = ev.Header(engine="kvtrace-reference", engine_version=_version(),
                                 config=header.config, counters=header.counters,
                                 features=header.features,
                                 meta={"replayed_from": path_text(path), "recorded_engine": header.engine,
                                       "recorded_engine_version": header.engine_version})
            dest = Output(out, trace=True)   # put in place at the end, whole or cut
            writer = TraceWriter(out, replayed, fd=dest.take_fd())
        workers = (wanted(path) if worker is None else int(worker)) if reader.shareable else 0
        content_worker = bool(device) and workers >= 1
        in_process = bool(device) and not content_worker
        if in_process and device == "cpu":   # torch on the CPU
            import torch
            torch.set_num_threads(1)   # the check is many small ops: threads only add overhead
        # The record checks' worker, when there is one, checks every record; else
        # the content check's worker takes the checks across records over once it
        # has caught up with this process.
        rp = Replayer(header, str(path), writer, device, content_worker=content_worker,
                      shared=reader.share() if content_worker else None,
                      gate=content_worker and workers < 2, profile=chosen)
        result = ReplayResult(path=str(path), header=header, profile=chosen.name,
                              content_unchecked=unchecked,
                              profile_note=note)
        if workers >= (2 if device else 1):
            from kvtrace.workers.record_worker import RecordWorker   # a module the worker runs as __main__

            record_worker = RecordWorker(reader.path, reader.share())
            events = reader.checked_elsewhere(record_worker)
        elif content_worker:
            events = reader.validated_elsewhere(rp.content)
        else:
            events = reader
        with _no_autograd(in_process and device != "numpy"):
            for e in events:
                result.events += 1
                rp.feed(e, reader.last_line)
                if isinstance(e, ev.End):
                    result.end = e
                elif progress is not None and not result.events % PROGRESS_EVERY:
                    progress(rp.steps)
            rp.finish()
    except BaseException as e:
        failed = f"replay stopped: {e}" if str(e) else f"replay stopped: {type(e).__name__}"
        unusable = isinstance(e, TraceError)
        raise
    finally:
        reader.close()
        for part in (rp, record_worker):
            if part is not None:
                part.close()
        if writer is not None:
            stop = rp.stop.words(rp.steps, rp.steps_in_trace) if rp is not None and rp.stop else None
            error = failed or stop or reader.truncation
            try:
                writer.close(status="interrupted" if error else "complete", error=error)
            except BaseException as e:   # the output could not be finished: never put in place
                dest.discard()
                raise (dest.named(e) if isinstance(e, OSError) else e) from e
            if unusable:   # the file that was there stays as it was
                dest.discard()
            else:   # whole, or a replay that stopped and says where in its end record
                dest.commit()
        elif dest is not None:
            dest.discard()
    if reader.truncation is None:
        rp._unmatched_stats()
    result.divergences = rp.divergences
    result.steps = rp.steps
    result.truncation = reader.truncation
    result.stopped = rp.stopped
    result.steps_in_trace = max(rp.steps_in_trace, rp.steps)
    result.stopped_at = rp.stop
    result.audit = dict(rp.data_path.checked) or None
    if rp.content:
        result.device = rp.content.device
        result.assumed_loads = rp.content.assumed_loads
        result.slots_checked = rp.content.slots_checked
        result.states_checked = rp.content.states_checked
    return result


def _no_autograd(content_check: bool):
    """The content check runs many small torch ops per step; inference mode skips
    autograd's bookkeeping on each of them (about a fifth of the check's time on CPU)."""
    if not content_check:
        return contextlib.nullcontext()
    import torch
    return torch.inference_mode()


def _version() -> str:
    from kvtrace import __version__
    return __version__
