"""The flight recorder: keyframes as a trace is written, a segment directory
that never holds more than its ring, segments that replay alone, the
segments around a trigger kept, and the directory replayed as one trace."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from kvtrace import cli
from kvtrace.engine import build_workload, record_embedded, record_workload
from kvtrace.engine.scheduler import EngineScheduler
from kvtrace.flight import KeyframingWriter, SegmentWriter, segment_files
from kvtrace.flight.replay import replay_folder
from kvtrace.record.folder import open_folder, pid_line, process_start, recorder_of
from kvtrace.record.step_writer import StepWriter, open_step_writer
from kvtrace.replay import replay_file
from kvtrace.replay.keyframes import replay_from
from kvtrace.trace import TraceError, TraceReader, TraceWriter
from kvtrace.trace import events as ev

KEYS = ("step", "req", "field", "recorded", "expected", "rule", "kind")


def _found(result) -> list[tuple]:
    """A replay's divergences, without where in which file they were read."""
    return [tuple(orjson.dumps(d.to_json()[k]) for k in KEYS) for d in result.divergences]


def run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


class LateStaleCached(EngineScheduler):
    """vLLM PR #36752's legacy counter bug (the embedded engine's
    stale-cached-on-preempt), only from step 600 on: a fault that fires late."""

    LATE = 600

    def _record_lookup(self, r, num_local, num_external, load_async):
        super()._record_lookup(r, num_local, num_external, load_async)
        if self.num_steps >= self.LATE:
            r.legacy_num_external_computed_tokens = num_external


def _segments(folder: Path, workload: str, fault=None, seed=1, requests=None, ring=4 << 20,
              segment=64 << 10, every=None, scheduler_cls=None, sizes=None,
              open_file=TraceWriter):
    """Record ``workload`` into ``folder`` as segments, each written by
    ``open_file`` (``kvtrace record``'s writer process is open_step_writer);
    ``sizes`` gets the directory's bytes on disk at every segment's end (the
    most it holds: before the oldest are deleted) and start."""

    def opener(path, header):
        w = SegmentWriter(path, header, segment, ring, every, open_file=open_file,
                          on_pin=lambda msg: None)
        if sizes is not None:
            made, room = w._open, w._make_room

            def measure():
                sizes.append(sum(p.stat().st_size for p in folder.iterdir()))

            def measured(kf):
                made(kf)
                measure()

            def roomed():
                measure()
                room()
            w._open, w._make_room = measured, roomed
        return w

    wl = build_workload(workload, seed, requests)
    return record_workload(folder, wl, fault, seed, open_writer=opener,
                           scheduler_cls=scheduler_cls)


def test_a_ring_never_holds_more_than_its_cap_and_every_segment_left_replays_alone(tmp_path):
    folder, sizes = tmp_path / "ring", []
    ring = 256 << 10
    _segments(folder, "offload", seed=3, requests=40, ring=ring, segment=32 << 10, sizes=sizes,
              open_file=open_step_writer)
    left = segment_files(folder)
    assert len(sizes) > 30 and len(left) < len(sizes) // 2   # segments rotated out
    assert max(sizes) <= ring
    assert sum(p.stat().st_size for p in folder.iterdir()) <= ring
    assert left[0].name != "segment-000001.jsonl.gz"
    for seg in left:
        with TraceReader(seg) as r:
            first = next(iter(r))
        assert type(first) is ev.Keyframe
        alone = replay_from(seg, first.step)
        assert alone.divergences == [] and alone.stopped is None
        assert alone.steps > first.step


def test_the_directory_replays_as_the_whole_trace_does(tmp_path):
    one = tmp_path / "one.jsonl.gz"
    record_embedded(one, "offload", "stale-cached-on-preempt", seed=4)
    folder = tmp_path / "ring"
    _segments(folder, "offload", "stale-cached-on-preempt", seed=4, ring=64 << 20,
              segment=32 << 10)
    assert len(segment_files(folder)) >= 4
    whole = replay_file(one, device=None)
    parts = replay_folder(folder)
    assert whole.divergences and _found(parts) == _found(whole)
    assert parts.steps == whole.steps and parts.gaps == []


