"""Where an injected fault really changed the engine's behaviour.

Tests use it to check a replay's findings independently: a fault that never
fired cannot be detected, and a finding should point at a logged change.
"""

from __future__ import annotations

from typing import NamedTuple


class FaultEvent(NamedTuple):
    step: int
    req: str
    change: str


class FaultLog:
    def __init__(self) -> None:
        self.step = 0                       # the engine's current step
        self.events: list[FaultEvent] = []

    def note(self, req_id: str, change: str) -> None:
        self.events.append(FaultEvent(self.step, req_id, change))

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)
