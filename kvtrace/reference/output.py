"""What an output does to each scheduled request (``update_from_output``):
its sampled tokens appended up to a stop, its drafts and placeholders taken
back, its prompt stats, a stop that frees it or ends a session's turn, and the
requests an output finishes with an error (semantics doc 3, S:2080-2330)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from .interface import ModelOutput, RequestOutput, in_order
from .request import FINISH_REASONS, Request, Status, check_stop
from .speculative import SpeculativeDecoding


@dataclass(slots=True)
class Stopped:
    """Requests an output stopped: out of ``running`` or the waiting queues at
    the end of the output, and sessions queued again after that."""

    running: set[Request] = field(default_factory=set)
    waiting: set[Request] = field(default_factory=set)
    continuing: list[Request] = field(default_factory=list)

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self) -> None:
        self.running, self.waiting, self.continuing = set(), set(), []


@mypyc_attr(allow_interpreted_subclasses=True)
class Outputs(SpeculativeDecoding):
    """A part of the Scheduler (feature.py): its config, queues and KV manager are ``self``'s."""

    def _request_output(self, req_id: str, n: int, spec: dict[str, list[int]], model: ModelOutput,
                        failed: set[str], stopped: Stopped) -> RequestOutput | None:
        """What the model's output for one scheduled request does to it: its
        tokens appended up to a stop, its drafts and placeholders taken back,
        its prompt stats on its first output. None when it has no output."""
        r = self.requests.get(req_id)
        stale = False
        if r is not None:
            r.num_in_flight_tokens -= n
            if r.num_stale_output_tokens > 0:    # preempted since it was scheduled
                stale = True
                r.num_stale_output_tokens -= n
        if req_id in failed or r is None or r.is_finished:
            return None
        if stale and r.drop_stale_output:
            return None
        new_tokens = list(model.sampled_token_ids.get(req_id, ()))
        if spec and req_id in spec and new_tokens and not stale:
            self._reject_drafts(r, len(spec[req_id]), len(new_tokens))
        status_before = r.status
        num_given, had_placeholders = len(new_tokens), r.num_output_placeholders > 0
        stops = self._append_output(r, new_tokens, model)
        if new_tokens:
            self._take_placeholders(r, num_given, len(new_tokens), stale)
            self._cache_output_blocks(r, stale, status_before, had_placeholders)
        if not (new_tokens or stops):
            return None
        stats, legacy = self._prompt_stats(r)
        reason = None
        if stops:
            reason = FINISH_REASONS[r.status]
            self._stop(r, status_before, stopped)
        return RequestOutput(req_id, new_tokens, reason, stats, legacy)

    def _append_output(self, r: Request, new_tokens: list[int], model: ModelOutput) -> bool:
        """Append the sampled tokens until one stops the request (the rest are
        cut from ``new_tokens``); whether it stops. A pooling request stops
        when its pooler output comes (S:2170-2173), a structured output whose
        grammar refused the tokens with an error (S:2186-2197)."""
        stops = False
        for k, token in enumerate(new_tokens):
            r.append_output_token(token)
            if check_stop(r, self.max_model_len, self.config.profile.min_tokens_before_any_stop):
                stops = True
                del new_tokens[k + 1:]
                break
        if not new_tokens and r.pooling and r.request_id in model.pooled:
            r.status = Status.FINISHED_STOPPED
            stops = True
        if new_tokens and r.request_id in model.grammar_rejected:
            r.status = Status.FINISHED_ERROR
            r.resumable = False
            stops = True
        return stops

    def _prompt_stats(self, r: Request) -> tuple:
        """The prompt stats a request's first output carries, and the legacy pair."""
        stats = r.take_prefill_stats()
        if stats is None:
            return None, None
        stats.finalize(self.kv.estimate_cached_tokens(r.request_id))
        return stats, (r.legacy_num_cached_tokens, r.legacy_num_external_computed_tokens)

    def _stop(self, r: Request, status_before: Status, stopped: Stopped) -> None:
        """A request that stopped is freed, or a session's turn ended and it
        waits again: at once (the removal at the end can undo it, S:2490), or
        under the 0.33 profile after the removal (S:2541-2550)."""
        if self._handle_stopped_request(r):
            self._free_request(r)
        elif self.config.profile.session_requeued_after_stop:
            stopped.continuing.append(r)
        else:
            self._enqueue_waiting(r)
        (stopped.running if status_before == Status.RUNNING else stopped.waiting).add(r)

    def _remove_stopped(self, stopped: Stopped) -> None:
        if stopped.running:
            self.running = [r for r in self.running if r not in stopped.running]
        if stopped.waiting:
            self.waiting.remove_all(stopped.waiting)
            self.kv_holding_waiting.remove_all(stopped.waiting)
            self.deferred_waiting -= stopped.waiting
        for r in stopped.continuing:
            self._enqueue_waiting(r)

    def _finish_with_errors(self, failed: set[str], order: tuple[str, ...] = ()
                            ) -> list[RequestOutput]:
        """Grammars that failed to compile, and failed loads under the "fail"
        policy, finish their requests with an error (S:2302-2326), in ``order``
        where it names them (the engine's own), else sorted."""
        errors = self.grammar_compile_error_ids
        self.grammar_compile_error_ids = set()
        if failed and self.config.load_failure_policy == "fail":
            errors |= failed
        if not errors:
            return []
        return [RequestOutput(r.request_id, [], FINISH_REASONS[r.status])
                for r in self.finish_requests(in_order(errors, order), Status.FINISHED_ERROR)]
