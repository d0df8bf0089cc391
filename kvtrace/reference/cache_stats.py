"""The connector's prefix-cache stats, as vLLM's ``PrefixCacheStats`` counts
them (MS:121-160): each admission that queried the connector adds a request,
the tokens it queried and those it hit; a request resumed after a preemption
is counted apart."""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(slots=True)
class ConnectorCacheStats:
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    unread: list[str] = field(default_factory=list)   # admitted reading no prefix cache: not counted

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self) -> None:
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0
        self.unread = []

    def record(self, queries: int, hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += queries
            self.preempted_hits += hits
        else:
            self.requests += 1
            self.queries += queries
            self.hits += hits
