"""What one ``schedule()`` call has decided so far, and the budget it has left."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_manager import Blocks
from .request import Request


@dataclass(slots=True)
class StepPlan:
    """A step being planned: the requests scheduled so far, in each of the
    output's lists, and the token and input budgets left."""

    token_budget: int
    input_budget: int
    threshold: int                      # long_prefill_token_threshold in force, 0 = none
    draft_slots: int = 0                # input slots each scheduled request takes for drafting
    running: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_blocks: dict[str, Blocks] = field(default_factory=dict)   # running requests only
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec: dict[str, list[int]] = field(default_factory=dict)   # drafts scheduled
    prefill_scheduled: bool = False     # the running pass scheduled a prefill chunk
    prefill_admitted: bool = False      # the waiting pass admitted a prompt to compute
    defer_prefills: bool = False        # prefills are held back this step (cadence.py)

    # Written out: compiled, the dataclass's own __init__ would run as Python.
    def __init__(self, token_budget: int, input_budget: int, threshold: int,
                 draft_slots: int = 0) -> None:
        self.token_budget = token_budget
        self.input_budget = input_budget
        self.threshold = threshold
        self.draft_slots = draft_slots
        self.running, self.new, self.resumed, self.preempted = [], [], [], []
        self.new_blocks, self.num_scheduled, self.spec = {}, {}, {}
        self.prefill_scheduled = self.prefill_admitted = self.defer_prefills = False

    def has_budget(self) -> bool:
        """Room for one more token, and in the input budget for its request's
        drafting slots too (S:659-662)."""
        return self.token_budget > 0 and self.input_budget > self.draft_slots

    def capped(self, remaining: int) -> int:
        """``remaining`` capped by the long-prefill threshold."""
        return self.threshold if 0 < self.threshold < remaining else remaining

    def room(self) -> int:
        """Tokens this step can still take: the smaller of its two budgets, the
        input budget less the next request's drafting slots (S:711, S:1118)."""
        return min(self.token_budget, self.input_budget - self.draft_slots)

    def chunk(self, remaining: int) -> int:
        """How much of ``remaining`` fits: capped by the threshold and both budgets."""
        return min(self.capped(remaining), self.room())

    def take(self, r: Request, n: int) -> None:
        self.num_scheduled[r.request_id] = n
        self.token_budget -= n
        self.input_budget -= n + self.draft_slots

    def undo(self, r: Request) -> None:
        """A priority victim already scheduled in this step gives its budget back."""
        self.running.remove(r)
        n = self.num_scheduled.pop(r.request_id)
        self.token_budget += n
        self.input_budget += n + self.draft_slots
        self.new_blocks.pop(r.request_id)
        self.spec.pop(r.request_id, None)
