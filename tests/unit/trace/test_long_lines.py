"""How long a line the reader takes: a keyframe may pass the limit of the
other records, which the header bounds; it holds every live request's
tokens, waiting ones too, which no header bounds."""

from __future__ import annotations

import pytest

from kvtrace.trace import TraceError, TraceReader, TraceWriter
from kvtrace.trace import events as ev
from kvtrace.trace.limits import LineLimits

from tests._paths import REPO


def _header() -> ev.Header:
    with TraceReader(REPO / "traces" / "preemption.jsonl.gz") as r:
        return r.header


def _write(path, header, record) -> None:
    w = TraceWriter(path, header)
    w.write(record)
    w.close()


def test_a_keyframe_longer_than_any_other_record_may_be_is_read(tmp_path):
    header = _header()
    general = LineLimits(header, 256 << 20).general
    state = {"pad": "x" * (general + (1 << 20))}   # what thousands of waiting prompts take
    path = tmp_path / "big.jsonl.gz"
    _write(path, header, ev.Keyframe(0, 0, 1, "0", state, [], [], [], [], -1))
    with TraceReader(path) as r:
        first = next(iter(r))
    assert type(first) is ev.Keyframe and len(first.state["pad"]) > general


def test_another_record_that_long_is_refused_before_it_is_decoded(tmp_path):
    header = _header()
    general = LineLimits(header, 256 << 20).general
    path = tmp_path / "big.jsonl.gz"
    _write(path, header, ev.Abort(0, ["r" * (general + (1 << 20))], "FINISHED_ABORTED"))
    with TraceReader(path) as r, pytest.raises(TraceError, match="longer than"):
        next(iter(r))
