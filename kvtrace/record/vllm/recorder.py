"""Record vLLM V1 scheduler decisions as a kvtrace trace.

``make_recording_scheduler(base_cls)`` (``hooks``) returns a subclass of
``base_cls`` (vLLM's ``Scheduler``, ``AsyncScheduler`` or a user's own
``scheduler_cls``) whose ``Recorder``, here, records, in call order:

* ``add_request``      -> ``Arrival`` (also each further input chunk of a
  streaming-input session, and the end of its input, under the session's id)
* ``reset_prefix_cache`` -> ``ResetPrefixCache`` (whether running requests were
  preempted for it, and whether it succeeded)
* ``set_pause_state``  -> ``PauseState`` (``pause_scheduler`` / ``resume_scheduler``)
* ``finish_requests``  -> ``Abort`` (only ``FINISHED_ABORTED`` calls from outside
  ``update_from_output``), its ids in the order the engine frees them, seen
  by wrapping ``_free_request``
* ``schedule``         -> ``Step`` (with the connector's lookups and load plan:
  the answers of ``self.connector.get_num_new_matched_tokens`` and the calls
  of ``self.connector.update_state_after_alloc``, seen at the scheduler's own
  call sites, ``call_sites``; the connector itself is never touched); when
  ``schedule`` raises, ``StepFailed`` with what the step had asked so far
* ``update_from_output`` -> ``Output`` (with the pooling requests whose pooler
  output came, ``Output.pooled``) and one ``PromptStats`` per request's first
  output that carries prompt accounting
* ``update_draft_token_ids`` -> ``Drafts`` (speculative decoding, synchronous
  scheduler); ``schedule`` also records the drafts it scheduled (``Step.spec``)
* structured outputs: ``schedule`` records the requests whose grammar it found
  compiled or failed (``Step.grammar``: those that left
  ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, and those it noted in
  ``grammar_compile_error_reqs``), and ``update_from_output`` those whose
  grammar refused their tokens (``Output.grammar_rejected``, seen where the
  scheduler calls ``self.structured_output_manager.accept_tokens``)
* shutdown / process exit -> ``End``: ``complete``, or ``interrupted`` with the
  engine's error when the scheduler is shut down while an exception leaves the
  engine (vLLM's engine core process shuts it down from a ``finally``)

Rules the recorder keeps:

* The real method always runs; the recorder never changes arguments or results,
  nor the objects the scheduler holds.
* When the scheduler's own ``schedule`` or ``update_from_output`` raises, the
  events waiting in the engine's process are handed to the writer at once:
  vLLM's front end may kill a failed engine core before it shuts down. A
  ``schedule`` that raises an ``Exception`` is recorded first (``StepFailed``:
  its lookups, load plan, grammars and the exception), unless a driver raised
  it to stop the run (an exception class with ``kvtrace_driver_stop = True``).
* Every capture is wrapped: the first exception is logged once, the trace is
  marked failed (``End.status == "recorder-error"``), recording stops and the
  engine carries on.
* Capture copies the engine's lists and counters (``RawStep``, ``RawOutput``),
  mostly with C-level calls, and keeps a reference to each request's block list
  with its length, so that block ids can be read incrementally. The sink reads
  them and encodes one JSON line per event; the schema's records, serialization
  and compression happen in a writer process: see ``kvtrace.record.sink``. When
  too many events wait, the event is dropped and counted; the trace then ends
  with ``status "recorder-error"`` and ``dropped_events > 0``.

Which file a scheduler writes is decided by ``open_recorder`` (see
``kvtrace.record.vllm.plugin``); a scheduler class built here with no
destination configured records nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import logging
import operator
import os
import signal
import sys
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson

from kvtrace.record.capture import (
    RawOutput,
    RawStep,
    RunningColumns,
    Sampled,
    Scheduled,
    Snapshot,
    StateCounters,
    all_groups,
)
from kvtrace.record.detached import split_trace_name
from kvtrace.record.sink import TraceSink, open_sink
from kvtrace.record.vllm.header import build_header, data_parallel_rank
from kvtrace.trace.events import (
    PAUSE_STATES,
    REPETITION_FIELDS,
    Abort,
    Arrival,
    CacheStats,
    ConnectorOutput,
    Drafts,
    KVLoad,
    LegacyCounters,
    Lookup,
    PauseState,
    PrefillStats,
    PromptStats,
    RequestFinished,
    ResetPrefixCache,
    StepFailed,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.interface import PauseState as EnginePauseState
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs, FinishReason
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    # What pre_update reads before the update and post_update records after
    # it: the step, its sampled tokens, the connector's output, the requests
    # it names, and the pooling requests whose output came.
    UpdateContext = tuple[int, Sampled, ConnectorOutput | None, dict[str, Request | None],
                          list[str] | None]

logger = logging.getLogger("kvtrace.record")

_T = TypeVar("_T")

ENV_OUT = "KVTRACE_OUT"
# An exception class with this attribute true is a driver's way to stop a run
# from inside schedule() (model_free.EngineLooping): no failure of the engine's.
DRIVER_STOP = "kvtrace_driver_stop"
_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error",
            "repetition": "stop"}

# --------------------------------------------------------------------------- capture helpers


# One request's counters, read in one C call: a tuple of StateCounters' fields
# (vLLM's Request names them as the schema does, but for its request_id).
_READ_STATE = operator.attrgetter("request_id", *StateCounters._fields[1:])


_GRAMMAR_WAIT = "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
# vLLM's PrefixCacheStats counts, named as the trace's CacheStats names them.
_CACHE_STATS = CacheStats.__struct_fields__


def _repetition(sp: SamplingParams | None) -> dict | None:
    """A request's repetition detection, when it has one that can stop it."""
    rd = getattr(sp, "repetition_detection", None)
    if rd is None:
        return None
    return {k: int(getattr(rd, k)) for k in REPETITION_FIELDS}


