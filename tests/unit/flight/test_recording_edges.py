"""The recording side of a ring at its edges: a directory claimed by one
recorder at a time, a dump while the recording ends, a Ctrl-C in a
rotation, pins.json on a full disk."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import orjson
import pytest

from kvtrace.flight import SegmentWriter, segment_files
from kvtrace.record.folder import PID, PINS, holds_lock, open_folder
from kvtrace.trace import TraceReader, TraceWriter
from kvtrace.trace import events as ev

TRACES = Path(__file__).resolve().parents[3] / "traces"


def _trace():
    with TraceReader(TRACES / "preemption.jsonl.gz") as r:
        return r.header, [e for e in r if not isinstance(e, ev.End)]


def _feed(w: SegmentWriter, events) -> None:
    """Write ``events`` as an engine does: each numbered by the writer."""
    for e in events:
        while w.next_seq() < e.seq:
            pass
        w.write(e)


def _records(path: Path) -> list:
    with TraceReader(path) as r:
        return list(r)


def test_a_directory_another_recorder_holds_is_refused_and_let_go_at_the_end(tmp_path):
    header, records = _trace()
    folder = tmp_path / "ring"
    claim = open_folder(folder)   # another recorder, before its first segment
    try:
        with pytest.raises(ValueError, match="another recorder writes segments there now"):
            SegmentWriter(folder, header, 4 << 10, 64 << 10, on_pin=lambda m: None)
    finally:
        os.close(claim)
    assert not segment_files(folder)
    w = SegmentWriter(folder, header, 4 << 10, 64 << 10, on_pin=lambda m: None)
    assert holds_lock(folder)
    _feed(w, records[:50])
    w.close()
    assert not holds_lock(folder)


class _Writer(TraceWriter):
    """A segment's writer that calls ``at_end`` as the recording's last
    segment is finished."""

    at_end = staticmethod(lambda: None)

    def finish(self, end):
        if end is not None and end.status != "continued":
            type(self).at_end()
        super().finish(end)


def test_a_dump_while_the_last_segment_is_finished_is_ignored(tmp_path, monkeypatch):
    header, records = _trace()
    got = []

    def mine(signum, frame):   # stands for SIGUSR2's default action, which ends the process
        got.append(signum)

    before = signal.signal(signal.SIGUSR2, mine)
    try:
        monkeypatch.setattr(_Writer, "at_end",
                            staticmethod(lambda: os.kill(os.getpid(), signal.SIGUSR2)))
        w = SegmentWriter(tmp_path / "ring", header, 4 << 10, 64 << 10, open_file=_Writer,
                          on_pin=lambda m: None)
        assert w.listen() and (tmp_path / "ring" / PID).exists()
        _feed(w, records[:50])
        w.close()
        assert got == []   # it came while the last segment was finished: ignored
        assert signal.getsignal(signal.SIGUSR2) is mine   # and the handler is back
        assert not (tmp_path / "ring" / PID).exists()
        assert _records(segment_files(tmp_path / "ring")[-1])[-1].status == "complete"
    finally:
        signal.signal(signal.SIGUSR2, before)


def _raises(signum, frame):   # as kvtrace's command line handles SIGINT
    raise KeyboardInterrupt


@pytest.mark.parametrize("handler", [signal.default_int_handler, _raises])
def test_a_ctrl_c_in_a_rotation_ends_the_segment_under_way_interrupted(tmp_path, handler):
    header, records = _trace()
    folder = tmp_path / "ring"
    opened = []

    def open_file(path, header):
        opened.append(path)
        if len(opened) == 2:   # the first rotation: Ctrl-C as it starts the new segment
            os.kill(os.getpid(), signal.SIGINT)
        return TraceWriter(path, header)

    before = signal.signal(signal.SIGINT, handler)
    written = 0
    try:
        with pytest.raises(KeyboardInterrupt):
            with SegmentWriter(folder, header, 4 << 10, 64 << 10, open_file=open_file,
                               on_pin=lambda m: None) as w:
                for e in records:
                    _feed(w, [e])
                    written += 1
    finally:
        signal.signal(signal.SIGINT, before)
    segs = segment_files(folder)
    assert [p.name for p in segs] == [p.name for p in opened] and len(segs) == 2
    assert _records(segs[0])[-1].status == "continued"
    last = _records(segs[1])
    assert type(last[0]) is ev.Keyframe
    assert last[-1].status == "interrupted" and last[-1].error == "interrupted (KeyboardInterrupt)"
    # Every record written before the interrupt is in a segment: the one under way too.
    steps = [e.step for p in segs for e in _records(p) if isinstance(e, ev.Step)]
    assert steps == [e.step for e in records[:written + 1] if isinstance(e, ev.Step)]


def test_a_full_disk_leaves_no_half_written_pins_file(tmp_path, monkeypatch):
    header, records = _trace()
    said = []
    w = SegmentWriter(tmp_path / "ring", header, 4 << 10, 64 << 10, on_pin=said.append)
    real = Path.write_bytes

    def full(self, data):
        if self.name == f".{PINS}.tmp":
            real(self, data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    w.pin("a dump")
    assert any("cannot write" in m and "No space left" in m for m in said)
    assert sorted(p.name for p in (tmp_path / "ring").iterdir()) == ["segment-000001.jsonl.gz"]
    w.close()


def test_a_pin_asked_just_before_the_end_is_heeded_at_the_end(tmp_path):
    """An engine whose metrics fail and which then fails itself asks a pin
    and ends at once: the reason is in the folder, and its signal may not be
    handled before the end is written. The end heeds it, before its own."""
    from kvtrace.record.folder import ASKED

    header, records = _trace()
    pins = []
    before = signal.getsignal(signal.SIGUSR2)
    try:
        w = SegmentWriter(tmp_path / "ring", header, 4 << 10, 64 << 10, on_pin=pins.append)
        assert w.listen()
        _feed(w, records[:50])
        # As ask_pin writes it; the signal is not sent.
        (tmp_path / "ring" / f"{ASKED}1-1").write_text("vLLM's metrics failed: ValueError\n")
        w.close(status="interrupted", error="the engine stopped on ValueError")
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert len(pins) == 2 and pins[0].endswith(": vLLM's metrics failed: ValueError")
    assert "the next segment" not in pins[0]   # none follows the end
    assert "the recording ends interrupted" in pins[1]
    saved = orjson.loads((tmp_path / "ring" / PINS).read_bytes())
    assert "vLLM's metrics failed: ValueError" in saved.values()
    assert not list((tmp_path / "ring").glob(f"{ASKED}*"))
