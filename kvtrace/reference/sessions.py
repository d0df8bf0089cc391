"""Streaming-input sessions (vLLM's resumable requests): one request whose
input comes in chunks under one id. A stop ends its turn instead of the
request: it goes back to waiting with its blocks, rewound to the tokens whose
KV is written, and takes its next chunk (or waits for it in
WAITING_FOR_STREAMING_REQ, holding a slot of ``max_num_seqs``) until the end
of its input comes (S:2465-2491, S:2616-2628)."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from .feature import SchedulerFeature
from .interface import SchedulerAssertion
from .request import Request, Status, StreamingUpdate


@mypyc_attr(allow_interpreted_subclasses=True)
class Sessions(SchedulerFeature):
    """A part of the Scheduler (feature.py): its config and queues are ``self``'s."""

    def _add_to_session(self, session: Request, request: Request) -> None:
        """A live session's next chunk (or the end of its input): taken at once
        if the session waits for one, else after its turn (S:2616-2628)."""
        assert session.streaming_queue is not None, "duplicate request id"
        update = StreamingUpdate.from_request(request)
        if session.status != Status.WAITING_FOR_STREAMING_REQ:
            session.streaming_queue.append(update)
        elif update is not None:
            self._update_request_as_session(session, update)
        else:
            self.finish_requests([request.request_id], Status.FINISHED_ABORTED)

    def _handle_stopped_request(self, r: Request) -> bool:
        """Whether a request that stopped has finished. A session's turn ends
        instead: it is rewound to the tokens whose KV is written (its output in
        flight is dropped), takes its next chunk if one came meanwhile, else
        waits for one, and goes back to waiting with its blocks (S:2465-2491)."""
        if not r.resumable:
            return True
        r.num_computed_tokens -= r.num_output_placeholders
        r.spec_token_ids = []
        r.drop_stale_output = True
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        if r.streaming_queue:
            update = r.streaming_queue.popleft()
            if update is None:   # the end of its input
                return True
            self._update_request_as_session(r, update)
        else:
            r.status = Status.WAITING_FOR_STREAMING_REQ
            self.num_waiting_for_streaming_input += 1
        return False

    def _update_request_as_session(self, r: Request, update: StreamingUpdate) -> None:
        """A session takes its next chunk and waits to be scheduled (S:1650-1691).
        It keeps its outputs up to those computed, or under the 0.33 profile up
        to its last sampled token (S:1879-1900)."""
        keep = r.num_computed_tokens
        if self.config.profile.session_keeps_sampled_outputs:
            keep = r.num_tokens - 1
            if keep < r.num_computed_tokens:
                raise SchedulerAssertion(r.request_id, "S:1888 a turn ends with tokens computed "
                                                       "past its last sampled one")
        r.start_next_turn(update, keep, self.config.profile.session_truncates_hashes)
        if r.status == Status.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
        r.status = Status.WAITING