def _embeds_digests(request: Request, block_size: int) -> list[str]:
    """The sha256 of each block's rows of a prompt of embeddings, as vLLM keys
    the block with them (KU:598-622): read from the request's own cache of
    them where vLLM has hashed the block already (every full block, with prefix
    caching on), else computed as vLLM computes it."""
    from vllm.v1.utils import tensor_data

    embeds = request.prompt_embeds
    cache = getattr(request, "_prompt_embeds_per_block_hashes", None) or {}
    out = []
    for start in range(0, len(embeds), block_size):
        digest = cache.get((start, start + block_size))
        if digest is None:
            digest = hashlib.sha256(tensor_data(embeds[start:start + block_size])).digest()
        out.append(digest.hex())
    return out


def _lora(lr: LoRARequest | None) -> dict | None:
    """A request's LoRA adapter, as its blocks are keyed with it (KU:584-595)."""
    if lr is None:
        return None
    return {"id": int(lr.lora_int_id), "name": str(lr.lora_name), "path": str(lr.lora_path)}


def _runs(mask: Sequence[bool] | None) -> list[list[int]] | None:
    """The runs [start, end) of True in a per-position mask; None for none."""
    if not mask:
        return None
    runs: list[list[int]] = []
    for i, on in enumerate(mask):
        if on:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
    return runs or None


def _grammar_resolved(req: Request) -> bool:
    """Whether the request's grammar is compiled, as the scheduler's look at it
    leaves it: vLLM 0.32 keeps the compile's Future until a look finds it done,
    then the grammar, or the compile's exception. True when this vLLM keeps it
    some other way."""
    grammar = getattr(getattr(req, "structured_output_request", None), "_grammar", None)
    if grammar is None:
        return True
    return not isinstance(grammar, (Future, BaseException))


def _status_name(req: Request) -> str:
    status = getattr(req, "status", None)
    return str(getattr(status, "name", status))


def _read_state_slow(req: Request) -> StateCounters:
    """``_READ_STATE`` for engines whose requests lack ``num_preemptions``."""
    return StateCounters(req=req.request_id, status=req.status,
                         num_computed_tokens=req.num_computed_tokens, num_tokens=req.num_tokens,
                         num_preemptions=getattr(req, "num_preemptions", 0))


_NO_BLOCKS = itertools.repeat(())  # the default for each table.get in a map


def _block_table(kvm: KVCacheManager) -> dict[str, list[KVCacheBlock]] | None:
    """The KV manager's request -> block list table when it can be read as
    ``BlockTables`` expects (one full-attention group), else None: the
    manager's own ``get_block_ids`` is asked instead."""
    try:
        managers = kvm.coordinator.single_type_managers
        if len(managers) == 1 and type(managers[0]).__name__ == "FullAttentionManager":
            return managers[0].req_to_blocks
    except Exception:
        pass
    return None


# Set while kvtrace.lab.model_free runs an engine with no model behind it.
def _eos_token_id(request: Request, sp: SamplingParams | None) -> int | None:
    """The request's end-of-sequence token: its sampling parameters hold it
    (vLLM 0.17 and later), or the request itself (0.16)."""
    eos = getattr(sp, "eos_token_id", None) if sp is not None else None
    return getattr(request, "eos_token_id", None) if eos is None else eos


