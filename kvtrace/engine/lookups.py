"""Records every connector lookup the scheduler makes, in call order."""

from __future__ import annotations

from kvtrace.reference import Request
from kvtrace.trace.events import Lookup


class LookupRecorder:
    """Wraps a connector; forwards every call and keeps the lookups of the step."""

    def __init__(self, connector):
        self.connector = connector
        self._lookups: list[Lookup] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        ext, load_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        self._lookups.append(Lookup(request.request_id, num_computed_tokens, ext, bool(load_async)))
        return ext, load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        return self.connector.request_finished(request, block_ids)

    def take(self) -> list[Lookup]:
        out, self._lookups = self._lookups, []
        return out
