"""What the recorder captures on the engine's thread: named tuples of the
engine's own lists and counters, whose field names are the schema's
(``RawStep``, ``RawOutput`` and their parts), cheap to build and encoded as JSON
arrays on the way to the writer process. ``records`` turns them into records.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvtrace.trace.events import STATUSES

# vLLM status names that the trace schema folds into one of its own.
STATUS_FOLD = {
    "FINISHED_REPETITION": "FINISHED_STOPPED",
}


class Scheduled(NamedTuple):
    """A request in ``Step.new`` or ``Step.resumed`` (the fields of ``ScheduledNew``)."""

    req: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list


class RunningColumns(NamedTuple):
    """Copies of the scheduler output's ``scheduled_cached_reqs`` columns."""

    req_ids: list
    num_computed_tokens: list
    new_block_ids: list            # as vLLM holds them: per-group lists, or None
    num_scheduled_tokens: dict     # req id -> tokens, for every scheduled request


class StateCounters(NamedTuple):
    """A request's counters in a snapshot (``RequestState`` without its blocks)."""

    req: str
    status: Any                    # the engine's status enum (its value travels)
    num_computed_tokens: int
    num_tokens: int
    num_preemptions: int


class Snapshot(NamedTuple):
    """The states of some requests. With a block table to read incrementally,
    ``blocks`` holds each request's list of block objects *as the KV manager
    holds it* and ``lengths`` its length at the snapshot: the list only grows
    while the request holds it, so its first ``length`` blocks are the request's
    table at that moment, whenever they are read. Otherwise ``blocks`` holds
    lists of ids, read at the snapshot, and ``lengths`` is None."""

    req_ids: list
    counters: list                 # StateCounters (or tuples of its fields)
    blocks: list
    lengths: list | None


class Sampled(NamedTuple):
    """Copies of the model output's sampled tokens and its index."""

    req_ids: list
    sampled_token_ids: list
    req_id_to_index: dict


class RawStep(NamedTuple):
    """One ``schedule()`` as captured; ``rare`` holds the step's rare fields
    that hold something (``spec``, ``grammar``, ``throttle_prefills``), or None."""

    step: int
    new: list                      # Scheduled
    resumed: list                  # Scheduled
    running: RunningColumns
    preempted: list
    finished: list
    lookups: list
    loads: list | None
    states: Snapshot
    num_free_blocks: int | None
    rare: dict | None


class RawOutput(NamedTuple):
    """One ``update_from_output()`` as captured; ``rare`` as a step's
    (``grammar_rejected``, ``pooled``), or None."""

    step: int
    sampled: Sampled
    connector: Any                 # ConnectorOutput or None
    finished: dict
    states: Snapshot
    rare: dict | None


def all_groups(block_ids: Any) -> list:
    """vLLM's block ids as the recorder carries them: group 0's list with one
    group, a list per group with several (``split_groups`` tells them apart)."""
    if block_ids is None:
        return []
    if len(block_ids) and not isinstance(block_ids[0], int):
        if len(block_ids) == 1:
            return list(block_ids[0])
        return [list(g) for g in block_ids]
    return list(block_ids)


def split_groups(ids: list) -> tuple[list, list | None]:
    """(group 0's ids, the other groups' lists or None) of what ``all_groups`` made."""
    if ids and type(ids[0]) is list:
        return ids[0], ids[1:]
    return ids, None


def status_name(name: str) -> str:
    """The schema's status for a vLLM ``RequestStatus`` name."""
    if name in STATUSES:
        return name
    return STATUS_FOLD.get(name, "WAITING")
