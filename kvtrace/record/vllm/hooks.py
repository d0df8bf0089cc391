"""The recording scheduler: a subclass of vLLM's ``Scheduler`` (or of any
scheduler class) whose methods hand each call to the ``Recorder`` and always run
the real method (see ``kvtrace.record.vllm.recorder`` for what is recorded).
It holds its connector and its structured-output manager through properties
that record their answers at the scheduler's own call sites and leave the
objects untouched (``call_sites``).

The class is ``Recording<Base>(_Recording, <the optional hooks>, Base)``: the
methods every scheduler has are recorded by ``_Recording``; a method only some
releases have (``_free_request``, ``set_pause_state``, ...) by a small class of
its own, which joins the bases only when ``Base`` has that method."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

from kvtrace.record.capture import status_name
from kvtrace.record.vllm import call_sites, kv_audit
from kvtrace.record.vllm.recorder import (HELD_CALLS, open_recorder, propagating_failure,
                                          termination_deferred)

if TYPE_CHECKING:
    from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    from kvtrace.record.vllm.recorder import Recorder

logger = logging.getLogger("kvtrace.record")

_S = TypeVar("_S", bound="SchedulerInterface")

_CLASS_CACHE: dict[type, type] = {}
_CHECKED: list[bool] = []   # call_sites.check() passed on this Python


class _Recording:
    """The recorded methods every scheduler has. Each runs the real method
    (the next class in the recording class's MRO), and hands the call to the
    scheduler's recorder while it records (``_kv_rec``)."""

    _kvtrace_recording = True
    _kvtrace: Recorder | None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._kvtrace = None
        try:
            rec = open_recorder(self)
            if rec is not None:
                rec.audit = kv_audit.install(self, rec)
                self._kvtrace = rec
        except Exception:
            logger.exception("kvtrace: recorder set-up failed; the engine runs without recording")
            self._kvtrace = None

    def _kv_rec(self) -> Recorder | None:
        rec = getattr(self, "_kvtrace", None)
        return rec if rec is not None and rec.active else None

    def add_request(self, request: Request, *args: object, **kwargs: object) -> None:
        rec = self._kv_rec()
        is_new = False
        if rec is not None:
            try:
                is_new = request.request_id not in self.requests
            except Exception:
                is_new = False
            if not is_new and rec.active:
                # The next input chunk of a streaming-input session, or the end
                # of its input: before the call, which may end the session.
                rec.guard("add_request", rec.on_session_input, request,
                          self.requests.get(request.request_id))
        result = super().add_request(request, *args, **kwargs)
        if rec is not None and is_new and rec.active:
            rec.guard("add_request", rec.on_add_request, request)
        return result

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus, *args: object,
                        **kwargs: object) -> list[Request]:
        rec = self._kv_rec()
        ids = request_ids
        aborting = False
        if rec is not None and not rec.in_update:
            try:
                if ids is not None and not isinstance(ids, str):
                    ids = list(ids)  # an iterator must survive being read twice
                rec.begin_abort(ids, self, status_name(getattr(finished_status, "name",
                                                               str(finished_status))))
                aborting = True
            except Exception as e:
                rec.fail("finish_requests", e)
        try:
            return super().finish_requests(ids, finished_status, *args, **kwargs)
        finally:
            if aborting and rec.active:
                rec.guard("finish_requests", rec.end_abort)
                rec.guard("finish_requests", rec.settle, self)

    def finish_requests_in_order(self, request_ids: Iterable[str],
                                 finished_status: RequestStatus) -> None:
        """Finish ``request_ids`` one at a time, in this order, recorded as
        one call: a replay's way to make vLLM free them in a recorded
        order (one call frees them in the order of a set of them, S:2668)."""
        rec = self._kv_rec()
        aborting = rec is not None and not rec.in_update and rec.active
        if aborting:
            rec.guard("finish_requests", rec.begin_abort, list(request_ids), self,
                      status_name(finished_status.name))
        try:
            for rid in request_ids:
                super().finish_requests(rid, finished_status)
        finally:
            if aborting and rec.active:
                rec.guard("finish_requests", rec.end_abort)
                rec.guard("finish_requests", rec.settle, self)

    def reset_prefix_cache(self, *args: object, **kwargs: object) -> bool:
        result = False   # what a call that raises did: the preemptions, no reset
        try:
            result = super().reset_prefix_cache(*args, **kwargs)
            return result
        finally:
            rec = self._kv_rec()
            if rec is not None:
                running = kwargs.get("reset_running_requests", args[0] if args else False)
                connector = kwargs.get("reset_connector", args[1] if len(args) > 1 else False)
                rec.guard("reset_prefix_cache", rec.on_reset, running, connector, result)
                rec.guard("reset_prefix_cache", rec.settle, self)

    def make_stats(self, *args: object, **kwargs: object) -> object:
        stats = super().make_stats(*args, **kwargs)
        rec = self._kv_rec()
        if rec is not None and stats is not None:
            rec.guard("make_stats", rec.on_stats, stats)
        return stats

    def _preempt_request(self, request: Request, *args: object, **kwargs: object) -> None:
        result = super()._preempt_request(request, *args, **kwargs)
        rec = self._kv_rec()
        if rec is not None:
            rec.guard("_preempt_request", rec.on_preempt, request)
        return result

    def schedule(self, *args: object, **kwargs: object) -> SchedulerOutput:
        rec = self._kv_rec()
        if rec is not None:
            throttle = bool(kwargs.get("throttle_prefills", args[0] if args else False))
            rec.guard("schedule", rec.begin_step, self, throttle)
        try:
            out = super().schedule(*args, **kwargs)
        except BaseException as exc:
            rec = self._kv_rec()
            if rec is not None:
                rec.guard("schedule", rec.on_schedule_failed, self, exc)
                rec.guard("schedule", rec.sink.flush)   # the engine is failing
            raise
        rec = self._kv_rec()
        if rec is not None:
            rec.guard("schedule", rec.on_schedule, self, out)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput, *args: object,
                           **kwargs: object) -> dict[int, EngineCoreOutputs]:
        rec = self._kv_rec()
        ctx = None
        if rec is not None:
            ctx = rec.guard("update_from_output", rec.pre_update, self, scheduler_output,
                            model_runner_output)
            rec.in_update = True
        try:
            result = super().update_from_output(scheduler_output, model_runner_output,
                                                *args, **kwargs)
        except BaseException:
            if rec is not None:
                rec.guard("update_from_output", rec.sink.flush)   # the engine is failing
            raise
        finally:
            if rec is not None:
                rec.in_update = False
        if ctx is not None and rec.active:
            rec.guard("update_from_output", rec.post_update, self, ctx, result)
            rec.guard("update_from_output", rec.settle, self)
        return result

    def shutdown(self, *args: object, **kwargs: object) -> None:
        failure = propagating_failure()   # the engine failed: the trace ends "interrupted"
        try:
            return super().shutdown(*args, **kwargs)
        finally:
            rec = getattr(self, "_kvtrace", None)
            if rec is not None:
                try:
                    with termination_deferred():
                        rec.close(interrupted=failure)
                except Exception:
                    logger.exception("kvtrace: closing the trace failed")


