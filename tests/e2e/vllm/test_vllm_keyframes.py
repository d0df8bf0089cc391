"""Keyframes from a real vLLM engine: KVTRACE_KEYFRAME_EVERY=N makes the
recorder's writer process (outside the engine's) write one before every N-th
step, and a replay from each finds what the whole replay finds from there."""

from __future__ import annotations

import pytest

from kvtrace.replay import replay_file
from kvtrace.replay.keyframes import replay_from
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev
from tests._recording import record_apart

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("workload", ["preemption", "async-preemption"])
def test_a_vllm_recording_with_keyframes_replays_the_same_from_each(workload, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("KVTRACE_KEYFRAME_EVERY", "16")
    out, said = record_apart(tmp_path, workload)
    assert "engine failed" not in said
    with TraceReader(out) as r:
        steps = [e.step for e in r if type(e) is ev.Keyframe]
    assert len(steps) >= 4 and all(s % 16 == 0 for s in steps)
    whole = replay_file(out, device=None)
    assert whole.divergences == [] and whole.stopped is None
    for s in steps:
        part = replay_from(out, s)
        assert part.divergences == [] and part.steps == whole.steps
        assert part.from_keyframe == s


def test_a_bad_keyframe_setting_records_without_keyframes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_KEYFRAME_EVERY", "often")
    out, _ = record_apart(tmp_path, "preemption")
    with TraceReader(out) as r:
        kinds = {type(e) for e in r}
    assert ev.Keyframe not in kinds and ev.Step in kinds
