"""What goes into and comes out of the scheduler: the connector it consults, the
model output it is fed, and the decisions it returns (semantics doc 2.3, 3)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from mypy_extensions import mypyc_attr

from .request import PrefillStats, Request


class Connector(Protocol):
    """The scheduler side of an external KV store (CB)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """External tokens beyond the local hit, and whether they load
        asynchronously. None means "cannot tell yet; ask again next step"."""

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Called after every successful waiting-queue allocation."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Called when a request finishes; True delays freeing its blocks."""


@dataclass(slots=True)
class ScheduledRequest:
    req_id: str
    num_computed_tokens: int     # before this step
    num_scheduled_tokens: int
    block_ids: list[int]         # whole table (new, resumed) or new blocks only (running)
    more_groups: list[list[int]] | None = None   # the other KV-cache groups' (kv_groups.py)

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self, req_id: str, num_computed_tokens: int, num_scheduled_tokens: int,
                 block_ids: list[int], more_groups: list[list[int]] | None = None) -> None:
        self.req_id = req_id
        self.num_computed_tokens = num_computed_tokens
        self.num_scheduled_tokens = num_scheduled_tokens
        self.block_ids = block_ids
        self.more_groups = more_groups


@dataclass(slots=True)
class SchedulerOutput:
    new: list[ScheduledRequest]
    resumed: list[ScheduledRequest]
    running: list[ScheduledRequest]
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    # Draft tokens scheduled per request (-1: padding), only for those with any.
    spec: dict[str, list[int]] = field(default_factory=dict)

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self, new: list[ScheduledRequest], resumed: list[ScheduledRequest],
                 running: list[ScheduledRequest], num_scheduled_tokens: dict[str, int],
                 preempted_req_ids: set[str], finished_req_ids: set[str],
                 spec: dict[str, list[int]] | None = None) -> None:
        self.new = new
        self.resumed = resumed
        self.running = running
        self.num_scheduled_tokens = num_scheduled_tokens
        self.preempted_req_ids = preempted_req_ids
        self.finished_req_ids = finished_req_ids
        self.spec = {} if spec is None else spec

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class ModelOutput:
    """What the model runner (and the worker side of the connector) returns."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # Structured outputs whose grammar refused the tokens sampled (S:2186-2197).
    grammar_rejected: set[str] = field(default_factory=set)
    # Pooling requests whose pooler output came: each is done (S:2170-2173).
    pooled: set[str] = field(default_factory=set)
    # The order the engine finished the requests it finished with an error:
    # vLLM goes through a set (S:2301-2316, S:2668), in its process's order,
    # which decides the free queue's order. Where a trace holds it (its
    # output's finish reasons, in order), replay follows it; others go sorted.
    error_order: tuple[str, ...] = ()
    # Likewise the order it goes through finished transfers (S:3222-3235), which
    # frees the blocks of the finished requests among them.
    recving_order: tuple[str, ...] = ()
    sending_order: tuple[str, ...] = ()

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self, sampled_token_ids: dict[str, list[int]] | None = None,
                 finished_recving: set[str] | None = None, finished_sending: set[str] | None = None,
                 failed_recving: set[str] | None = None, invalid_block_ids: set[int] | None = None,
                 grammar_rejected: set[str] | None = None, pooled: set[str] | None = None,
                 error_order: tuple[str, ...] = (), recving_order: tuple[str, ...] = (),
                 sending_order: tuple[str, ...] = ()) -> None:
        self.sampled_token_ids = {} if sampled_token_ids is None else sampled_token_ids
        self.finished_recving = set() if finished_recving is None else finished_recving
        self.finished_sending = set() if finished_sending is None else finished_sending
        self.failed_recving = set() if failed_recving is None else failed_recving
        self.invalid_block_ids = set() if invalid_block_ids is None else invalid_block_ids
        self.grammar_rejected = set() if grammar_rejected is None else grammar_rejected
        self.pooled = set() if pooled is None else pooled
        self.error_order = error_order
        self.recving_order = recving_order
        self.sending_order = sending_order


def in_order(ids: set[str], order: tuple[str, ...]) -> list[str]:
    """``ids`` in the engine's order (one of ModelOutput's orders) where it names
    them, the rest sorted."""
    known = [x for x in order if x in ids]
    return known + sorted(ids.difference(known))


@dataclass(slots=True)
class RequestOutput:
    """One ``EngineCoreOutput``."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    prefill_stats: PrefillStats | None = None
    # (num_cached_tokens, num_external_computed_tokens) of a legacy engine,
    # sent with the first output.
    legacy_counters: tuple[int, int] | None = None

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self, req_id: str, new_token_ids: list[int], finish_reason: str | None = None,
                 prefill_stats: PrefillStats | None = None,
                 legacy_counters: tuple[int, int] | None = None) -> None:
        self.req_id = req_id
        self.new_token_ids = new_token_ids
        self.finish_reason = finish_reason
        self.prefill_stats = prefill_stats
        self.legacy_counters = legacy_counters


@mypyc_attr(native_class=False)   # compiled, an exception stays a Python class
class SchedulerAssertion(AssertionError):
    """The engine itself would have failed an assertion here (for example a sync
    external hit that covers the whole prompt, S:1170). ``engine_error``: the
    exception class the engine raises there (an ``assert`` raises
    AssertionError; the block pool raises ValueError)."""

    def __init__(self, req_id: str | None, rule: str, engine_error: str = "AssertionError"):
        self.req_id, self.rule, self.engine_error = req_id, rule, engine_error
        super().__init__(f"{req_id}: {rule}")


@contextmanager
def failing_for(req_id: str):
    """An assertion met inside, whose request is not known there (the block
    pool's), is ``req_id``'s."""
    try:
        yield
    except SchedulerAssertion as a:
        if a.req_id is not None:
            raise
        raise SchedulerAssertion(req_id, a.rule, a.engine_error) from None
