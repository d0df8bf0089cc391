"""What replay and diff report: one ``Divergence`` per place where two accounts of
a run disagree. Reporters consume these; they never re-read traces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Divergence:
    step: int | None          # schedule() index where it shows; None for non-step records
    req: str | None           # request id, None for step-wide fields (e.g. num_free_blocks)
    field: str                # e.g. "num_computed_tokens", "block_ids", "kv-content"
    recorded: Any             # what the trace says
    expected: Any             # what the reference (or the other trace) says
    rule: str                 # the rule broken, e.g. "S:1369 admission sets c = L + E" or "I3"
    kind: str = "counter"     # "counter", "block", "invariant", "stats", "kv-content", "lookup", "diff"
    seq: int | None = None    # sequence number of the record that shows it
    line: int | None = None   # line of the record in the recorded trace, when known

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def first_per_request(divs: list[Divergence]) -> list[Divergence]:
    """Order: each request's first divergence (by step), then everything else in trace order."""
    seen: set = set()
    first, rest = [], []
    for d in divs:
        key = d.req
        (rest if key in seen else first).append(d)
        seen.add(key)
    return first + rest
