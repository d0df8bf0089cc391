"""Split replay (kvtrace/replay/split.py): a trace with keyframes replayed in
pieces gives, byte for byte in ``--json``, the report of a serial replay: on
every stored trace with and without the content check, a cut trace, a replay
that stops at an engine assertion (with keyframes after the stop that say so,
too), a preemption-loop report that a later piece takes back; bad input in a
piece is the serial replay's one line and exit 2, a killed piece an internal
error; a trace without keyframes replays serially."""

from __future__ import annotations

import dataclasses
import gzip
import os
import signal
from pathlib import Path

import orjson
import pytest

from kvtrace import cli
from kvtrace.engine import build_workload, record_workload
from kvtrace.engine.workloads import PlannedAbort
from kvtrace.replay import replay_file
from kvtrace.replay import split as split_module
from kvtrace.replay.keyframes import Keyframer, add_keyframes
from kvtrace.replay.split import (Unsplittable, check_content, merge, plan_split, replay_piece,
                                  report_key)
from kvtrace.report.terminal import replay_json
from kvtrace.trace import TraceReader, TraceWriter
from kvtrace.trace.scan import keyframe_lines

from tests._paths import REPO
from tests.mini_traces import preemption_loop_workload

STORED = sorted(p.relative_to(REPO / "traces").as_posix()
                for p in (REPO / "traces").rglob("*.jsonl*"))


def _steps(path: Path) -> int:
    with TraceReader(path) as r:
        return max((e.step + 1 for e in r if e.kind == "step"), default=0)