def _argument(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    """Argument ``i`` of a call, given by position or as ``name``."""
    return args[i] if len(args) > i else kwargs[name]


def _finish_reason(r: FinishReason | str | None) -> str | None:
    if r is None:
        return None
    name = getattr(r, "name", None) or str(r)
    return _REASONS.get(name.lower(), "stop")


# --------------------------------------------------------------------------- recorder


class _Audit(Protocol):
    """What the recorder asks of the KV audit (``kv_audit.KVAudit``)."""

    def plan(self, step: int, out: SchedulerOutput, sched: Scheduler, lookups: list[Lookup],
             loads: list[KVLoad]) -> None: ...

    def collect(self) -> None: ...

    def close(self) -> None: ...


class Recorder:
    """Per-scheduler capture state. All public ``on_*`` methods may raise; the
    scheduler subclass catches and calls ``fail``."""

    def __init__(self, sched: Scheduler, sink: TraceSink) -> None:
        self._sched_ref = weakref.ref(sched)
        self.sink = sink
        self.failed: str | None = None
        self.active = True
        self.step_index = 0
        self.has_connector = getattr(sched, "connector", None) is not None   # at this step
        self.audit: _Audit | None = None   # the KV audit (kv_audit), when it runs
        # The views the scheduler's call sites get (call_sites.held): attribute
        # -> (the object it holds, its view); and the attributes whose calls
        # are recorded now: the grammar's answers from the first structured
        # output on (before it, every answer is yes: vllm/v1/structured_output/
        # __init__.py:464-465).
        self.views: dict[str, tuple] = {}
        self.watched: set[str] = {"connector"}
        self.throttle_prefills = False
        # The size vLLM hashes blocks at: a prompt of embeddings has a digest per block.
        self.hash_block_size = int(getattr(sched, "hash_block_size", None)
                                   or getattr(sched, "block_size", None) or 16)
        # Per-step capture, reset at every schedule().
        self.lookups: list[Lookup] = []
        self.loads: list[KVLoad] = []
        self.last_local: dict[str, int] = {}
        self.preempt_order: list[str] = []
        self.preempted_out: set[str] = set()  # preempted, not yet resumed
        # SchedulerOutput identity -> step index (FIFO, for async / PP engines).
        self.pending: list[tuple[SchedulerOutput, int]] = []
        self.stats_done: set[str] = set()
        self.in_update = False
        self.last_output_step = -1   # the step whose output was recorded last
        # Calls of finish_requests under way (innermost last): their ids, those
        # freed so far, and the status given.
        self.aborts: list[tuple[list[str], list[str], str]] = []
        self.kvm = sched.kv_cache_manager
        self.table = _block_table(self.kvm)
        self.read_state = _READ_STATE
        # Structured outputs whose grammar no step has found compiled or failed yet.
        self.grammar_waiting: dict[str, Request] = {}
        # Requests whose grammar refused their tokens in the update under way.
        self.grammar_rejected: list[str] = []
        self.connector_cache: dict[str, int] | None = None   # stats made since the last output
        # False: outputs leave them out (a re-run of a recording made without them).
        self.keeps_cache_stats = True

    # -- lifecycle -------------------------------------------------------------

    def guard(self, where: str, capture: Callable[..., _T], *args: object) -> _T | None:
        """Run one capture step. An error in it stops recording, never the engine."""
        try:
            return capture(*args)
        except Exception as e:
            self.fail(where, e)
            return None

    def fail(self, where: str, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{where}: {type(exc).__name__}: {exc}"
            logger.exception("kvtrace: recorder failed in %s; recording stopped, the engine is "
                             "unaffected", where)
        self.active = False
        self.sink.unsettle()     # events are lost from here: a kill must not read as whole
        self.close(wait=False)   # on the engine's thread: the writer finishes on its own

    def close(self, wait: bool = True, interrupted: str | None = None) -> None:
        """End the trace: ``complete``, or ``interrupted`` with that error (the
        engine failed). With ``wait``, until the writer has written its end
        (shutdown, process exit); otherwise only ask it to."""
        if self.audit is not None and wait:   # what the workers sent last, then its directory
            audit, self.audit = self.audit, None
            try:
                audit.close()
            except Exception:
                logger.exception("kvtrace: reading the workers' last KV audit records failed")
        if not self.sink.closed:
            if self.failed is not None:
                self.sink.close("recorder-error", self.failed, wait=wait)
            elif interrupted is not None:
                self.sink.close("interrupted", interrupted, wait=wait)
            else:
                self.sink.close("complete", wait=wait)
        elif wait:
            self.sink.join()
        if wait:
            _ACTIVE.discard(self)

    # -- inputs ----------------------------------------------------------------

    def on_session_input(self, request: Request, session: Request | None) -> None:
        """``add_request`` with the id of a request the engine holds: vLLM takes it as
        the next input chunk of a streaming-input session (``resumable``), or as the
        end of its input; anything else it refuses, and nothing is recorded."""
        if session is not None and getattr(session, "resumable", False):
            self.on_add_request(request, chunk=True)

    def on_add_request(self, request: Request, chunk: bool = False) -> None:
        """A new request, or (``chunk``) a session's next input chunk: vLLM takes
        only a chunk's token ids (S:1678-1679)."""
        if getattr(request, "use_structured_output", False):
            self.watched.add("structured_output_manager")   # its grammar's answers count
        sp = request.sampling_params
        prompt, embeds, mask = request.prompt_token_ids, None, None
        if not chunk and getattr(request, "prompt_embeds", None) is not None:
            # The token ids the scheduler hashes: 0 where the prompt is embeddings (R:147-159).
            prompt = request.all_token_ids[:request.num_prompt_tokens]
            embeds = _embeds_digests(request, self.hash_block_size)
            mask = _runs(getattr(request, "prompt_is_token_ids", None))
        self.sink.put(Arrival(
            seq=0,
            req=str(request.request_id),
            prompt_token_ids=list(prompt or ()),
            max_tokens=int(request.max_tokens),
            arrival_time=float(request.arrival_time or 0.0),
            priority=int(request.priority or 0),
            cache_salt=request.cache_salt,
            eos_token_id=_eos_token_id(request, sp),
            stop_token_ids=[] if sp is None else list(sp.stop_token_ids or ()),
            min_tokens=0 if sp is None else int(sp.min_tokens or 0),
            ignore_eos=False if sp is None else bool(sp.ignore_eos),
            skip_reading_prefix_cache=bool(getattr(request, "skip_reading_prefix_cache", False)),
            resumable=bool(getattr(request, "resumable", False)),
            structured_output=bool(getattr(request, "use_structured_output", False)),
            pooling=getattr(request, "pooling_params", None) is not None,
            repetition_detection=_repetition(sp),
            prompt_embeds=embeds,
            prompt_is_token_ids=mask,
            lora=_lora(getattr(request, "lora_request", None)),
            kv_transfer_params=_plain(getattr(request, "kv_transfer_params", None)),
        ))
        sched = self._sched_ref()
        if (_status_name(request) == _GRAMMAR_WAIT and sched is not None
                and sched.requests.get(request.request_id) is request):
            self.grammar_waiting[str(request.request_id)] = request

    def begin_abort(self, request_ids: str | Iterable[str] | None, sched: Scheduler,
                    status: str = "FINISHED_ABORTED") -> None:
        """A call that finishes requests from outside starts (an abort, or
        another finished status): note its ids and status, and watch the order
        in which the engine frees them (``on_free``)."""
        if request_ids is None:
            ids = list(sched.requests.keys())
        elif isinstance(request_ids, str):
            ids = [request_ids]
        else:
            ids = list(dict.fromkeys(request_ids))
        self.aborts.append(([str(i) for i in ids], [], status))

    def on_free(self, request: Request) -> None:
        if self.aborts:
            self.aborts[-1][1].append(str(request.request_id))

    def end_abort(self) -> None:
        """The abort call returned (or raised): record it, its ids in the order
        the engine freed them, then those it left alone (unknown or finished).
        The order decides the order in which their blocks return to the pool,
        and vLLM 0.32 frees the ids of one call in the iteration order of a set
        of them (S:2668), which differs between processes. A call that names
        no request changes nothing and is not recorded: vLLM's engine core
        makes one as it shuts down (``finish_requests(None)`` with no request
        left), and recording it would undo what ``settle`` told the writer
        process a moment before the front end kills the engine core."""
        ids, freed, status = self.aborts.pop()
        if not ids and not freed:
            return
        self.preempted_out.difference_update(ids)   # an id used again is a new request
        self.sink.put(Abort(seq=0, reqs=list(dict.fromkeys(freed + ids)), status=status))

    def settle(self, sched: Scheduler) -> None:
        """After a call that may have left the engine with no request: if it has
        none, and no step that scheduled one still waits for its output (async
        scheduling), tell the sink (an engine process killed now has recorded
        everything it did, see ``ProcessSink``)."""
        held = getattr(sched, "requests", None)
        if (isinstance(held, dict) and not held
                and not any(getattr(o, "num_scheduled_tokens", None) for o, _ in self.pending)):
            self.sink.settled()

    def on_reset(self, reset_running_requests: bool, reset_connector: bool, result: bool) -> None:
        self.sink.put(ResetPrefixCache(seq=0, reset_running_requests=bool(reset_running_requests),
                                       succeeded=bool(result),
                                       reset_connector=bool(reset_connector)))

    def on_pause(self, pause_state: EnginePauseState) -> None:
        state = str(getattr(pause_state, "name", pause_state))
        if state not in PAUSE_STATES:   # a state the format cannot hold: stop recording here
            raise ValueError(f"pause state {state!r} is not one of {', '.join(PAUSE_STATES)}")
        self.sink.put(PauseState(seq=0, state=state))

    def on_lookup_call(self, args: tuple[object, ...], kwargs: dict[str, object],
                       result: tuple[int | None, bool] | None) -> None:
        """``get_num_new_matched_tokens(request, num_computed_tokens)`` answered ``result``."""
        self.on_lookup(_argument(args, kwargs, 0, "request"),
                       _argument(args, kwargs, 1, "num_computed_tokens"), result)

    def on_alloc_call(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        """``update_state_after_alloc(request, blocks, num_external_tokens)`` returned."""
        self.on_alloc(_argument(args, kwargs, 0, "request"),
                      _argument(args, kwargs, 2, "num_external_tokens"))

    def on_lookup(self, request: Request, local: int,
                  result: tuple[int | None, bool] | None) -> None:
        ext, load_async = (result if result is not None else (None, False))
        rid = str(request.request_id)
        self.last_local[rid] = int(local)
        self.lookups.append(Lookup(req=rid, local=int(local),
                                   ext=None if ext is None else int(ext),
                                   load_async=bool(load_async)))

    def on_alloc(self, request: Request, num_external_tokens: int) -> None:
        if num_external_tokens and num_external_tokens > 0:
            rid = str(request.request_id)
            start = self.last_local.get(rid, 0)
            self.loads.append(KVLoad(req=rid, start=start, end=start + int(num_external_tokens)))

    def on_request_finished(self, request: Request,
                            result: tuple[bool, dict[str, object] | None] | bool) -> None:
        """The connector's answer for a finished request: (delay_free, params)."""
        delay, params = result if isinstance(result, tuple) else (bool(result), None)
        if not delay and params is None:
            return   # the default answer, which a replay assumes
        self.sink.put(RequestFinished(seq=0, req=str(request.request_id), delay_free=bool(delay),
                                      kv_transfer_params=_plain(params)))

    def on_preempt(self, request: Request) -> None:
        self.preempt_order.append(str(request.request_id))
        self.preempted_out.add(str(request.request_id))

    def on_drafts(self, sched: Scheduler, draft_token_ids: DraftTokenIds) -> None:
        """``update_draft_token_ids``: the drafts proposed after the last output,
        each decoding request's as the scheduler kept them (a structured
        output's grammar may cut them short), the others' as proposed."""
        drafts = {}
        for rid, ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            r = sched.requests.get(rid)
            if r is not None and not r.is_prefill_chunk:
                ids = r.spec_token_ids
            drafts[str(rid)] = list(map(int, ids))
        self.sink.put(Drafts(seq=0, step=self.last_output_step, drafts=drafts))

    def on_grammar_rejected(self, request: Request) -> None:
        if self.in_update:
            self.grammar_rejected.append(str(request.request_id))

    def _grammar_seen(self, sched: Scheduler) -> dict[str, str]:
        """The grammars this step found compiled ("ready") or failed ("error":
        the scheduler noted it, S:3196-3198), each the first time. A request
        that left WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR had its grammar found
        compiled only if the scheduler looked: looking resolves the grammar's
        future (S:3194). One promoted with its grammar unresolved or failed is
        not recorded as ready, so that replay flags its admission. An aborted
        request is dropped."""
        seen = {}
        errors = getattr(sched, "grammar_compile_error_reqs", ())
        for rid, req in list(self.grammar_waiting.items()):
            status = _status_name(req)
            if status == _GRAMMAR_WAIT:
                if rid not in errors:
                    continue
                seen[rid] = "error"
            elif not status.startswith("FINISHED") and _grammar_resolved(req):
                seen[rid] = "ready"
            del self.grammar_waiting[rid]
        return seen

    def begin_step(self, sched: Scheduler | None = None, throttle_prefills: bool = False) -> None:
        # preempt_order is kept: a reset_prefix_cache between two steps preempts
        # too, and the next step reports it (on_schedule clears it).
        # The connector the scheduler holds now: one assigned or replaced since
        # the last step is recorded as the scheduler calls it (call_sites).
        self.has_connector = getattr(sched, "connector", None) is not None
        self.throttle_prefills = throttle_prefills   # the schedule() call's flag
        self.lookups = []
        self.loads = []
        self.last_local = {}

    # -- state -----------------------------------------------------------------

    def states(self, rids: list[str], reqs: list[Request | None]) -> Snapshot:
        """A states snapshot (see ``kvtrace.record.sink``) of ``reqs``, the
        requests with ids ``rids``, skipping those the engine no longer holds (None)."""
        try:
            counters = list(map(self.read_state, reqs))
        except AttributeError:
            # A request the engine no longer holds (None), or an engine whose
            # requests lack num_preemptions: both are rare, and checked only here.
            kept = [(rid, req) for rid, req in zip(rids, reqs) if req is not None]
            rids = [rid for rid, _ in kept]
            reqs = [req for _, req in kept]
            try:
                counters = list(map(self.read_state, reqs))
            except AttributeError:
                self.read_state = _read_state_slow
                counters = list(map(_read_state_slow, reqs))
        table = self.table
        if table is None:
            return Snapshot(rids, counters, [self._read_ids(rid) for rid in rids], None)
        blocks = list(map(table.get, rids, _NO_BLOCKS))
        return Snapshot(req_ids=rids, counters=counters, blocks=blocks,
                        lengths=list(map(len, blocks)))

    def _read_ids(self, rid: str) -> list[int]:
        try:
            return all_groups(self.kvm.get_block_ids(rid))
        except Exception:
            return []

    # -- schedule --------------------------------------------------------------

    def on_schedule(self, sched: Scheduler, out: SchedulerOutput) -> None:
        step = self.step_index
        self.step_index += 1
        nst = dict(out.num_scheduled_tokens)
        new: list[Scheduled] = []
        resumed: list[Scheduled] = []
        self._admitted(out.scheduled_new_reqs, nst, new, resumed)
        cd = out.scheduled_cached_reqs
        rids, ncts, nbis = list(cd.req_ids), list(cd.num_computed_tokens), list(cd.new_block_ids)
        resumed_ids = cd.resumed_req_ids
        if resumed_ids:
            rids, ncts, nbis = self._resumed_running(resumed_ids, rids, ncts, nbis, nst, resumed)
        preempted = self._preempted(out.preempted_req_ids)
        finished = sorted(out.finished_req_ids or ())
        if finished:
            self.stats_done.difference_update(finished)
        ids = list(nst)
        if preempted or self.lookups:
            ids = list(dict.fromkeys(ids + preempted + [lk.req for lk in self.lookups]))
        states = self.states(ids, list(map(sched.requests.get, ids)))
        try:
            free = int(self.kvm.block_pool.get_num_free_blocks())
        except Exception:
            free = None
        rare = self._step_rare(sched, out)
        self.sink.put(RawStep(
            step=step, new=new, resumed=resumed,
            running=RunningColumns(req_ids=rids, num_computed_tokens=ncts, new_block_ids=nbis,
                                   num_scheduled_tokens=nst),
            preempted=preempted, finished=finished, lookups=self.lookups,
            loads=self.loads if self.has_connector else None, states=states,
            num_free_blocks=free, rare=rare))
        if self.audit is not None:
            self.audit.plan(step, out, sched, self.lookups, self.loads)
        self.pending.append((out, step))
        if len(self.pending) > 64:  # outputs that never came back (engine error paths)
            del self.pending[0]

    def _admitted(self, new_reqs: list[NewRequestData], nst: dict[str, int], new: list[Scheduled],
                  resumed: list[Scheduled]) -> None:
        """The step's ``scheduled_new_reqs`` into ``new``, but for those
        preempted before, which go into ``resumed``: the V2 model runner folds
        resumed requests into scheduled_new_reqs."""
        for r in new_reqs:
            item = Scheduled(req=r.req_id, num_computed_tokens=r.num_computed_tokens,
                             num_scheduled_tokens=nst.get(r.req_id, 0),
                             block_ids=all_groups(r.block_ids))
            if r.req_id in self.preempted_out:
                self.preempted_out.discard(r.req_id)
                resumed.append(item)
            else:
                new.append(item)

    def _resumed_running(self, resumed_ids: set[str], rids: list, ncts: list, nbis: list,
                         nst: dict[str, int],
                         resumed: list[Scheduled]) -> tuple[list, list, list]:
        """The cached requests' columns (ids, computed tokens, new blocks)
        without those resumed in the step, which go into ``resumed``."""
        keep = []
        for i, rid in enumerate(rids):
            if rid in resumed_ids:
                self.preempted_out.discard(rid)
                resumed.append(Scheduled(req=rid, num_computed_tokens=ncts[i],
                                         num_scheduled_tokens=nst.get(rid, 0),
                                         block_ids=all_groups(nbis[i])))
            else:
                keep.append(i)
        return [rids[i] for i in keep], [ncts[i] for i in keep], [nbis[i] for i in keep]

    def _preempted(self, pre_set: set[str] | None) -> list[str]:
        """The step's preempted requests, in the order the scheduler preempted
        them (``on_preempt``; any it did not say, sorted, after them); the
        order is kept for the next step no longer."""
        preempted = []
        if pre_set:
            preempted = [r for r in dict.fromkeys(self.preempt_order) if r in pre_set]
            preempted += sorted(r for r in pre_set if r not in set(preempted))
        self.preempt_order = []
        return preempted

    def _step_rare(self, sched: Scheduler, out: SchedulerOutput) -> dict | None:
        """The step's rare fields that hold something (None for none): the
        drafts it scheduled, the grammars it found, its throttle flag."""
        rare = {}
        spec = out.scheduled_spec_decode_tokens
        if spec:
            rare["spec"] = {rid: list(ids) for rid, ids in spec.items()}
        if self.grammar_waiting:
            grammar = self._grammar_seen(sched)
            if grammar:
                rare["grammar"] = grammar
        if self.throttle_prefills:
            rare["throttle_prefills"] = True
        return rare or None

    def on_schedule_failed(self, sched: Scheduler, exc: BaseException) -> None:
        """``schedule()`` raised ``exc``: record what the step had asked so far
        (``StepFailed``), so that a replay can run the same step. A driver's
        exception that stops the run (``kvtrace_driver_stop``) is no failure
        of the engine's, and an exception that is no ``Exception`` (a Ctrl-C)
        none of the step's: neither is recorded here."""
        if not isinstance(exc, Exception) or getattr(exc, DRIVER_STOP, False):
            return
        step = self.step_index
        self.step_index += 1
        grammar = self._grammar_seen(sched) if self.grammar_waiting else None
        self.sink.put(StepFailed(
            seq=0, step=step, error=exception_line(exc), where=raised_at(exc),
            lookups=list(self.lookups), loads=list(self.loads) if self.has_connector else None,
            grammar=grammar or None, throttle_prefills=self.throttle_prefills))

    # -- update_from_output -----------------------------------------------------

    def pre_update(self, sched: Scheduler, so: SchedulerOutput,
                   mro: ModelRunnerOutput) -> UpdateContext:
        if self.audit is not None:   # the workers' records of the steps run so far
            self.audit.collect()
        step = None
        for i, (o, s) in enumerate(self.pending):
            if o is so:
                step = s
                del self.pending[i]
                break
        if step is None:
            step = self.step_index - 1
        rids = list(so.num_scheduled_tokens)
        toks = mro.sampled_token_ids
        # Copies: the update trims the lists it stops, and the index is the model
        # runner's live one.
        sampled = Sampled(req_ids=rids,
                          sampled_token_ids=(list(map(list, toks)) if toks is not None and len(toks)
                                             else []),
                          req_id_to_index=dict(mro.req_id_to_index or {}))
        kco = mro.kv_connector_output
        conn = None
        ids = rids
        if kco is not None:
            # In the order vLLM goes through them: it frees the blocks of a
            # finished request it meets there (S:3222-3235).
            conn = ConnectorOutput(
                finished_recving=list(kco.finished_recving or ()),
                finished_sending=list(kco.finished_sending or ()),
                failed_recving=sorted(getattr(kco, "failed_recving", None) or ()),
                invalid_block_ids=sorted(int(b) for b in (kco.invalid_block_ids or ())),
            )
            named = conn.finished_recving + conn.finished_sending + conn.failed_recving
            if named:
                ids = list(dict.fromkeys(rids + named))
        reqs = dict(zip(ids, map(sched.requests.get, ids)))
        if self.grammar_rejected:   # left by an update that raised
            self.grammar_rejected = []
        pooled = None
        po = getattr(mro, "pooler_output", None)
        if po:   # pooling models: the requests whose pooler output came
            index = sampled[2]
            pooled = [rid for rid in rids
                      if (i := index.get(rid)) is not None and i < len(po) and po[i] is not None]
        return step, sampled, conn, reqs, pooled

    def on_stats(self, stats: object) -> None:
        """``make_stats`` made ``stats``: the connector's prefix-cache stats in
        it, summed until the next output takes them."""
        s = getattr(stats, "connector_prefix_cache_stats", None)
        if s is None:
            return
        got = [int(getattr(s, k, 0) or 0) for k in _CACHE_STATS]
        before = self.connector_cache or dict.fromkeys(_CACHE_STATS, 0)
        self.connector_cache = {k: before[k] + v for k, v in zip(_CACHE_STATS, got)}

    def post_update(self, sched: Scheduler, ctx: UpdateContext,
                    result: dict[int, EngineCoreOutputs] | None) -> None:
        step, sampled, conn, reqs, pooled = ctx
        finished: dict[str, str] = {}
        stats: list[PromptStats] = []
        for eco in (result or {}).values():
            for o in getattr(eco, "outputs", ()) or ():
                rid = o.request_id
                if rid not in reqs:
                    reqs[rid] = sched.requests.get(rid)
                if o.finish_reason is not None:
                    finished[rid] = _finish_reason(o.finish_reason)
                    self.preempted_out.discard(rid)
                ps = getattr(o, "prefill_stats", None)
                if ps is not None:
                    stats.append(PromptStats(seq=0, step=step, req=rid, prefill_stats=PrefillStats(
                        num_prompt_tokens=int(ps.num_prompt_tokens),
                        num_local_cached_tokens=int(ps.num_local_cached_tokens),
                        num_external_cached_tokens=int(ps.num_external_cached_tokens),
                        num_cached_tokens=int(ps.num_cached_tokens),
                        num_computed_tokens=int(ps.num_computed_tokens),
                        num_cache_creation_tokens=int(ps.num_cache_creation_tokens))))
                    self.stats_done.add(rid)
                elif rid not in self.stats_done and hasattr(o, "num_cached_tokens"):
                    # Legacy engines: the pair rides on the first output.
                    req = reqs.get(rid)
                    ext = getattr(req, "num_external_computed_tokens", None)
                    stats.append(PromptStats(seq=0, step=step, req=rid, legacy=LegacyCounters(
                        num_cached_tokens=int(o.num_cached_tokens),
                        num_external_computed_tokens=int(ext if ext is not None else 0))))
                    self.stats_done.add(rid)
        states = self.states(list(reqs), list(reqs.values()))
        self.last_output_step = step
        rare = {}   # the output's rare fields that hold something
        if self.grammar_rejected:
            rare["grammar_rejected"] = sorted(self.grammar_rejected)
            self.grammar_rejected = []
        if pooled:
            rare["pooled"] = pooled
        if self.connector_cache is not None and self.keeps_cache_stats:
            rare["connector_cache"] = {k: v for k, v in self.connector_cache.items() if v}
        self.connector_cache = None
        self.sink.put(RawOutput(step=step, sampled=sampled, connector=conn, finished=finished,
                                states=states, rare=rare or None))
        for ev in stats:
            self.sink.put(ev)


@contextlib.contextmanager
def termination_deferred() -> Iterator[None]:
    """While the engine's shutdown closes the trace: a SIGTERM or SIGINT waits
    until the end record is written, then takes effect as it would have. vLLM
    resets the engine core's handlers before its shutdown, and its process
    manager sends SIGTERM as soon as its own shutdown starts: the engine core
    died in the middle of writing the end. Only on the main thread, where
    handlers are set; a SIGKILL (a process manager's grace period over) still
    ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
    except (ValueError, OSError):
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


_ACTIVE: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_CLAIMED: dict[str, int] = {}
_CLAIM_LOCK = threading.Lock()


def track(rec: Recorder) -> None:
    """``rec`` is closed with the others at shutdown or process exit (``close_all``)."""
    _ACTIVE.add(rec)


def untrack(rec: Recorder) -> None:
    _ACTIVE.discard(rec)


def close_all(interrupted: str | None = None) -> None:
    """Close every open recorder of this process (writes their End records):
    ``complete``, or, given the error that stopped the engine, ``interrupted``.
    A SIGTERM or SIGINT meanwhile waits until they are closed."""
    with termination_deferred():
        for rec in list(_ACTIVE):
            try:
                rec.close(interrupted=interrupted)
            except Exception:
                logger.exception("kvtrace: closing a recorder failed")


atexit.register(close_all)


def recorders_opened(out: str) -> int:
    """How many schedulers of this process have claimed destination ``out``
    (``KVTRACE_OUT``) so far."""
    with _CLAIM_LOCK:
        return _CLAIMED.get(out, 0)


def exception_line(exc: BaseException) -> str:
    """``Type: message`` on one line, at most 478 characters. Never raises."""
    try:
        msg = " ".join(str(exc).split())
    except Exception:
        msg = ""
    text = type(exc).__name__ + (f": {msg}" if msg else "")
    return text if len(text) <= 478 else text[:475] + "..."


def raised_at(exc: BaseException) -> str | None:
    """Where ``exc`` was raised: ``path:line in function`` of the innermost
    frame of its traceback, the path relative to the ``sys.path`` folder it
    lies in (``vllm/v1/core/sched/scheduler.py:1372 in schedule``). None when
    it has no traceback. Never raises."""
    try:
        tb = exc.__traceback__
        if tb is None:
            return None
        while tb.tb_next is not None:
            tb = tb.tb_next
        code = tb.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        roots = sorted((os.path.abspath(p) for p in sys.path if p), key=len, reverse=True)
        for root in roots:
            if path.startswith(root + os.sep):
                path = os.path.relpath(path, root)
                break
        return f"{path}:{tb.tb_lineno} in {code.co_name}"
    except Exception:
        return None


def engine_failure(exc: BaseException) -> str:
    """An exception that stopped the engine as a trace's end error: one line,
    at most 500 characters. Never raises."""
    return f"the engine stopped on {exception_line(exc)}"


def propagating_failure() -> str | None:
    """The exception on its way out of the engine while the scheduler is shut
    down from a ``finally`` (vLLM's engine core process shuts down so when its
    busy loop raises), as the trace's end error; None for a normal shutdown,
    including one by ``SystemExit`` with a zero code. Never raises. (A shutdown
    from inside an ``except`` block that handles some other error is reported
    the same way.)"""
    exc = sys.exc_info()[1]
    if exc is None:
        return None
    try:
        if isinstance(exc, SystemExit) and (exc.code is None or exc.code == 0):
            return None
    except Exception:
        pass
    return engine_failure(exc)


def _destination(sched: Scheduler) -> str | None:
    out = os.environ.get(ENV_OUT)
    if not out:
        return None
    rank = data_parallel_rank(sched.vllm_config.parallel_config)
    p = Path(out)
    with _CLAIM_LOCK:
        n = _CLAIMED.get(out, 0)
        _CLAIMED[out] = n + 1
    if rank == 0 and n == 0:
        return out
    # Several schedulers in one process, or a data-parallel rank: suffix the name.
    stem, ext = split_trace_name(p.name)
    tag = f".dp{rank}" if rank else ""
    tag += f".pid{os.getpid()}" + (f".{n}" if n else "")
    return str(p.with_name(stem + tag + ext))


def open_recorder(sched: Scheduler) -> Recorder | None:
    dest = _destination(sched)
    if dest is None:
        return None
    try:
        header = build_header(sched, meta={"path": dest})
        sink = open_sink(dest, header)
    except Exception as e:
        logger.error("kvtrace: cannot record to %s (%s: %s); the engine runs without recording",
                     dest, type(e).__name__, e)
        return None
    rec = Recorder(sched, sink)
    _ACTIVE.add(rec)
    logger.info("kvtrace: recording scheduler decisions to %s", dest)
    return rec


# --------------------------------------------------------------------------- wrappers on the instance


def _plain(params: object) -> dict | None:
    """A connector's kv_transfer_params as plain JSON (None when there are none;
    a value JSON cannot hold is written as its str())."""
    if not isinstance(params, dict):
        return None
    try:
        return orjson.loads(orjson.dumps(params, default=str,
                                         option=orjson.OPT_NON_STR_KEYS))
    except Exception:
        return {"unrecorded": type(params).__name__}


class ConnectorCalls:
    """What the scheduler's own code reads as ``self.connector`` where it calls
    ``get_num_new_matched_tokens`` or ``update_state_after_alloc`` while it is
    recorded (``call_sites.held``): the call goes to the connector's own
    method, looked up on the connector as vLLM would, with the same arguments;
    its answer, or its exception, goes back unchanged, and the recorder notes
    the answer. Only the method looked up at the call site is ever read."""

    __slots__ = ("_conn", "_rec")

    def __init__(self, conn: KVConnectorBase_V1, rec: Recorder) -> None:
        self._conn, self._rec = conn, rec

    def get_num_new_matched_tokens(self, *args: object,
                                   **kwargs: object) -> tuple[int | None, bool]:
        result = self._conn.get_num_new_matched_tokens(*args, **kwargs)
        rec = self._rec
        if rec.active:
            rec.guard("get_num_new_matched_tokens", rec.on_lookup_call, args, kwargs, result)
        return result

    def update_state_after_alloc(self, *args: object, **kwargs: object) -> None:
        result = self._conn.update_state_after_alloc(*args, **kwargs)
        rec = self._rec
        if rec.active:
            rec.guard("update_state_after_alloc", rec.on_alloc_call, args, kwargs)
        return result

    def __getattr__(self, name: str) -> Any:   # never read; the connector's, should it be
        return getattr(self._conn, name)


class GrammarCalls:
    """``self.structured_output_manager`` where the scheduler calls its
    ``accept_tokens`` (S:2186) while it is recorded: the grammar's refusal
    of a request's tokens is noted, the answer goes back unchanged."""

    __slots__ = ("_som", "_rec")

    def __init__(self, som: StructuredOutputManager, rec: Recorder) -> None:
        self._som, self._rec = som, rec

    def accept_tokens(self, request: Request, *args: object, **kwargs: object) -> bool:
        ok = self._som.accept_tokens(request, *args, **kwargs)
        rec = self._rec
        if not ok and rec.active:
            rec.guard("accept_tokens", rec.on_grammar_rejected, request)
        return ok

    def __getattr__(self, name: str) -> Any:
        return getattr(self._som, name)


# What the recording scheduler records of the objects it holds: attribute ->
# (the methods called on it whose answers are recorded, the view at those calls).
HELD_CALLS = {
    "connector": (("get_num_new_matched_tokens", "update_state_after_alloc"), ConnectorCalls),
    "structured_output_manager": (("accept_tokens",), GrammarCalls),
}
