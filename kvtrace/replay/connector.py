"""A connector that answers the reference scheduler with the engine's recorded
answers, in call order, and notes every call that does not line up: its
lookups (in each step's record) and its answers to ``request_finished``
(``request_finished`` records, before the call that finished the request)."""

from __future__ import annotations

from kvtrace.findings import Divergence
from kvtrace.reference import Request
from kvtrace.trace import events as ev


class RecordedConnector:
    def __init__(self) -> None:
        self.pending: list[ev.Lookup] = []
        self.step: int | None = None
        self.divergences: list[Divergence] = []
        self.made: list[ev.Lookup] = []        # lookups as the reference made them
        self.loads: list[ev.KVLoad] = []       # loads the reference's admissions imply
        self._last_local: dict[str, int] = {}
        # Recorded answers to request_finished not asked for yet: request -> delay_free.
        self._finished: dict[str, bool] = {}

    def start_step(self, step: int, lookups: list[ev.Lookup]) -> None:
        self.step, self.pending = step, list(lookups)
        self.made, self.loads = [], []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        rid = request.request_id
        at = next((i for i, lk in enumerate(self.pending) if lk.req == rid), None)
        if at is None:
            self._diverge(rid, "lookup", None, num_computed_tokens,
                          "2.2: the reference consulted the connector; the engine did not")
            answer = ev.Lookup(rid, num_computed_tokens, 0, False)
        else:
            for skipped in self.pending[:at]:
                self._diverge(skipped.req, "lookup", skipped.local, None,
                              "2.2: the engine consulted the connector; the reference did not")
            answer = self.pending[at]
            self.pending = self.pending[at + 1:]
            if answer.local != num_computed_tokens:
                self._diverge(rid, "lookup.local", answer.local, num_computed_tokens,
                              "7.4: the local hit passed to the connector must equal a fresh lookup")
        self.made.append(ev.Lookup(rid, num_computed_tokens, answer.ext, answer.load_async))
        self._last_local[rid] = num_computed_tokens
        return answer.ext, answer.load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int):
        if num_external_tokens > 0:
            start = self._last_local.get(request.request_id, 0)
            self.loads.append(ev.KVLoad(request.request_id, start, start + num_external_tokens))

    def finished_answer(self, e: ev.RequestFinished) -> None:
        self._finished[e.req] = e.delay_free

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Whether the connector keeps the request's blocks until it reports the
        request in ``finished_sending``: as recorded (a trace without an answer
        for it: no)."""
        self._last_local.pop(request.request_id, None)
        return self._finished.pop(request.request_id, False)

    def end_step(self) -> None:
        for lk in self.pending:
            self._diverge(lk.req, "lookup", lk.local, None,
                          "2.2: the engine consulted the connector; the reference did not")
        self.pending = []

    def _diverge(self, req, field, recorded, expected, rule) -> None:
        self.divergences.append(Divergence(self.step, req, field, recorded, expected, rule, kind="lookup"))
