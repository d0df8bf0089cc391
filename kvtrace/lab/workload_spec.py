"""A vLLM workload, as the drivers run it (run.py, serve.py): one typed struct,
so that a key no driver reads is an error that names it, not a setting
silently ignored. The stored workloads (workloads.py) and the random ones
(random_workloads.py) are dicts of these keys; ``as_workload`` checks one.
What each key does: run.py's module docstring.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Workload(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompts: list[list[int]]
    max_tokens: int = 32
    engine: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    per_request: list[dict[str, Any]] | None = None
    priority: list[int] | None = None
    cache_salts: list[str | None] | None = None
    arrive_at: list[int] | None = None
    aborts: list[list[Any]] | None = None          # [step, [index, ...]]
    control: list[list[Any]] | None = None         # [step, action, ...]
    sessions: list[list[Any]] | None = None        # [index, [[step, ids | None], ...]]
    structured: list[dict[str, Any] | None] | None = None
    grammar_faults: dict[Any, dict[str, Any]] | None = None   # index -> fault
    embeds: list[int | dict[str, Any] | None] | None = None   # a seed, or {"seed"|"table": s, ...}
    lora: list[int | None] | None = None
    throttle_every: int | None = None
    pooling: bool = False
    model: str = "tiny"
    model_free_layers: list[str] | None = None

    @property
    def driven_step_by_step(self) -> bool:
        """Whether requests arrive or are aborted at given steps (serve.py)."""
        return self.arrive_at is not None or self.aborts is not None


class BadWorkload(ValueError):
    """A workload with a key no driver reads, or a value of the wrong type."""


def as_workload(wl: dict | Workload) -> Workload:
    """``wl`` checked: BadWorkload names the key that is unknown or wrong."""
    if isinstance(wl, Workload):
        return wl
    try:
        return msgspec.convert(wl, Workload, strict=False)
    except msgspec.ValidationError as e:
        raise BadWorkload(f"bad vLLM workload: {e}") from None