def test_a_late_fault_is_caught_from_the_pinned_segments_alone(tmp_path, capsys):
    folder = tmp_path / "ring"
    _segments(folder, "offload", seed=5, requests=200, ring=1 << 20, segment=64 << 10,
              scheduler_cls=LateStaleCached)
    pins = orjson.loads((folder / "pins.json").read_bytes())
    assert pins and all("replay found a divergence" in why for why in pins.values())
    assert "segment-000001.jsonl.gz" not in [p.name for p in segment_files(folder)]
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in pins:
        shutil.copy(folder / name, kept / name)
    code, out, _ = run(capsys, "replay", kept, "--json")
    doc = orjson.loads(out)
    assert code == 1
    assert doc["from_keyframe"] >= LateStaleCached.LATE - 200
    first = doc["likely_cause"]
    assert first["field"].startswith("legacy.") and first["step"] >= LateStaleCached.LATE


def test_dump_pins_the_segments_at_hand(tmp_path, capsys):
    folder = tmp_path / "ring"
    code = (f"import sys, time\nsys.argv = ['kvtrace', 'record', '-o', {str(folder)!r}, "
            "'--workload', 'offload', '--requests', '120', '--ring', '8MB', '--segment', '32KB']\n"
            "from kvtrace.cli import main\nsys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "KVTRACE_QUIET": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(segment_files(folder) if folder.exists() else []) < 3:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        rc, out, err = run(capsys, "dump", folder)
        assert rc == 0 and "asked the recorder" in out
        _, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0
    pins = orjson.loads((folder / "pins.json").read_bytes())
    assert pins and set(pins.values()) == {"SIGUSR2 (kvtrace dump)"}
    assert b"pinned segment-" in stderr and b"SIGUSR2" in stderr
    assert not (folder / "recorder.pid").exists()
    rc, _, err = run(capsys, "dump", folder)
    assert rc == 2 and "no recorder is writing here" in err


def test_recorded_keyframes_give_what_the_whole_replay_gives(tmp_path, capsys):
    path = tmp_path / "kf.jsonl.gz"
    code, _, _ = run(capsys, "record", "-o", path, "--fault", "async-load-overshoot",
                     "--keyframe-every", "40")
    assert code == 0
    with TraceReader(path) as r:
        steps = [e.step for e in r if type(e) is ev.Keyframe]
    assert steps and all(s % 40 == 0 for s in steps)
    whole = replay_file(path, device=None)
    for s in steps:
        part = replay_from(path, s)
        got = _found(part)
        assert got == _found(whole)[len(whole.divergences) - len(got):]


def test_a_keyframer_that_fails_never_stops_the_recording(tmp_path, caplog):
    src = Path(__file__).resolve().parents[3] / "traces" / "preemption.jsonl.gz"
    with TraceReader(src) as r:
        header, events = r.header, list(r)
    out = tmp_path / "out.jsonl.gz"
    w = KeyframingWriter(TraceWriter(out, header), header, 10)

    def broken(*a, **k):
        raise RuntimeError("a keyframer bug")

    w.keyframer.feed = broken
    for e in events:
        if type(e) is ev.End:
            w.finish(e)
        else:
            w.write(e)
    assert "a keyframer bug" in (w.failed or "")
    assert "keyframes stopped" in caplog.text
    with TraceReader(out) as r:
        assert [type(e) for e in r] == [type(e) for e in events]


def test_starting_and_closing_trace_writers_leaks_no_descriptor(tmp_path):
    src = Path(__file__).resolve().parents[3] / "traces" / "preemption.jsonl.gz"
    with TraceReader(src) as r:
        header = r.header
    before = len(os.listdir("/proc/self/fd"))
    for i in range(12):
        StepWriter(tmp_path / f"t{i}.jsonl.gz", header).close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_ring_and_segment_sizes_are_checked(tmp_path, capsys):
    code, _, err = run(capsys, "record", "-o", tmp_path / "d", "--ring", "1MB",
                       "--segment", "800KB")
    assert code == 2 and "less than two segments" in err
    code, _, err = run(capsys, "record", "-o", tmp_path / "d", "--segment", "1MB")
    assert code == 2 and "--segment needs --ring" in err
    code, _, err = run(capsys, "record", "-o", tmp_path / "d", "--ring", "lots")
    assert code == 2 and "is not a size" in err


def test_segments_after_the_replay_stopped_go_on_without_keyframes(tmp_path):
    """The recorder's replay stops where the engine would have failed an
    assertion: later segments start without a keyframe, and a directory
    replay stops where the whole trace's does."""
    one = tmp_path / "one.jsonl.gz"
    wl = build_workload("offload", 4, 160)
    record_workload(one, wl, "async-load-overshoot", 4)
    folder = tmp_path / "ring"
    _segments(folder, "offload", "async-load-overshoot", seed=4, requests=160,
              ring=64 << 20, segment=64 << 10)
    starts = []
    for seg in segment_files(folder)[1:]:
        with TraceReader(seg) as r:
            first = next(iter(r))
        assert type(first) is ev.Keyframe
        starts.append("root" in first.state)
    assert starts[0] and not starts[-1]   # past the stop: readable, not replayable
    with pytest.raises(TraceError, match="holds no replay state"):
        replay_from(segment_files(folder)[-1], 10**9)
    whole = replay_file(one, device=None)
    parts = replay_folder(folder)
    assert whole.stopped_at is not None
    assert parts.stopped_at.step == whole.stopped_at.step
    assert _found(parts) == _found(whole)
    # The segments around the stop rotated out: what came before is still
    # reported, and the replay says where it could not go on.
    segs = segment_files(folder)
    stop_seg = next(i for i, p in enumerate(segs) if _first_step(p) > whole.stopped_at.step)
    before = [d for d in _found(whole) if orjson.loads(d[0]) < _first_step(segs[1])]
    for p in segs[1:stop_seg + 1]:
        p.unlink()
    gapped = replay_folder(folder)
    assert before and _found(gapped) == before
    assert gapped.stopped_at is not None and "no replay starts there" in gapped.stopped_at.reason
    assert gapped.gaps and gapped.steps_in_trace == whole.steps_in_trace


def _first_step(seg) -> int:
    with TraceReader(seg) as r:
        return next(e.step for e in r if hasattr(e, "step"))


def test_a_newest_segment_without_a_whole_header_is_a_cut(tmp_path):
    folder = tmp_path / "ring"
    _segments(folder, "offload", seed=4, ring=64 << 20, segment=32 << 10)
    segs = segment_files(folder)
    whole = replay_folder(folder)
    for content in (b"", segs[-1].read_bytes()[:40]):   # a full disk, or killed as it began
        (folder / "segment-000999.jsonl.gz").write_bytes(content)
        cut = replay_folder(folder)
        assert _found(cut) == _found(whole) and cut.steps == whole.steps
        assert cut.truncation.startswith("segment-000999.jsonl.gz: no header")
    segs[1].write_bytes(b"")   # not the newest: damage in the middle is refused
    with pytest.raises(TraceError):
        replay_folder(folder)


def test_a_directory_says_when_it_was_cut_and_refuses_what_is_not_one_run(tmp_path):
    folder = tmp_path / "ring"
    _segments(folder, "offload", seed=4, ring=64 << 20, segment=32 << 10)
    segs = segment_files(folder)
    assert len(segs) >= 4 and replay_folder(folder).truncation is None
    segs[-1].unlink()   # the recorder killed as it began its last segment
    cut = replay_folder(folder)
    assert f"stops after segment {len(segs) - 1} without its end" in cut.truncation
    twin = folder / segs[1].name.replace(".jsonl.gz", ".jsonl")
    twin.write_bytes(b"")
    with pytest.raises(TraceError, match="holds segment 2 twice"):
        replay_folder(folder)
    twin.unlink()
    segs[1].rename(folder / "segment-000090.jsonl.gz")   # out of order
    with pytest.raises(TraceError, match="segments out of order"):
        replay_folder(folder)
    (folder / "segment-000090.jsonl.gz").rename(segs[1])
    other = tmp_path / "other"
    _segments(other, "kv-pressure", seed=1, ring=64 << 20, segment=32 << 10)
    shutil.copy(segment_files(other)[1], folder / "segment-000091.jsonl.gz")
    with pytest.raises(TraceError, match="another recording"):
        replay_folder(folder)
    for p in segment_files(folder):
        p.unlink()
    shutil.copy(segment_files(other)[0], folder / "segment-000005.jsonl.gz")
    with pytest.raises(TraceError, match="no segment a replay can start from"):
        replay_folder(folder)


def test_a_ring_too_small_for_one_segment_says_so(tmp_path):
    said = []
    wl = build_workload("offload", 2, 60)

    def opener(path, header):
        return SegmentWriter(path, header, 4 << 10, 8 << 10, None, on_pin=said.append)

    record_workload(tmp_path / "small", wl, None, 2, open_writer=opener)
    assert any("cannot hold a segment with its keyframe" in m for m in said)


def test_dump_signals_no_process_but_a_recorder(tmp_path, capsys):
    sleeper = subprocess.Popen(["sleep", "30"])
    claim = open_folder(tmp_path)   # as a recorder holds it
    try:
        (tmp_path / "recorder.pid").write_text(f"{sleeper.pid}\n")
        code, _, err = run(capsys, "dump", tmp_path)
        assert code == 2 and "is not a kvtrace recorder" in err
        assert sleeper.poll() is None   # alive: not signalled
    finally:
        os.close(claim)
        sleeper.kill()


def _stand_in(tmp_path):
    """A process that is no recorder and whose command line says kvtrace, as
    a 'tail -f' of a log under a kvtrace folder does."""
    logs = tmp_path / "kvtrace-logs"
    logs.mkdir()
    (logs / "engine.log").touch()
    proc = subprocess.Popen(["tail", "-f", str(logs / "engine.log")])
    deadline = time.monotonic() + 30
    while b"kvtrace" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():   # once exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_dump_on_a_pid_file_no_recorder_holds_signals_nothing(tmp_path, capsys):
    folder = tmp_path / "ring"
    folder.mkdir()
    other = _stand_in(tmp_path)
    try:
        (folder / "recorder.pid").write_text(f"{other.pid}\n")   # a killed recorder's
        code, out, err = run(capsys, "dump", folder)
        assert code == 2 and "no recorder holds it" in err and len(err.splitlines()) == 1
        time.sleep(0.2)
        assert other.poll() is None   # alive: not signalled
    finally:
        other.kill()


def test_dump_on_a_pid_used_again_signals_nothing(tmp_path, capsys):
    folder = tmp_path / "ring"
    claim = open_folder(folder)   # a recorder holds it, but the pid is another's now
    other = _stand_in(tmp_path)
    try:
        start = process_start(other.pid)
        (folder / "recorder.pid").write_text(f"{other.pid} {start - 1}\n")
        code, out, err = run(capsys, "dump", folder)
        assert code == 2 and "is not a kvtrace recorder" in err and len(err.splitlines()) == 1
        time.sleep(0.2)
        assert other.poll() is None   # alive: not signalled
        # Its own start, as a recorder writes it (pid_line): that one is asked.
        (folder / "recorder.pid").write_text(pid_line(other.pid))
        assert recorder_of(folder) == other.pid
    finally:
        os.close(claim)
        other.kill()


@pytest.mark.parametrize("size", ["0.5", "1e999MB", "-5MB", "MB", "lots"])
def test_a_size_that_is_not_one_is_refused(tmp_path, capsys, size):
    code, _, err = run(capsys, "record", "-o", tmp_path / "d", "--ring", size)
    assert code == 2 and "is not a size" in err


def test_a_keyframe_interval_that_is_not_a_number_is_no_keyframes(monkeypatch, caplog):
    from kvtrace.record.sink import keyframe_every

    for text in ("²", "often", "0"):
        monkeypatch.setenv("KVTRACE_KEYFRAME_EVERY", text)
        assert keyframe_every() is None
    assert "not a positive number" in caplog.text
