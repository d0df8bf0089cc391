"""The traces of state models (traces/hybrid-state/): vLLM's own scheduler
re-runs them (tests/test_vllm_state.py), the reference does not model state
groups yet and refuses them. Tests that replay every trace under traces/
take them as expected to fail (``as_params``) or leave them to
tests/test_vllm_state.py (``reference_replays``); when the reference models
state groups, STATE_GROUPS_MODELLED turns both into plain replays."""

from __future__ import annotations

from pathlib import Path

import pytest

STATE_GROUPS_MODELLED = False
PENDING = "the reference does not model state groups yet"


def is_state_trace(path: Path) -> bool:
    return "hybrid-state" in Path(path).parts


def reference_replays(path: Path) -> bool:
    """Whether the reference replays ``path`` today."""
    return STATE_GROUPS_MODELLED or not is_state_trace(path)


def as_params(paths: list[Path]) -> list:
    """``paths`` as pytest params, a state model's expected to fail (strict)
    until the reference models state groups."""
    return [p if reference_replays(p) else
            pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=PENDING))
            for p in paths]
