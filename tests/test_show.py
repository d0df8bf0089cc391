"""kvtrace show: the run summary and one request's history, rendered with rich."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from kvtrace.report.show import UnknownRequest, show, sparkline
from kvtrace.report.figures import Series
from kvtrace.report.summary import summarize
from kvtrace.trace.events import (
    Arrival, Header, Output, RequestState, ScheduledNew, ScheduledRunning, SchedulerConfig, Step,
)
from kvtrace.trace.io import TraceError, TraceWriter

from mini_traces import write_mini_trace

TRACES = Path(__file__).resolve().parent.parent / "traces"


def _console() -> Console:
    return Console(record=True, width=200, color_system=None)


def test_summary_of_a_connector_trace():
    c = _console()
    s = show(TRACES / "connector.jsonl.gz", console=c)
    out = c.export_text()
    assert "82 steps · 7 requests" in out
    assert "finished: 7 length" in out
    assert "preemptions        1" in out
    # 64 of 649 prompt tokens hit the local cache, 403 came from the connector.
    assert "prefix hit rate    9.9% (64 of 649 prompt tokens" in out
    assert "external hit rate  62.1% (403 prompt tokens" in out
    assert "48 lookups (1 not ready, 43 async), 8 loads" in out
    assert "1 failed, 1 invalid blocks" in out
    assert "peak 19/19 blocks" in out
    assert s.steps == 82 and s.requests == 7 and not s.timelines


def test_summary_of_a_preemption_trace():
    c = _console()
    show(TRACES / "preemption.jsonl.gz", console=c)
    out = c.export_text()
    assert "preemptions        5 (requests preempted: 4)" in out
    assert "external hit rate  0.0%" in out
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")   # KV usage sparkline


def test_request_history_with_preemption():
    c = _console()
    show(TRACES / "preemption.jsonl.gz", request="3", console=c)
    out = c.export_text()
    assert "request 3-827a4ea2" in out
    assert "prompt 68 tokens, max_tokens 64" in out
    lines = out.splitlines()

    def row(step: str, event: str) -> str:
        hits = [ln for ln in lines if f"│ {step} │ {event}" in ln.replace("  ", " ").replace("  ", " ")
                or (ln.split("│")[1:3] and [x.strip() for x in ln.split("│")[1:3]] == [step, event])]
        assert hits, f"no row {step} {event} in\n{out}"
        return hits[0]

    adm = row("0", "admitted")
    assert "32→68" in adm and "36" in adm and "4, 9, 10" in adm and "local 32, external 0" in adm
    assert "60 decode steps" in row("1–60", "decode")
    assert "preempted with 128 tokens computed" in row("61", "preempted")
    res = row("64", "resumed")
    assert "64→129" in res and "65" in res and "prefill" in res
    assert "finished: length" in row("66", "finished")
    assert "1 preemptions" in out
    assert "num_local_cached_tokens 32" in out and "num_cache_creation_tokens 32" in out


def test_request_history_of_an_async_load():
    c = _console()
    show(TRACES / "connector.jsonl.gz", request="2-a1675dff", console=c, collapse_decode=False)
    out = c.export_text()
    for text in ("async-wait", "WAITING_FOR_REMOTE_KVS", "load tokens [0, 75)",
                 "asynchronous load finished", "load tokens [96, 97)", "resumed", "preempted"):
        assert text in out, text
    assert "decode steps" not in out          # nothing collapsed
    assert out.count("│ scheduled") >= 30


def test_unknown_and_ambiguous_requests(tmp_path):
    with pytest.raises(UnknownRequest, match="no request 'nope'"):
        show(TRACES / "connector.jsonl.gz", request="nope", console=_console())
    t = write_mini_trace(tmp_path / "t.jsonl", requests={"r1": 4, "r10": 4, "x": 4})
    with pytest.raises(UnknownRequest, match="2 requests start with 'r': r1, r10"):
        show(t, request="r", console=_console())
    c = _console()
    show(t, request="r1", console=c)           # an exact id wins over a longer one
    assert "request r1\n" in c.export_text()


def test_unusable_trace_raises_trace_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(TraceError):
        show(bad, console=_console())


def test_truncated_trace_says_so(tmp_path):
    t = write_mini_trace(tmp_path / "t.jsonl", close=False)
    c = _console()
    show(t, console=c)
    assert "truncated: no 'end' record" in c.export_text()


def test_series_downsampling_keeps_extremes_and_bounds_memory():
    s = Series(100)
    for x in range(100_000):
        s.add(x, 7 if x == 54_321 else x % 5)
    pts = s.points()
    assert len(pts) <= 101
    assert max(y for _, y in pts) == 7 and (54_321, 7) in pts
    assert min(y for _, y in pts) == 0
    assert pts[-1] == (99_999, 99_999 % 5)
    assert [x for x, _ in pts] == sorted(x for x, _ in pts)
    assert len(sparkline(s, 7, width=40)) == 40


def test_summary_memory_follows_live_requests(tmp_path):
    t = write_mini_trace(tmp_path / "long.jsonl", requests={f"r{i}": 5 for i in range(300)},
                         max_tokens=2)
    s = summarize(t, max_timelines=3, keep={"r150"})
    assert s.requests == 300
    assert sorted(s.timelines) == ["r0", "r1", "r150", "r2"]
    assert s.timelines_left_out == 296
    assert len(s.sched_tokens.points()) <= 2001
    long = _one_long_request(tmp_path / "longer.jsonl.gz", decode_steps=5000)
    s = summarize(long, max_timelines=1)
    assert s.steps == 5001
    tl = s.timelines["a"]
    assert len(tl.computed.points()) <= 601 and tl.history is None
    assert tl.computed.max == 5004
    assert len(s.sched_tokens.points()) <= 2001 and len(s.kv_used.points()) <= 2001
    assert s.peak_kv_used == 1251           # ceil(5004 / 4)


def _one_long_request(path: Path, decode_steps: int) -> Path:
    """One request: a 4-token prompt, then ``decode_steps`` decode steps, block size 4."""
    n = decode_steps + 5
    cfg = SchedulerConfig(block_size=4, num_blocks=n // 4 + 8, max_num_batched_tokens=64,
                          max_num_seqs=4, max_model_len=n + 8)
    with TraceWriter(path, Header(engine="embedded", engine_version="test", config=cfg)) as w:
        w.write(Arrival(seq=w.next_seq(), req="a", prompt_token_ids=[1, 2, 3, 4],
                        max_tokens=decode_steps + 1))
        blocks, c, tokens = [], 0, 4
        for k in range(decode_steps + 1):
            sched = 4 if k == 0 else 1
            need = -(-(c + sched) // 4) - len(blocks)
            new = list(range(len(blocks) + 1, len(blocks) + 1 + need))
            blocks += new
            item = (ScheduledNew(req="a", num_computed_tokens=0, num_scheduled_tokens=4,
                                 block_ids=list(blocks)) if k == 0 else
                    ScheduledRunning(req="a", num_computed_tokens=c, num_scheduled_tokens=1,
                                     new_block_ids=new))
            c += sched
            st = RequestState(req="a", status="RUNNING", num_computed_tokens=c, num_tokens=tokens,
                              num_preemptions=0, block_ids=list(blocks))
            w.write(Step(seq=w.next_seq(), step=k, new=[item] if k == 0 else [],
                         running=[] if k == 0 else [item], states=[st],
                         num_free_blocks=cfg.num_blocks - 1 - len(blocks)))
            tokens += 1
            done = k == decode_steps
            w.write(Output(seq=w.next_seq(), step=k, sampled={"a": [5]},
                           finished={"a": "length"} if done else {}))
    return path
