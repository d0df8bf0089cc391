"""Where a trace's keyframes are, found without decoding (kvtrace/trace/scan.py)."""

from __future__ import annotations

import pytest

from kvtrace.trace import TraceReader
from kvtrace.trace.scan import keyframe_lines

from tests.unit.trace.test_io import _keyframed_text, _written


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.jsonl.zst"])
@pytest.mark.parametrize("chunk", [5, 97, 1 << 20])
def test_the_keyframes_found_are_those_a_reader_reads(tmp_path, monkeypatch, name, chunk):
    """In chunks of 5 bytes (a keyframe's start runs across chunks) and more:
    the lines a reader finds keyframes at, where each starts in the text, and
    the text's size."""
    monkeypatch.setattr("kvtrace.trace.scan.READ_CHUNK", chunk)
    text = _keyframed_text(tmp_path)
    path = _written(tmp_path / name, text)
    with TraceReader(path) as r:
        want = [r.last_line for e in r if e.kind == "keyframe"]
    found = keyframe_lines(path)
    assert len(want) >= 5 and found.lines == want
    assert found.size == len(text) and found.whole
    assert found.compression == {"t.jsonl": "plain", "t.jsonl.gz": "gzip", "t.jsonl.zst": "zstd"}[name]
    assert all(text[at - 1:at + 19] == b'\n{"kind":"keyframe",' for at in found.offsets)
    assert [text.count(b"\n", 0, at) + 1 for at in found.offsets] == want


def test_a_damaged_stream_is_scanned_up_to_the_damage(tmp_path):
    text = _keyframed_text(tmp_path)
    path = _written(tmp_path / "t.jsonl.gz", text)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with TraceReader(path) as r:
        want = [r.last_line for e in r if e.kind == "keyframe"]
    found = keyframe_lines(path)
    assert not found.whole and 0 < found.size < len(text)
    assert found.lines[:len(want)] == want


def test_a_keyframe_cut_off_is_not_found(tmp_path):
    """A trace cut in the middle of a keyframe's line: that keyframe is not
    one (no reader reads it), those before it are."""
    text = _keyframed_text(tmp_path)
    whole = keyframe_lines(_written(tmp_path / "t.jsonl", text))
    at = whole.offsets[3] + 100
    found = keyframe_lines(_written(tmp_path / "cut.jsonl", text[:at]))
    assert found.lines == whole.lines[:3] and found.size == at
