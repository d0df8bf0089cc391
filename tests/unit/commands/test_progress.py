"""The progress line: a percentage where the end is known, on a terminal only,
and the reader's hook that tells it how far through its file a reader is."""

from __future__ import annotations

import gzip
import re
from io import StringIO
from pathlib import Path

from rich.console import Console

from kvtrace.commands.progress import progress
from kvtrace.trace import reader as reader_module
from kvtrace.trace.reader import TraceReader

from tests.mini_traces import write_mini_trace

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal() -> tuple[Console, StringIO]:
    buf = StringIO()
    return Console(file=buf, force_terminal=True, width=100), buf


def _frames(buf: StringIO) -> list[str]:
    """What the line showed, frame by frame, without its colours."""
    return [f.strip() for f in re.split(r"[\r\n]", ANSI.sub("", buf.getvalue())) if f.strip()]


def _big_trace(path: Path) -> Path:
    """A plain trace of a few MB: several of the reader's 1 MiB chunks."""
    return write_mini_trace(path, requests={f"r{i}": 30 for i in range(3000)}, max_tokens=2)


def test_a_known_total_shows_a_percentage_and_the_count():
    console, buf = _terminal()
    with progress("replaying 4 traces", "done", total=4, console=console) as advance:
        advance(1)
    frames = _frames(buf)
    assert "starting" in frames[0]                    # drawn before any news
    last = frames[-1]
    assert "25%" in last and "1 done" in last and "replaying 4 traces" in last


def test_bytes_read_give_the_percentage(tmp_path):
    trace = _big_trace(tmp_path / "big.jsonl")
    console, buf = _terminal()
    with progress("reading big.jsonl", "steps", files=(trace,), console=console):
        for _ in TraceReader(trace):
            pass
    assert "100%" in _frames(buf)[-1]
    # Listed twice (read twice, as a report does), one reading is half the work.
    console, buf = _terminal()
    with progress("reporting big.jsonl", "steps", files=(trace, trace), console=console):
        for _ in TraceReader(trace):
            pass
    assert "50%" in _frames(buf)[-1]
    assert reader_module.read_watchers == []          # the hook is gone afterwards


def test_no_end_known_shows_the_count():
    console, buf = _terminal()
    with progress("recording x", "steps", console=console) as advance:
        advance(1234)
    last = _frames(buf)[-1]
    assert "1,234 steps" in last and "%" not in last


def test_off_a_terminal_nothing_is_drawn(capsys, tmp_path):
    trace = _big_trace(tmp_path / "big.jsonl")
    with progress("reading big.jsonl", "steps", files=(trace,)) as advance:   # stderr is captured
        advance(3)
        for _ in TraceReader(trace):
            pass
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert reader_module.read_watchers == []


def _positions(path: Path) -> tuple[list[int], int | None]:
    seen: list[int] = []
    sizes: set = set()

    def watch(r):
        seen.append(r.position)
        sizes.add(r.size)

    reader_module.read_watchers.append(watch)
    try:
        for _ in TraceReader(path):
            pass
    finally:
        reader_module.read_watchers.remove(watch)
    assert len(sizes) == 1
    return seen, sizes.pop()


def test_the_reader_reports_growing_byte_counts_up_to_the_file_size(tmp_path):
    plain = _big_trace(tmp_path / "big.jsonl")
    seen, size = _positions(plain)
    assert size == plain.stat().st_size
    assert seen == sorted(seen) and seen[-1] == size
    assert len(set(seen)) >= 3                       # it moved on in steps, chunk by chunk
    packed = tmp_path / "big.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    seen, size = _positions(packed)
    assert size == packed.stat().st_size             # bytes of the file as stored: compressed
    assert seen == sorted(seen) and seen[-1] == size