def _keyframed(src: Path, dst: Path, per_trace: int = 8) -> Path:
    add_keyframes(src, dst, max(1, _steps(src) // per_trace))
    return dst


def _split(path: Path, device: str | None, jobs: int = 2):
    """The split replay of ``path``, its pieces run one after the other here;
    the pieces' results too."""
    split = plan_split(str(path), jobs, device)
    assert split is not None
    pieces = [replay_piece(p) for p in split.pieces]
    content = check_content(split.content) if split.content is not None else None
    return merge(split, pieces, content), pieces


def _same(path: Path, device: str | None, jobs: int = 2):
    """Split and serial replays of ``path``: the same JSON, events and exit."""
    serial = replay_file(path, device=device)
    merged, pieces = _split(path, device, jobs)
    assert replay_json(merged, str(path)) == replay_json(serial, str(path))
    assert merged.events == serial.events
    return serial, pieces


@pytest.mark.parametrize("name", STORED)
def test_every_stored_trace_split_reports_what_the_serial_replay_reports(name, tmp_path):
    kf = _keyframed(REPO / "traces" / name, tmp_path / "kf.jsonl.gz", 3)
    if not keyframe_lines(kf).lines:   # the replay stops at its first step
        assert plan_split(str(kf), 2, None) is None and replay_file(kf, device=None).stopped
        return
    for device in (None, "auto"):
        serial, pieces = _same(kf, device)
        assert len(pieces) >= 2
    assert serial.device is not None or serial.content_unchecked is not None


@pytest.mark.parametrize("name, cut", [("t.jsonl", "a line cut off"),
                                       ("t.jsonl.gz", "a compressed stream that ends early")])
def test_a_cut_trace_replays_up_to_the_cut(name, cut, tmp_path):
    kf = _keyframed(REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz",
                    tmp_path / ("kf-" + name))
    data = kf.read_bytes()
    kf.write_bytes(data[:int(len(data) * 0.7)])
    for device in (None, "auto"):
        serial, pieces = _same(kf, device, jobs=4)
        assert serial.truncation is not None and len(pieces) >= 3
        assert ("cut off mid-record" if name == "t.jsonl" else "ends early") in serial.truncation


@pytest.fixture(scope="module")
def stops(tmp_path_factory) -> Path:
    """A run whose replay stops at an engine assertion at step 256 of 1,934
    (docs/guide/replay.md)."""
    path = tmp_path_factory.mktemp("stop") / "run.jsonl.gz"
    record_workload(path, build_workload("offload", 4, 160), "async-load-overshoot", 4)
    return path


def test_a_replay_that_stops_at_an_assertion_stops_there_split_too(stops, tmp_path):
    kf = _keyframed(stops, tmp_path / "kf.jsonl.gz", 30)
    for device in (None, "auto"):
        serial, pieces = _same(kf, device, jobs=3)
        assert serial.stopped_at is not None and serial.steps < serial.steps_in_trace
        assert len(pieces) >= 2 and pieces[-1].stopped


def _forced(src: Path, dst: Path, every: int) -> None:
    """A copy of ``src`` with a keyframe before every ``every``-th step, also
    past the replay's stop, where a keyframe says only that it stopped (as a
    flight recorder's segment starts)."""
    with TraceReader(src) as reader:
        keyframer = Keyframer(reader.header, every)
        with TraceWriter(dst, reader.header) as writer:
            line = 1
            for e in reader:
                if e.kind == "end":
                    writer.finish(e)
                    break
                due = e.kind == "step" and e.step and not e.step % every
                kf = keyframer.feed(e, line + 1, force=due)
                if kf is not None:
                    writer.write(kf)
                    line += 1
                writer.write(e)
                line += 1


def test_pieces_after_the_stop_only_count(stops, tmp_path):
    """Keyframes past the stop say the replay stopped: their pieces read on and
    count (steps in the trace, the end), and find nothing."""
    kf = tmp_path / "forced.jsonl.gz"
    _forced(stops, kf, 200)
    serial, pieces = _same(kf, None, jobs=4)
    stubs = [p for p in pieces if not p.replayed]
    assert len(stubs) >= 2 and not any(p.divergences for p in stubs)
    assert pieces[-1] in stubs and serial.end is not None


@pytest.mark.parametrize("every", [5, 8])
def test_a_report_made_in_one_piece_is_taken_back_in_a_later_one(every, tmp_path):
    """q5 is preempted PREEMPT_LIMIT times without a token by step 48 (the
    preemption loop of docs/findings.md), then q4 is aborted at step 60 and
    q5 gets through: its report is taken back. With a piece starting between
    the two, the later piece takes back its copy of the report. (Every 8
    steps, a keyframe comes right before step 48's record: the keyframes
    after it hold the report with the line it has in the trace.)"""
    wl = dataclasses.replace(preemption_loop_workload(), aborts=(PlannedAbort(60, "q4"),))
    src = tmp_path / "thrash.jsonl"
    record_workload(src, wl, counters="prefill_stats")
    kf = tmp_path / "kf.jsonl"
    add_keyframes(src, kf, every)
    serial, pieces = _same(kf, None, jobs=40)   # a piece from each keyframe
    assert len(pieces) == len(keyframe_lines(kf).lines) + 1
    later = [p for p in pieces if p.taken_back_earlier]
    assert later and later[0].start > min(p.start or 0 for p in pieces if p.divergences)
    made = [d for p in pieces for d in p.divergences
            if report_key(d) in later[0].taken_back_earlier]
    assert [(d.step, d.req, d.field) for d in made] == [(48, "q5", "progress")]
    assert not any(d.req == "q5" and d.field == "progress" for d in serial.divergences)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_splits_on_processes_and_prints_the_serial_report(tmp_path, capsys,
                                                                      monkeypatch):
    """``-j 2`` on a trace with keyframes: the pieces run in a pool; the JSON,
    the terminal report and the exit code are the serial replay's. Without
    -j it is not split."""
    monkeypatch.setenv("COLUMNS", "80")
    kf = _keyframed(REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz",
                    tmp_path / "kf.jsonl.gz")
    calls = []
    monkeypatch.setattr(split_module, "merge",
                        lambda *a, _merge=split_module.merge: calls.append(1) or _merge(*a))
    for extra in ([], ["--json"], ["--no-kv-check", "--json"]):
        serial = run(capsys, "replay", kf, *extra)
        assert not calls
        assert run(capsys, "replay", kf, "-j", "2", *extra) == serial
        assert calls and serial[0] == 1
        calls.clear()


def test_a_trace_without_keyframes_replays_serially(tmp_path, capsys, monkeypatch):
    src = REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz"
    monkeypatch.setattr(split_module, "replay_split", lambda *a: pytest.fail("split"))
    assert plan_split(str(src), 2, None) is None
    assert run(capsys, "replay", src, "-j", "2", "--json") == run(capsys, "replay", src, "--json")


def _edit(src: Path, dst: Path, line: int, change) -> None:
    """``src`` with the record at ``line`` changed by ``change(record)``."""
    with gzip.open(src, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    rec = orjson.loads(lines[line - 1])
    change(rec)
    lines[line - 1] = orjson.dumps(rec) + b"\n"
    with gzip.open(dst, "wb") as g:
        g.write(b"".join(lines))


def _late_step_line(path: Path) -> int:
    """The line of a step record in the last piece of a split on two processes."""
    split = plan_split(str(path), 2, None)
    start = split.pieces[-1].start
    with TraceReader(path) as r:
        return next(r.last_line for e in r if e.kind == "step" and r.last_line > start + 2)


@pytest.mark.parametrize("change, words", [
    (lambda rec: rec.update(num_free_blocks=10 ** 6), "more than the"),
    (lambda rec: rec.update(step="x"), "step"),
    (lambda rec: rec.setdefault("new", []).append({"req": "ghost", "num_computed_tokens": 0,
                                    "num_scheduled_tokens": 1, "block_ids": [1]}), "ghost"),
])
def test_bad_input_in_a_piece_is_the_serial_replays_one_line(change, words, tmp_path, capsys):
    kf = _keyframed(REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz",
                    tmp_path / "kf.jsonl.gz")
    bad = tmp_path / "bad.jsonl.gz"
    line = _late_step_line(kf)
    _edit(kf, bad, line, change)
    serial = run(capsys, "replay", bad)
    code, out, err = run(capsys, "replay", bad, "-j", "2")
    assert (code, out, err) == serial
    assert code == 2 and out == "" and err.startswith(f"kvtrace: {bad}:{line}: ") and words in err


def test_a_keyframe_unlike_the_replay_gives_the_serial_report_and_says_so(tmp_path, capsys):
    """A keyframe whose pool holds a reference more than the replay's: the
    piece before it finds its state differs; the report is the serial one."""
    kf = _keyframed(REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz",
                    tmp_path / "kf.jsonl.gz")
    start = plan_split(str(kf), 2, None).pieces[-1].start
    bad = tmp_path / "bad.jsonl.gz"

    def leak(rec):   # a free block held by no one, out of the free queue
        pool = rec["state"]["packed"]["pool"]
        free = pool["free"]
        first = free[0][0]
        pool["ref_cnt"][first] += 1
        free[0] = [first + 1, free[0][1] - 1] if free[0][1] > 1 else None
        pool["free"] = [r for r in free if r]

    _edit(kf, bad, start, leak)
    with pytest.raises(Unsplittable, match=f"the keyframe at line {start} differs"):
        _split(bad, None)
    code, out, err = run(capsys, "replay", bad, "-j", "2", "--json")
    assert (code, out) == run(capsys, "replay", bad, "--json")[:2]
    assert f"the keyframe at line {start} does not hold the state" in err


def _killed(piece):
    if piece.start is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return replay_piece(piece)


def test_a_killed_piece_is_an_internal_error(tmp_path, capsys, monkeypatch):
    kf = _keyframed(REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz",
                    tmp_path / "kf.jsonl.gz")
    monkeypatch.setattr(split_module, "replay_piece", _killed)
    code, out, err = run(capsys, "replay", kf, "-j", "2")
    assert code == 3 and out == ""
    assert "internal error" in err and "ended before piece" in err and "killed" in err


def test_the_content_check_on_torch_runs_in_processes_that_did_not_fork_from_this_one(tmp_path):
    """With the check on torch (CUDA cannot be used in a process forked after
    its parent asked CUDA about its devices), the pool's processes start from
    a server process: the report is the same."""
    kf = _keyframed(REPO / "traces" / "faults" / "stale-computed-on-preempt.jsonl.gz",
                    tmp_path / "kf.jsonl.gz")
    split = plan_split(str(kf), 2, "torch-cpu")
    assert split.content.device == "cpu" and split_module._context(split) is not None
    merged = split_module.replay_split(split, 2)
    serial = replay_file(kf, device="torch-cpu")
    assert replay_json(merged, str(kf)) == replay_json(serial, str(kf))
    assert merged.device == "cpu" and merged.slots_checked > 0
