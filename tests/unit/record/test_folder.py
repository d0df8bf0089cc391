"""A vLLM engine's ring settings (KVTRACE_RING, KVTRACE_SEGMENT), how its
process claims the segment directory, and how a pin is asked of the
recorder writing it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvtrace.record import folder
from kvtrace.record.sink import open_sink
from kvtrace.trace import TraceReader

TRACES = Path(__file__).resolve().parents[3] / "traces"


def test_ring_settings_are_sizes_and_the_ring_holds_two_segments():
    assert folder.ring_settings({}) is None
    assert folder.ring_settings({"KVTRACE_RING": "2GB"}) == (2 * 10**9, 2 * 10**9 // 8)
    assert folder.ring_settings({"KVTRACE_RING": "400KB", "KVTRACE_SEGMENT": "64KiB"}) == (
        400_000, 65_536)
    for env, said in [({"KVTRACE_RING": "lots"}, "is not a size"),
                      ({"KVTRACE_RING": "1MB", "KVTRACE_SEGMENT": "0.1"}, "is not a size"),
                      ({"KVTRACE_RING": "1MB", "KVTRACE_SEGMENT": "800KB"}, "less than two"),
                      ({"KVTRACE_SEGMENT": "1MB"}, "needs KVTRACE_RING")]:
        with pytest.raises(ValueError, match=said):
            folder.ring_settings(env)


def test_a_ring_is_never_written_from_the_engines_process(tmp_path, monkeypatch):
    with TraceReader(TRACES / "preemption.jsonl.gz") as r:
        header = r.header
    monkeypatch.setenv("KVTRACE_RING", "1MB")
    monkeypatch.setenv("KVTRACE_WRITER", "thread")
    with pytest.raises(ValueError, match="KVTRACE_RING needs the writer process"):
        open_sink(tmp_path / "ring", header)
    monkeypatch.setenv("KVTRACE_WRITER", "process")
    monkeypatch.setenv("KVTRACE_RING", "often")
    with pytest.raises(ValueError, match="is not a size"):
        open_sink(tmp_path / "ring", header)
    assert not (tmp_path / "ring").exists()


def test_a_pin_is_asked_of_a_live_kvtrace_process_only(tmp_path):
    with pytest.raises(folder.NoRecorder, match="no recorder is writing here"):
        folder.ask_pin(tmp_path, "why")
    (tmp_path / folder.PID).write_text("12x\n")
    with pytest.raises(folder.NoRecorder, match="not a process id"):
        folder.ask_pin(tmp_path)
    sleeper = subprocess.Popen(["sleep", "30"])
    claim = folder.open_folder(tmp_path)   # as a recorder holds it
    try:
        (tmp_path / folder.PID).write_text(f"{sleeper.pid}\n")
        with pytest.raises(folder.NoRecorder, match="is not a kvtrace recorder"):
            folder.ask_pin(tmp_path, "why")
        assert sleeper.poll() is None   # never signalled
        assert folder.take_reasons(tmp_path) == []   # and no reason left behind
    finally:
        os.close(claim)
        sleeper.kill()


def test_reasons_are_taken_once_oldest_first(tmp_path):
    for i, why in enumerate(["first", "second  reason\n"]):
        (tmp_path / f"{folder.ASKED}1-{10 + i}").write_text(why)
    (tmp_path / f"{folder.ASKED}1-9.tmp").write_text("half written")
    assert folder.take_reasons(tmp_path) == ["first", "second  reason"]
    assert folder.take_reasons(tmp_path) == []
