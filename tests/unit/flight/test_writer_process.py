"""The vLLM recorder's writer process as a flight recorder
(``python -m kvtrace.flight.writer_process --ring``), fed as a vLLM engine's
process feeds it (``sink.start_writer``: the header, then the records of a
real vLLM trace through the shared-memory ring), with no engine: the segment
directory it writes, its triggers, and what an engine killed leaves."""

from __future__ import annotations

import gzip
import socket
import time
from pathlib import Path

import orjson
import pytest

from kvtrace import cli
from kvtrace.flight import segment_files
from kvtrace.flight.replay import replay_folder
from kvtrace.record.folder import ask_pin
from kvtrace.record.sink import KEYFRAMING_WRITER, start_writer
from kvtrace.replay import replay_file
from kvtrace.replay.keyframes import replay_from
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

TRACES = Path(__file__).resolve().parents[3] / "traces"


class Fed:
    """A writer process for the segment directory ``folder``, fed by hand."""

    def __init__(self, folder: Path, header: bytes, ring: int = 60_000, segment: int = 16_000):
        self.folder = folder
        self.ring, self.proc, self.sock = start_writer(
            folder, header + b"\n", 1 << 20, module=KEYFRAMING_WRITER,
            args=["--ring", str(ring), "--segment", str(segment)], folder=True)
        self.proc.reap()

    def put(self, item) -> None:
        chunk = orjson.dumps(item) + b"\n"
        while not self.ring.offer(chunk):
            time.sleep(0.001)

    def hang_up(self) -> int | None:
        """The engine's process is gone: the writer ends the recording."""
        self.sock.shutdown(socket.SHUT_WR)
        rc = self.proc.wait(60)
        self.sock.close()
        self.ring.close()
        return rc

    def wait_for(self, what, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline
            time.sleep(0.01)


def _newest(folder: Path) -> int:
    """The number of the segment under way."""
    return max(int(p.name[8:14]) for p in folder.glob("segment-*"))


def _lines(name: str) -> tuple[bytes, list[dict]]:
    raw = gzip.decompress((TRACES / name).read_bytes()).splitlines()
    return raw[0], [orjson.loads(x) for x in raw[1:]]


def _feed_all(fed: Fed, records: list[dict]) -> None:
    for d in records:
        if d["kind"] == "end":
            fed.put(["end", d["status"], d.get("error"), d.get("dropped_events", 0)])
        else:
            fed.put(d)


def _pins(folder: Path) -> dict:
    return orjson.loads((folder / "pins.json").read_bytes())


def test_a_vllm_trace_through_the_writer_process_makes_a_ring_that_replays_as_the_trace(
        tmp_path, capfd):
    header, records = _lines("preemption.jsonl.gz")
    folder = tmp_path / "ring"
    fed = Fed(folder, header, ring=10 << 20)   # all kept: the directory is the whole trace
    _feed_all(fed, records)
    assert fed.hang_up() == 0
    segs = segment_files(folder)
    assert len(segs) >= 8 and not (folder / "recorder.pid").exists()
    whole = replay_file(TRACES / "preemption.jsonl.gz", device=None)
    parts = replay_folder(folder)
    assert parts.divergences == whole.divergences == [] and parts.steps == whole.steps
    assert parts.truncation is None and parts.gaps == []
    for seg in segs[1:]:
        with TraceReader(seg) as r:
            first = next(iter(r))
        assert type(first) is ev.Keyframe and replay_from(seg, first.step).divergences == []
    assert "pinned" not in capfd.readouterr().err


def test_an_engine_killed_leaves_every_step_it_handed_on_and_pins_the_last_segments(
        tmp_path, capfd):
    header, records = _lines("preemption.jsonl.gz")
    cut = next(i for i, d in enumerate(records) if d["kind"] == "step" and d["step"] == 90)
    folder = tmp_path / "ring"
    fed = Fed(folder, header)
    _feed_all(fed, records[:cut + 1])
    assert fed.hang_up() == 0   # no end line: the engine's process died
    parts = replay_folder(folder)
    assert parts.steps_in_trace == 91 and parts.divergences == []
    assert parts.truncation is not None
    pins = _pins(folder)
    last = segment_files(folder)[-1].name
    assert last in pins and "without shutting down" in pins[last]
    assert "without shutting down" in capfd.readouterr().err


def test_a_failed_schedule_and_the_engine_stopping_on_it_pin(tmp_path, capfd):
    header, records = _lines("vllm-bugs/spec-padding-cut.jsonl.gz")
    folder = tmp_path / "ring"
    fed = Fed(folder, header)
    _feed_all(fed, records)
    assert fed.hang_up() == 0
    err = capfd.readouterr().err
    assert "the engine's schedule() raised at step 30: AssertionError" in err
    assert "replay found a divergence at step 30" in err and "(S:1372)" in err
    # The end record says the same failure: the segment is pinned once for it.
    assert "ends interrupted" not in err
    assert segment_files(folder)[-1].name in _pins(folder)


def test_an_engine_that_stops_interrupted_pins_its_last_segment(tmp_path, capfd):
    header, records = _lines("vllm-bugs/async-recompute-placeholders.jsonl.gz")
    folder = tmp_path / "ring"
    fed = Fed(folder, header)
    _feed_all(fed, records)
    assert fed.hang_up() == 0
    err = capfd.readouterr().err
    assert "the recording ends interrupted: the engine raised IndexError" in err
    assert "an invariant broke at step 2: request 5-bb58fd9d, state.num_computed_tokens " \
           "112 (expected <= 111; I1)" in err


def test_dump_and_a_reason_asked_reach_the_writer_process_at_once(tmp_path, capfd):
    header, records = _lines("preemption.jsonl.gz")
    folder = tmp_path / "ring"
    fed = Fed(folder, header)
    _feed_all(fed, records[:40])
    fed.wait_for(lambda: (folder / "recorder.pid").exists())
    pid = int((folder / "recorder.pid").read_text().split()[0])
    assert pid == fed.proc.pid
    assert cli.run(["dump", str(folder)]) == 0
    # The engine idles: the writer pins at once, at no record.
    fed.wait_for(lambda: (folder / "pins.json").exists())
    assert set(_pins(folder).values()) == {"SIGUSR2 (kvtrace dump)"}
    dumped = _newest(folder)
    _feed_all(fed, records[40:200])
    # Asked once the writer is past the segments the dump pinned (the one
    # under way and the next): a segment keeps its first reason.
    fed.wait_for(lambda: _newest(folder) >= dumped + 2)
    ask_pin(folder, "vLLM's metrics failed: ValueError: Counters can only be incremented by "
                    "non-negative amounts.")
    fed.wait_for(lambda: any("metrics" in w for w in _pins(folder).values()))
    assert not [p for p in folder.iterdir() if p.name.startswith(".pin-")]
    _feed_all(fed, records[200:])
    assert fed.hang_up() == 0
    assert not (folder / "recorder.pid").exists()
    err = capfd.readouterr().err
    assert "SIGUSR2 (kvtrace dump)" in err and "vLLM's metrics failed" in err


def test_a_record_that_breaks_the_schema_pins_and_is_kept_as_sent(tmp_path, capfd):
    header, records = _lines("preemption.jsonl.gz")
    at = next(i for i, d in enumerate(records) if d["kind"] == "step" and d["step"] == 30)
    records[at]["states"][0]["num_computed_tokens"] = -3   # a count below 0
    folder = tmp_path / "ring"
    fed = Fed(folder, header, ring=10 << 20)
    _feed_all(fed, records)
    assert fed.hang_up() == 0
    err = capfd.readouterr().err
    assert f"record {records[at]['seq']} (step, step 30) breaks the trace's schema" in err
    assert "keyframes stopped" in err


def test_a_folder_with_segments_or_another_recorder_is_refused(tmp_path):
    header, _ = _lines("preemption.jsonl.gz")
    folder = tmp_path / "ring"
    fed = Fed(folder, header)
    with pytest.raises(ValueError, match="another recorder writes segments there"):
        Fed(folder, header)
    assert fed.hang_up() == 0
    with pytest.raises(ValueError, match="holds segments already"):
        Fed(folder, header)