class _RecordsFrees:
    """``_free_request``: the order in which an abort frees its requests."""

    def _free_request(self, request: Request, *args: object, **kwargs: object) -> object:
        rec = self._kv_rec()
        if rec is not None and rec.aborts:
            rec.guard("_free_request", rec.on_free, request)
        return super()._free_request(request, *args, **kwargs)


class _RecordsConnectorFinished:
    """``_connector_finished``: the connector's answer for a finished request
    (its request_finished, or request_finished_all_groups, and a partial tail
    it still sends): whether the blocks wait."""

    def _connector_finished(self, request: Request, *args: object,
                            **kwargs: object) -> object:
        result = super()._connector_finished(request, *args, **kwargs)
        rec = self._kv_rec()
        if rec is not None:
            rec.guard("_connector_finished", rec.on_request_finished, request, result)
        return result


class _RecordsPause:
    """``set_pause_state``: ``pause_scheduler`` / ``resume_scheduler``."""

    def set_pause_state(self, pause_state: PauseState, *args: object, **kwargs: object) -> None:
        result = super().set_pause_state(pause_state, *args, **kwargs)
        rec = self._kv_rec()
        if rec is not None:
            rec.guard("set_pause_state", rec.on_pause, pause_state)
            rec.guard("set_pause_state", rec.settle, self)
        return result


class _RecordsDrafts:
    """``update_draft_token_ids``: the drafts proposed after an output."""

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds, *args: object,
                               **kwargs: object) -> None:
        result = super().update_draft_token_ids(draft_token_ids, *args, **kwargs)
        rec = self._kv_rec()
        if rec is not None:
            rec.guard("update_draft_token_ids", rec.on_drafts, self, draft_token_ids)
        return result


# A method only some scheduler classes have -> the class that records it.
_OPTIONAL_HOOKS = (
    ("_free_request", _RecordsFrees),
    ("_connector_finished", _RecordsConnectorFinished),
    ("set_pause_state", _RecordsPause),
    ("update_draft_token_ids", _RecordsDrafts),
)


def make_recording_scheduler(base_cls: type[_S]) -> type[_S]:
    """A subclass of ``base_cls`` that records its decisions (see the module doc).
    Wrapping an already-recording class returns it unchanged. Raises
    RuntimeError on a Python whose bytecode ``call_sites`` cannot read."""
    if getattr(base_cls, "_kvtrace_recording", False):
        return base_cls
    cached = _CLASS_CACHE.get(base_cls)
    if cached is not None:
        return cached
    if not _CHECKED:
        call_sites.check()
        _CHECKED.append(True)
    hooks = [hook for name, hook in _OPTIONAL_HOOKS if hasattr(base_cls, name)]

    class RecordingScheduler(_Recording, *hooks, base_cls):  # type: ignore[misc, valid-type]
        _kvtrace_base = base_cls   # the class that runs, for the header

    for attr, (methods, view) in HELD_CALLS.items():
        setattr(RecordingScheduler, attr,
                call_sites.held(attr, base_cls, frozenset(methods), view))
    RecordingScheduler.__name__ = f"Recording{base_cls.__name__}"
    RecordingScheduler.__qualname__ = RecordingScheduler.__name__
    RecordingScheduler.__module__ = __name__
    _CLASS_CACHE[base_cls] = RecordingScheduler
    return RecordingScheduler
